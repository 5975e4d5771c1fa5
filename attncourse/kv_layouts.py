r"""Chapter 05's from-scratch comparison: one character-level GPT with five attention layouts at matched caches.

The model is :func:`attncourse.char_lm.char_lm`'s (2 pre-norm blocks, ``d = 64``, 4 query heads of 16, RoPE base
10,000) with its attention swapped per layout. Per token and layer the cache holds

* MHA: keys and values of 4 heads of 16, **128** numbers; GQA-2: 2 KV heads, **64**; MQA: 1 KV head, **32**;
* MLA-64 and MLA-32: :class:`~attncourse.mla.MultiHeadLatentAttention` (DeepSeek-V2) with a decoupled RoPE key of
  8 numbers (half the 16-wide head, DeepSeek's ratio of 64 to 128) and a latent of 56 or 24, **64** and **32**
  numbers: the caches of GQA-2 and MQA, number for number (so byte for byte in any one dtype); MLA-96 (a latent
  of 88) sits between GQA-2's cache and MHA's, DeepSeek-V2's comparison (MLA at a smaller cache than MHA's).

Every layout trains with :func:`~attncourse.char_lm.train_char_lm`'s recipe (AdamW, one-cycle, peak 3e-3, batch
32 windows of 64 characters) for the same number of steps, on the same batches from the same seed, on *Coriolanus*
(:func:`~attncourse.char_lm.shakespeare_chars`, continuous text). ``python -m attncourse.kv_layouts 300`` retrains
all fifteen runs for 300 steps (half the char-LM's 600), one spawned process per run, and writes
``notebooks/results/ch05_layouts.json`` (held-out losses every 50 steps) and ``ch05_layouts_seed0.pt`` (the seed-0
MQA and MLA-32 weights), which lesson 05 reads, measures again and checks. ``python -m attncourse.kv_layouts add
MLA-96`` trains the listed layouts alone (one process, the stored seeds and steps) and adds them to the JSON.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from .char_lm import CONTEXT, STEPS, char_lm, shakespeare_chars, windows
from .gpt import GPT, GPTConfig, lm_loss, train_lm
from .mla import MultiHeadLatentAttention

N_HEADS, HEAD_DIM, D_MODEL = 4, 16, 64
# layout -> ("gqa", n_kv_heads) or ("mla", kv_rank, rope_dim)
LAYOUTS = {"MHA": ("gqa", 4), "GQA-2": ("gqa", 2), "MQA": ("gqa", 1),
           "MLA-64": ("mla", 56, 8), "MLA-32": ("mla", 24, 8), "MLA-96": ("mla", 88, 8)}


def cache_numbers(layout: str) -> int:
    """Numbers cached per token and layer by `layout` (keys + values, or latent + RoPE key)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    spec = LAYOUTS[layout]
    return 2 * spec[1] * HEAD_DIM if spec[0] == "gqa" else spec[1] + spec[2]


class LatentSelfAttention(nn.Module):
    """:class:`~attncourse.mla.MultiHeadLatentAttention` behind the call signature of
    :class:`~attncourse.transformer.TransformerBlock`'s attention (causal self-attention, no cache).

    The GPT passes a keep mask built from positions; this layer accepts only the plain causal one (its own RoPE
    key carries the positions, so the GPT is built with ``position="none"``)."""

    def __init__(self, mla: MultiHeadLatentAttention):
        super().__init__()
        if not isinstance(mla, MultiHeadLatentAttention):
            raise TypeError(f"mla must be a MultiHeadLatentAttention, got {type(mla).__name__}")
        self.mla = mla
        self.absorbed = False  # evaluate with the absorbed form when True (same function, checked in tests)

    def forward(self, x: torch.Tensor, *, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                kv_cache=None, return_weights: bool = False):
        t = x.shape[1]
        if kv_cache is not None:
            raise ValueError("LatentSelfAttention runs without a cache; decode with the MLA module and an MLACache")
        if attn_mask is not None and not (attn_mask.dtype == torch.bool and attn_mask.shape == (t, t) and torch.equal(
                attn_mask, torch.ones(t, t, dtype=torch.bool, device=attn_mask.device).tril())):
            raise ValueError(f"attn_mask must be the causal (T, T) keep mask, got shape {tuple(attn_mask.shape)}")
        out = self.mla(x, is_causal=True, absorbed=self.absorbed)  # (B, T, d)
        return (out, None) if return_weights else out


