r"""Chapter 12's tests of the papers' central claims, on the chapter's own models.

- Sun et al. (2024, "Massive activations", Section 4.3): an **explicit attention bias**, a learnable key
  :math:`k'_h` and value :math:`v'_h` per head that every query sees, in front of the real keys:
  :math:`\mathrm{softmax}(q [K; k']^\top/\sqrt d)\,[V; v']`. Their reference is ``gpt-2/model_attn_bias.py`` in
  locuslab/massive-activations (commit 7e5e64c): ``k_bias``, ``v_bias`` of shape (1, H, 1, D), normal(0, 0.02),
  concatenated at position 0 of the keys and values, with a mask column that every query may attend.
  :func:`attn_bias_attention` and :class:`AttnBiasAttention`; :func:`with_attn_bias` swaps it into a
  :class:`~attncourse.GPT`. It is the value-carrying cousin of gpt-oss's sink logit (whose value is 0 and whose
  score does not depend on the query).
- :func:`train_induction`: the training loop of lesson 12 (section 1's model and data, section 3's recipe) as a
  function, with the learning rate, the head count and the sink logits' initial value as arguments, for the
  learning-rate sweep (Qiu et al. 2025: the gate tolerates larger learning rates), the matched-head baseline of
  differential attention and the sink-logit initialisation ablation. The runs themselves are made by
  ``python -m attncourse.variant_claims`` (stored in ``notebooks/results/ch12_claims_full.json``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate
from ._procs import forked_map as _pool
from .mha import MultiHeadAttention, merge_heads, repeat_kv
from .sdpa import compute_dtype
from .sink_variants import masked_scores

__all__ = ["attn_bias_attention", "AttnBiasAttention", "with_attn_bias", "train_induction", "evicted_losses",
           "read_run"]


def attn_bias_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_bias: torch.Tensor,
                        v_bias: torch.Tensor, attn_mask: torch.Tensor | None = None, *, is_causal: bool = False,
                        scale: float | None = None, return_weights: bool = False
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Softmax attention over one extra key :math:`k'_h` with value :math:`v'_h` per head, seen by every query
    (Sun et al. 2024's explicit attention bias).

    Args:
        query (B, H, Tq, D), key (B, H, Tk, D), value (B, H, Tk, Dv); k_bias (H, D), v_bias (H, Dv).
        attn_mask: bool (True = may attend) or float (added), broadcastable to (B, H, Tq, Tk): the real keys
            only; the bias key is always visible.
        is_causal: top-left causal mask over the real keys.
    Returns (B, H, Tq, Dv), and the weights on the real keys (B, H, Tq, Tk) if `return_weights` (the bias key's
    weight is 1 minus a row's sum). Scores and softmax run in float32 for half-precision inputs.
    """
    for name, t in (("query", query), ("key", key), ("value", value), ("k_bias", k_bias), ("v_bias", v_bias)):
        _validate.tensor(name, t, floating=True)
    if query.dim() != 4 or key.shape != query.shape[:2] + key.shape[2:3] + query.shape[3:] or \
            value.shape[:3] != key.shape[:3]:
        raise ValueError(f"query (B, H, Tq, D), key (B, H, Tk, D) and value (B, H, Tk, Dv) needed, got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    h = query.shape[1]
    if k_bias.shape != (h, query.shape[-1]) or v_bias.shape != (h, value.shape[-1]):
        raise ValueError(f"k_bias must be (H, D) = ({h}, {query.shape[-1]}) and v_bias (H, Dv) = ({h}, "
                         f"{value.shape[-1]}), got {tuple(k_bias.shape)} and {tuple(v_bias.shape)}")
    work = compute_dtype(query.dtype)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    q = query.to(work)
    scores = masked_scores(q, key.to(work), scale, attn_mask, is_causal)  # (B, H, Tq, Tk)
    bias_score = (q @ k_bias.to(work)[None, :, :, None]) * scale  # (B,H,Tq,D) @ (1,H,D,1) -> (B,H,Tq,1)
    weights = torch.softmax(torch.cat([bias_score, scores], dim=-1), dim=-1)  # (B, H, Tq, 1 + Tk)
    out = weights[..., :1] * v_bias.to(work)[None, :, None, :] + weights[..., 1:] @ value.to(work)  # (B,H,Tq,Dv)
    out = out.to(value.dtype)
    return (out, weights[..., 1:]) if return_weights else out


class AttnBiasAttention(MultiHeadAttention):
    """:class:`~attncourse.MultiHeadAttention` with Sun et al.'s explicit attention bias: ``k_bias`` (H, D) and
    ``v_bias`` (H, D), normal(0, 0.02) from a generator seeded with `init_seed` (the global random state is not
    touched, so the other weights are those of a plain layer built at the same point). ``forward(x, *,
    attn_mask=None, is_causal=False, kv_cache=None, return_weights=False)``: self-attention without a cache; the
    weights returned are those on the real keys."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *, bias: bool = False,
                 init_seed: int = 0):
        super().__init__(d_model, n_heads, n_kv_heads, bias=bias)
        g = torch.Generator().manual_seed(int(init_seed))
        self.k_bias = nn.Parameter(0.02 * torch.randn(n_heads, self.head_dim, generator=g))
        self.v_bias = nn.Parameter(0.02 * torch.randn(n_heads, self.head_dim, generator=g))

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False, kv_cache: Any = None, return_weights: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d_model) -> (B, T, d_model) [, weights on the real keys (B, H, T, T)]."""
        if context is not None or kv_cache is not None:
            raise ValueError("AttnBiasAttention is self-attention without a KV cache: context and kv_cache must "
                             "be None")
        q, k, v = self.project_qkv(x)  # (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)  # (B, H, T, D)
        out, weights = attn_bias_attention(q, k, v, self.k_bias, self.v_bias, attn_mask, is_causal=is_causal,
                                           return_weights=True)  # (B, H, T, D), (B, H, T, T)
        out = self.o_proj(merge_heads(out))  # (B, H, T, D) -> (B, T, d_model)
        return (out, weights) if return_weights else out


def with_attn_bias(model: nn.Module) -> nn.Module:
    """Swap every block's attention of a :class:`~attncourse.GPT` (MHA, learned or no positions) for an
    :class:`AttnBiasAttention` with the same weights (``init_seed`` = the layer's index); returns the model."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or getattr(model.config, "position", None) not in ("learned", "none", "sinusoidal"):
        raise ValueError("with_attn_bias needs a GPT with learned, sinusoidal or no positions (RoPE and ALiBi "
                         "live inside the attention)")
    for i, block in enumerate(blocks):
        old = block.attn
        if old.n_kv_heads != old.n_heads:
            raise ValueError(f"with_attn_bias needs MHA, got n_kv_heads={old.n_kv_heads}, n_heads={old.n_heads}")
        new = AttnBiasAttention(old.d_model, old.n_heads, bias=old.q_proj.bias is not None, init_seed=i)
        state = {**old.state_dict(), "k_bias": new.k_bias.data, "v_bias": new.v_bias.data}
        new.load_state_dict(state)
        block.attn = new
    return model


# ----------------------------------------------------------------------------- lesson 12's training loop

V, T = 32, 24  # lesson 12: vocabulary, training sequence length
L = T // 2  # segment length of the test sequences
RECIPE = dict(steps=1000, lr=5e-3, warmup=100)  # lesson 12's one recipe (section 3)


def test_batch() -> torch.Tensor:
    """Lesson 12's test sequences: (128, 2L), a random segment of L tokens, then the same again."""
    from .heads import repeated_tokens
    return repeated_tokens(128, L, V, generator=torch.Generator().manual_seed(2))


def new_model(attention: str, seed: int, *, n_heads: int = 2, sink_init: float | None = None) -> nn.Module:
    """Lesson 12's attention-only model with seed `seed`'s initial weights (the global seed is not moved);
    `sink_init` sets every sink logit of a ``"sink_logit"`` model (0 by default)."""
    from .heads import AttnOnlyConfig, AttnOnlyTransformer
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AttnOnlyTransformer(AttnOnlyConfig(V, block_size=T, d_model=64, n_heads=n_heads, attention=attention))
    if sink_init is not None:
        if attention != "sink_logit":
            raise ValueError(f"sink_init needs attention='sink_logit', got {attention!r}")
        with torch.no_grad():
            for attn in model.attns:
                attn.sinks.fill_(float(sink_init))
    return model


def train_induction(attention: str, seed: int, *, steps: int = 1000, lr: float = 5e-3, warmup: int = 100,
                    n_heads: int = 2, sink_init: float | None = None, every: int = 10, batch_size: int = 64,
                    make_batch=None) -> tuple[nn.Module, dict]:
    """Lesson 12's ``train_induction`` (same initial weights, batches, test sequences and measurements for the
    same seed), returning (trained model, history): every `every` steps the repeated-half and first-half test
    losses, the best layer-2 induction score and layer-1 previous-token score; and every step's training loss.
    `make_batch(batch_size, generator)` -> (B, T) replaces the lesson's ``repeated_segment_tokens`` data."""
    from .heads import induction_scores, previous_token_scores, repeated_segment_tokens, token_losses
    for name, x in (("steps", steps), ("every", every), ("batch_size", batch_size)):
        _validate.positive_int(name, x)
    if not (isinstance(lr, float) and lr > 0):
        raise ValueError(f"lr must be a positive float, got {lr!r}")
    test = test_batch()
    model = new_model(attention, seed, n_heads=n_heads, sink_init=sink_init)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    data = torch.Generator().manual_seed(seed + 1)  # the same batches for every attention
    hist: dict[str, list] = {k: [] for k in ("step", "repeat", "first", "induction", "prev", "train")}
    for step in range(steps + 1):
        if step % every == 0:
            with torch.no_grad():
                logits, maps = model(test, return_weights=True)  # (B, 2L, V), 2 x (B, H, 2L, 2L)
                losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), test[:, 1:], reduction="none")
            hist["step"].append(step)
            hist["repeat"].append(losses[:, L:].mean().item())
            hist["first"].append(losses[:, :L - 1].mean().item())
            hist["induction"].append(induction_scores(maps[1], L).mean(0).max().item())
            hist["prev"].append(previous_token_scores(maps[0]).mean(0).max().item())
        if step == steps:
            break
        if warmup:
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / warmup)
        batch = repeated_segment_tokens(batch_size, T, V, generator=data)[0] if make_batch is None \
            else make_batch(batch_size, data)  # (B, T)
        loss = token_losses(model, batch).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        hist["train"].append(loss.item())
    return model.eval(), hist