def layout_lm(layout: str, vocab_size: int, seed: int) -> GPT:
    """The untrained character GPT of `seed` with `layout`'s attention in both blocks."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    spec = LAYOUTS[layout]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if spec[0] == "gqa":
            if spec[1] == N_HEADS:
                return char_lm(vocab_size, seed)
            return GPT(GPTConfig(vocab_size=vocab_size, block_size=CONTEXT, d_model=D_MODEL, n_heads=N_HEADS,
                                 n_kv_heads=spec[1], n_layers=2, position="rope"))
        model = GPT(GPTConfig(vocab_size=vocab_size, block_size=CONTEXT, d_model=D_MODEL, n_heads=N_HEADS,
                              n_layers=2, position="none"))
        for block in model.blocks:
            block.attn = LatentSelfAttention(MultiHeadLatentAttention(
                D_MODEL, N_HEADS, kv_rank=spec[1], head_dim=HEAD_DIM, rope_dim=spec[2]))
        return model


def held_out_windows(held_out: torch.Tensor) -> torch.Tensor:
    """The whole held-out text as consecutive, non-overlapping windows of CONTEXT + 1 characters: (N, CONTEXT + 1)."""
    n = (len(held_out) - 1) // CONTEXT
    return torch.stack([held_out[i * CONTEXT:i * CONTEXT + CONTEXT + 1] for i in range(n)])


@torch.no_grad()
def held_out_loss(model: nn.Module, held: torch.Tensor) -> float:
    """Mean next-character loss (nats) of `model` over the windows `held` (N, T + 1)."""
    model.eval()
    return float(lm_loss(model, held))


def train_layout(layout: str, train: torch.Tensor, vocab_size: int, seed: int, steps: int = STEPS,
                 held: torch.Tensor | None = None, eval_every: int = 100, lr: float = 3e-3
                 ) -> tuple[GPT, list[float], list[float]]:
    """Train `layout` on random windows (the batches depend on `seed` only, so every layout sees the same ones) with
    a one-cycle schedule peaking at `lr`; returns (model, training losses, held-out losses every `eval_every` steps
    and at the end)."""
    model = layout_lm(layout, vocab_size, seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    curve: list[float] = []

    def batch(step: int) -> torch.Tensor:
        if held is not None and step % eval_every == 0:
            curve.append(held_out_loss(model, held))
            model.train()
        return windows(train, 32, CONTEXT, gen)

    losses = train_lm(model, batch, steps, lr=lr)
    if held is not None:
        curve.append(held_out_loss(model, held))
    return model, losses, curve


def _train_one(layout: str, seed: int, data_dir: str, steps: int = STEPS
               ) -> tuple[str, int, list[float], int, dict | None]:
    """One worker: `layout` on `seed` -> (layout, seed, held-out curve, parameters, weights if seed 0 of MQA/MLA-32)."""
    torch.set_num_threads(1)
    train, held_text, vocab = shakespeare_chars(Path(data_dir) / "shakespeare" / "coriolanus.txt")
    held = held_out_windows(held_text)
    model, _, curve = train_layout(layout, train, len(vocab), seed, steps, held=held, eval_every=50)
    keep = seed == 0 and layout in ("MQA", "MLA-32")
    print(layout, seed, round(curve[-1], 4), flush=True)
    return layout, seed, curve, sum(p.numel() for p in model.parameters()), model.state_dict() if keep else None


def main(out_dir: str | Path = "notebooks/results", seeds=(0, 1, 2), workers: int | None = None,
         steps: int = STEPS) -> dict:
    """Train every layout on every seed (one process per run), write the JSON of results and the seed-0
    weights of MQA and MLA-32; returns the results."""
    from concurrent.futures import ProcessPoolExecutor

    out_dir = Path(out_dir)
    data_dir = str(out_dir.parent / "data")
    result = {"seeds": list(seeds), "steps": steps, "context": CONTEXT, "eval_every": 50,
              "cache_numbers": {lay: cache_numbers(lay) for lay in LAYOUTS}, "params": {},
              "held_out": {lay: [None] * len(seeds) for lay in LAYOUTS},
              "curves": {lay: [None] * len(seeds) for lay in LAYOUTS}}
    weights = {}
    runs = [(lay, seed) for lay in LAYOUTS for seed in seeds]
    import multiprocessing

    with ProcessPoolExecutor(workers or len(runs), mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs = pool.map(_train_one, *zip(*runs), [data_dir] * len(runs), [steps] * len(runs))
        for layout, seed, curve, n_params, w in jobs:
            i = list(seeds).index(seed)
            result["held_out"][layout][i], result["curves"][layout][i] = curve[-1], curve
            result["params"][layout] = n_params
            if w is not None:
                weights[layout] = w
    (out_dir / "ch05_layouts.json").write_text(json.dumps(result, indent=1))
    torch.save(weights, out_dir / "ch05_layouts_seed0.pt")
    return result


def add_layouts(layouts, out_dir: str | Path = "notebooks/results") -> dict:
    """Train `layouts` (names of LAYOUTS) in this process, one run after the other, with the stored run's seeds and
    steps, and merge them into its JSON (the stored weights are left alone); returns the results."""
    out_dir = Path(out_dir)
    path = out_dir / "ch05_layouts.json"
    result = json.loads(path.read_text())
    for layout in layouts:
        if layout not in LAYOUTS:
            raise ValueError(f"layouts must name entries of {list(LAYOUTS)}, got {layout!r}")
        result["cache_numbers"][layout] = cache_numbers(layout)
        result["held_out"][layout], result["curves"][layout] = [], []
        for seed in result["seeds"]:
            _, _, curve, n_params, _ = _train_one(layout, seed, str(out_dir.parent / "data"), result["steps"])
            result["held_out"][layout].append(curve[-1])
            result["curves"][layout].append(curve)
            result["params"][layout] = n_params
    path.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":  # python -m attncourse.kv_layouts [STEPS [WORKERS]] | add LAYOUT...
    if len(sys.argv) > 1 and sys.argv[1] == "add":
        add_layouts(sys.argv[2:])
    else:
        main(steps=int(sys.argv[1]) if len(sys.argv) > 1 else STEPS,
             workers=int(sys.argv[2]) if len(sys.argv) > 2 else None)