def evicted_losses(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token losses (B, T - 1) of an attention-only model whose every layer attends causally without key 0
    for queries t >= 1 (a cache that evicted the first token; query 0 keeps it). An attention bias or sink logit
    is not a token and stays."""
    i = torch.arange(tokens.shape[1])
    keep = (i[None, :] <= i[:, None]) & ((i[None, :] > 0) | (i[:, None] == 0))  # (T, T) True = may attend
    x = model.tok(tokens) + model.pos(i)  # (B, T, d)
    for norm, attn in zip(model.norms, model.attns):
        x = x + attn(norm(x), attn_mask=keep)
    logits = model.head(model.norm(x))  # (B, T, V)
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")


@torch.no_grad()
def read_run(model: nn.Module) -> dict:
    """What lesson 12 reads off a trained induction model: the loss on each half; per layer, the largest weight a
    head gives key 0 over the first copy (queries 1..L-1) and the largest share a head gives to "nothing" (1 minus
    its row sum: the sink logit's or the attention bias's share; 0 for softmax); the loss rise on each half when
    key 0 is evicted."""
    from .heads import token_losses
    test = test_batch()
    _, maps = model(test, return_weights=True)  # 2 x (B, H, 2L, 2L)
    full, gone = token_losses(model, test), evicted_losses(model, test)  # (B, 2L - 1) each
    return dict(repeat=full[:, L:].mean().item(), first=full[:, 1:L - 1].mean().item(),
                key0=[w[:, :, 1:L, 0].mean((0, 2)).max().item() for w in maps],
                nothing=[(1 - w[:, :, 1:L].sum(-1)).mean((0, 2)).max().item() for w in maps],
                evict_first=(gone - full)[:, 1:L - 1].mean().item(), evict_repeat=(gone - full)[:, L:].mean().item())


def _spikes(train: list[float], warmup: int) -> int:
    """Loss spikes after the warm-up: steps whose training loss exceeds the mean of the previous 20 by 0.5 nats."""
    return sum(train[s] > sum(train[s - 20:s]) / 20 + 0.5 for s in range(max(warmup, 20), len(train)))


SWEEP_LRS = (5e-3, 8e-3, 1.25e-2, 2e-2, 8e-2)  # the recipe's learning rate, 1.6x, 2.5x, 4x and 16x it
SEEDS = (0, 1, 2)


def _job(job: tuple) -> tuple:
    torch.set_num_threads(1)
    name, attention, seed, kw = job
    model, hist = train_induction(attention, seed, **{**RECIPE, "every": 50, **kw})
    out = dict(read_run(model), best_induction=max(hist["induction"]), induction=hist["induction"][-1],
               spikes=_spikes(hist["train"], RECIPE["warmup"]), repeat_curve=hist["repeat"],
               train_curve=[round(sum(hist["train"][i:i + 50]) / 50, 4) for i in range(0, len(hist["train"]), 50)])
    if attention == "sink_logit":
        out["sinks"] = [a.sinks.tolist() for a in model.attns]
    state = {k: v.clone() for k, v in model.state_dict().items()} if (name == "attn_bias" and seed == 0) else None
    return name, seed, kw, out, state


def jobs() -> list[tuple]:
    """Every run of the stored file, most wanted first: (name, attention, seed, keyword arguments of
    :func:`train_induction`). The recipe's own runs (softmax, gated, sink logit at 0 and lr 5e-3) are lesson 12's
    stored ``variant_runs.pt``, which this loop reproduces step for step."""
    out = [("attn_bias", "attn_bias", s, {}) for s in SEEDS]
    out += [(f"lr/{attention}/{lr:g}", attention, s, dict(lr=lr)) for lr in SWEEP_LRS[:0:-1]
            for attention in ("softmax", "gated") for s in SEEDS]
    return out + [(name, attention, s, kw) for name, attention, kw in (
        ("softmax_4x16", "softmax", dict(n_heads=4)), ("gated_value", "gated_value", {}),
        ("sink_init/-10", "sink_logit", dict(sink_init=-10.0)), ("sink_init/+3", "sink_logit", dict(sink_init=3.0)),
        ("gated_headwise", "gated_headwise", {})) for s in SEEDS]


def run_all(path: str = "notebooks/results/ch12_claims_full.json", processes: int = 2,
            part: tuple[int, int] = (0, 1)) -> dict:
    """Train every run of :func:`jobs` (42 runs of 1000 steps: some 15 minutes of CPU, in two processes) and
    store what :func:`read_run` reads off each, per name and seed; attn_bias seed 0's weights go next to it.
    ``part=(k, n)`` runs only ``jobs()[k::n]`` (separate processes on a shared machine; :func:`merge` joins the
    files)."""
    import json
    from pathlib import Path

    _check_run_args(path, processes)
    if not (isinstance(part, tuple) and len(part) == 2 and all(isinstance(x, int) for x in part)
            and part[1] > 0 and 0 <= part[0] < part[1]):
        raise ValueError(f"part must be a tuple (k, n) of ints with 0 <= k < n, got {part!r}")
    todo = jobs()[part[0]::part[1]]
    store: dict[str, Any] = {"made_by": "python -m attncourse.variant_claims", "recipe": RECIPE, "runs": {}}
    with _pool(processes) as pool:
        for name, seed, kw, out, state in pool(_job, todo):  # written after every run: a partial file is usable
            store["runs"].setdefault(name, {"kwargs": kw, "seeds": {}})["seeds"][str(seed)] = out
            if state is not None:
                torch.save(state, Path(path).with_name("ch12_attn_bias_seed0.pt"))
            Path(path).write_text(json.dumps(store, indent=1))
    return store


def _check_run_args(path: object, processes: object) -> None:
    """The stored runs' arguments, checked before any process starts."""
    import os

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or a path, got {type(path).__name__}")
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive int, got {processes!r}")


# ----------------------------------------------------------------------------- lesson 12's tiny GPTs (section 2)

GPT_RECIPE = dict(steps=3000, lr=5e-3)  # lesson 12's train_lm recipe for the tiny GPTs with a BOS token


def new_gpt(seed: int, *, attn_bias: bool = False) -> nn.Module:
    """Lesson 12's tiny GPT (BOS = id V, 2 blocks, 4 heads of 16) with seed `seed`'s initial weights; with
    `attn_bias` its attentions are :class:`AttnBiasAttention` (the same weights, plus k', v')."""
    from .gpt import GPT, GPTConfig
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = GPT(GPTConfig(vocab_size=V + 1, block_size=T + 1, d_model=64, n_heads=4, n_layers=2))
    return with_attn_bias(model) if attn_bias else model


def with_bos(x: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, 1 + T): BOS (id V) in front."""
    return torch.cat([torch.full((x.shape[0], 1), V), x], dim=1)


def train_gpt(seed: int, *, attn_bias: bool = False) -> tuple[nn.Module, list[float]]:
    """Lesson 12's ``gpt_job``: :func:`new_gpt` trained with ``train_lm`` (:data:`GPT_RECIPE`) on BOS + repeated
    segments from the generator ``100 + seed``."""
    from .gpt import train_lm
    from .heads import repeated_segment_tokens
    torch.set_num_threads(1)
    model, data = new_gpt(seed, attn_bias=attn_bias), torch.Generator().manual_seed(100 + seed)
    losses = train_lm(model, lambda step: with_bos(repeated_segment_tokens(64, T, V, generator=data)[0]),
                      **GPT_RECIPE)
    return model, losses


@torch.no_grad()
def read_gpt(model: nn.Module) -> dict:
    """Per block: the largest batch-mean absolute activation of the residual stream over its median (Sun et al.'s
    measure), and the entries over 100x; per layer and head, the weight on BOS and the share given to "nothing"
    (1 minus the row sum: the attention bias) over the first copy (queries 2..L-1); the loss on each half."""
    test = with_bos(test_batch())  # (128, 1 + 2L)
    streams, maps = [], []
    hooks = [b.register_forward_hook(lambda mod, args, out: streams.append(out)) for b in model.blocks]
    hooks += [b.attn.register_forward_hook(lambda mod, args, out: maps.append(out[1])) for b in model.blocks]
    try:
        logits = model(test)[:, :-1]  # (B, 2L, V + 1)
    finally:
        for h in hooks:
            h.remove()
    per_token = F.cross_entropy(logits.transpose(1, 2), test[:, 1:], reduction="none")  # (B, 2L)
    ratio, count = [], []
    for h in streams:
        mag, median = h.abs().mean(0), h.abs().median()  # (1 + 2L, d), scalar
        ratio.append((mag.max() / median).item())
        count.append(int((mag > 100 * median).sum()))
    first = [w[:, :, 3:L + 1] for w in maps]  # (B, H, L-2, 1 + 2L): queries 2..L-1 of the first copy
    return dict(first=per_token[:, 1:L].mean().item(), repeat=per_token[:, L + 1:].mean().item(), ratio=ratio,
                count=count, bos=[w[..., 0].mean((0, 2)).tolist() for w in first],
                nothing=[(1 - w.sum(-1)).mean((0, 2)).tolist() for w in first])


def _gpt_job(seed: int) -> tuple:
    model, losses = train_gpt(seed, attn_bias=True)
    return seed, read_gpt(model.eval()), losses[::50], (model.state_dict() if seed == 0 else None)


def run_gpts(path: str = "notebooks/results/ch12_attn_bias_gpt_full.json", processes: int = 2,
             seeds: tuple[int, ...] = SEEDS) -> dict:
    """Train lesson 12's three tiny GPTs with the attention bias (about 5 minutes of CPU) and store
    :func:`read_gpt` per seed; seed 0's weights go to ``ch12_attn_bias_gpt_seed0.pt`` next to it."""
    import json
    from pathlib import Path

    _check_run_args(path, processes)
    if not (isinstance(seeds, (tuple, list)) and seeds and all(isinstance(s, int) for s in seeds)):
        raise TypeError(f"seeds must be a non-empty tuple of ints, got {seeds!r}")
    store: dict[str, Any] = {"made_by": "python -m attncourse.variant_claims gpt", "recipe": GPT_RECIPE, "seeds": {}}
    with _pool(processes) as pool:
        for seed, read, losses, state in pool(_gpt_job, seeds):
            store["seeds"][str(seed)] = dict(read, losses=losses)
            if state is not None:
                torch.save(state, Path(path).with_name("ch12_attn_bias_gpt_seed0.pt"))
            Path(path).write_text(json.dumps(store, indent=1))
    return store


def merge(paths: list[str], path: str) -> dict:
    """Join the files of several :func:`run_all` parts (or :func:`run_gpts` seeds) into one."""
    import json
    from pathlib import Path

    parts = [json.loads(Path(p).read_text()) for p in paths]
    store = {k: v for k, v in parts[0].items() if k not in ("runs", "seeds")}
    key = "runs" if "runs" in parts[0] else "seeds"
    store[key] = {}
    for p in parts:
        for name, entry in p[key].items():
            if key == "seeds":
                store[key][name] = entry
            else:
                store[key].setdefault(name, {"kwargs": entry["kwargs"], "seeds": {}})["seeds"].update(entry["seeds"])
    Path(path).write_text(json.dumps(store, indent=1))
    return store


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["gpt"]:  # gpt [seed]: all three seeds in two processes, or one seed
        if len(sys.argv) > 2:
            seed = int(sys.argv[2])
            run_gpts(f"notebooks/results/ch12_attn_bias_gpt_part{seed}.json", processes=1, seeds=(seed,))
        else:
            run_gpts()
    elif sys.argv[1:2] == ["part"]:  # part k n: jobs()[k::n] in this process
        k, n = int(sys.argv[2]), int(sys.argv[3])
        run_all(f"notebooks/results/ch12_claims_part{k}.json", processes=1, part=(k, n))
    else:
        run_all()
