r"""Softmax, Gated DeltaNet and 3:1 hybrids as character language models on *Coriolanus*, at one parameter budget.

Chapter 13's trained comparisons are synthetic (recall, parity, counting). This module trains the three layer
schedules on text: :func:`attncourse.char_lm.shakespeare_chars` (90% train, the last 10% held out), one character
per token, windows of :data:`CONTEXT` characters.

Every model is ``embedding -> N pre-norm blocks (RMSNorm, token mixer, RMSNorm, SiLU MLP) -> RMSNorm -> head``
with ``d_model = 32`` and 2 heads of 16; only the mixers differ, by a pattern string:

- ``"A"``: causal softmax attention with RoPE on q and k and a sigmoid output gate (Qwen3-Next's gated attention;
  the gate also brings the layer's weights close to a Gated DeltaNet layer's);
- ``"C"``: the same softmax attention with Gated DeltaNet's short convolution (a causal depthwise filter over the
  last 4 tokens, then SiLU) on q, k and v before RoPE: the control that asks whether the convolution, not the
  recurrence, is what separates the two models;
- ``"W"``: the ``"A"`` layer restricted to a sliding window of the last :data:`WINDOW` characters, as in the
  sliding-window hybrids of Gated DeltaNet (H1, H2; Yang et al. 2024, arXiv:2412.06464) and Based (Arora et al.
  2024, arXiv:2402.18668);
- ``"G"``: :class:`attncourse.gated_deltanet.GatedDeltaNet` (short convolution, L2-normalised q and k, the gated
  delta rule in its chunkwise form, output RMSNorm and gate). It takes no position encoding, as in fla and
  Qwen3-Next: order enters through the convolution and the recurrence.

The MLP width of each schedule is set by :func:`matched_ff` so that the models' parameter counts agree to
within 0.5% (:func:`n_params`). ``FULL=1 python -m attncourse.text_hybrid`` trains every schedule x 3 seeds and writes
``notebooks/results/ch13_text_lm.json`` (:func:`main`; the stored file at 3e-3 predates ``"W"``, which is stored at
``LR=0.01`` only, in ``ch13_text_lm_lr.json``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _validate
from .char_lm import shakespeare_chars, windows
from .gated_deltanet import GatedDeltaNet
from .positions import apply_rope
from .sdpa import scaled_dot_product_attention

CONTEXT = 128  # characters per training window
D_MODEL, N_HEADS, HEAD_DIM, N_LAYERS = 32, 2, 16, 4
SCHEDULES = {"softmax": "AAAA", "Gated DeltaNet": "GGGG", "hybrid 3:1": "GGGA",  # GDN : softmax = 3 : 1
             "softmax + conv": "CCCC",  # the control: softmax attention with the same short convolution
             "hybrid 3:1, window": "GGGW"}  # the attention layer sees the last WINDOW characters only
WINDOW = 32  # characters a "W" layer's query sees (itself and the 31 before it): a quarter of CONTEXT
CONV_SIZE = 4  # the short convolution's kernel, as in Gated DeltaNet
BASE_FF = 128  # the MLP width of the all-Gated-DeltaNet model; the others are widened to match its count
STEPS, BATCH, LR = 300, 16, 3e-3
EVAL_EVERY, EVAL_WINDOWS = 50, 64  # held-out loss every 50 steps on 64 fixed windows of the held-out text


class GatedRopeAttention(nn.Module):
    """Causal softmax attention with RoPE and a sigmoid output gate: (B, T, d_model) -> (B, T, d_model).
    `short_conv`: pass q, k and v through a causal depthwise convolution of :data:`CONV_SIZE` taps and SiLU first,
    initialised and applied as :class:`attncourse.gated_deltanet.GatedDeltaNet` does. `window`: each query sees
    only itself and the `window` - 1 tokens before it (None: every earlier token)."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, short_conv: bool = False,
                 window: int | None = None) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("head_dim", head_dim)):
            _validate.positive_int(name, value)
        if not isinstance(short_conv, bool):
            raise TypeError(f"short_conv must be a bool, got {type(short_conv).__name__}")
        if window is not None:
            _validate.positive_int("window", window)
        self.window = window
        self.n_heads, self.head_dim = n_heads, head_dim
        self.qkv = nn.Linear(d_model, 3 * n_heads * head_dim, bias=False)
        self.conv_weight = (nn.Parameter(torch.randn(3 * n_heads * head_dim, CONV_SIZE) / math.sqrt(CONV_SIZE))
                            if short_conv else None)  # (channels, taps), one filter per channel
        self.gate = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.out = nn.Linear(n_heads * head_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x)  # (B, T, 3 H hd)
        if self.conv_weight is not None:  # causal: each token sees itself and the CONV_SIZE - 1 before it
            padded = F.pad(qkv, (0, 0, CONV_SIZE - 1, 0))  # (B, T + K - 1, C)
            qkv = F.silu((padded.unfold(1, CONV_SIZE, 1) * self.conv_weight).sum(-1))  # (B, T, C, K) -> (B, T, C)
        q, k, v = (t.reshape(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, -1))
        if self.window is None:
            o = scaled_dot_product_attention(apply_rope(q), apply_rope(k), v, is_causal=True)  # (B, H, T, hd)
        else:  # key j is seen by query i iff i - window < j <= i
            lag = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # (T, T) i - j
            mask = (lag >= 0) & (lag < self.window)
            o = scaled_dot_product_attention(apply_rope(q), apply_rope(k), v, attn_mask=mask)  # (B, H, T, hd)
        o = o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(self.gate(x))  # the output gate
        return self.out(o)


class TextHybrid(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab): pre-norm blocks whose mixers follow `pattern` ("A" softmax with
    RoPE, "C" the same with a short convolution, "W" the same over a sliding window of :data:`WINDOW`, "G" Gated
    DeltaNet). Raises ValueError for a pattern with other letters, TypeError/ValueError for sizes."""

    def __init__(self, vocab_size: int, pattern: str, d_ff: int, d_model: int = D_MODEL, n_heads: int = N_HEADS,
                 head_dim: int = HEAD_DIM) -> None:
        super().__init__()
        if not isinstance(pattern, str) or not pattern or set(pattern) - {"G", "A", "C", "W"}:
            raise ValueError(f"pattern must be a non-empty string of 'G', 'A', 'C' and 'W', got {pattern!r}")
        for name, value in (("vocab_size", vocab_size), ("d_ff", d_ff)):
            _validate.positive_int(name, value)
        self.pattern = pattern
        self.tok = nn.Embedding(vocab_size, d_model)
        self.mixers = nn.ModuleList(GatedDeltaNet(d_model, n_heads, head_dim, chunk_size=64) if c == "G"
                                    else GatedRopeAttention(d_model, n_heads, head_dim, short_conv=c == "C",
                                                            window=WINDOW if c == "W" else None)
                                    for c in pattern)
        self.norms = nn.ModuleList(nn.RMSNorm(d_model) for _ in range(2 * len(pattern) + 1))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d_model, d_ff), nn.SiLU(), nn.Linear(d_ff, d_model))
                                  for _ in pattern)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _validate.tensor("tokens", tokens, min_rank=2)
        if tokens.dim() != 2 or tokens.is_floating_point():
            raise ValueError(f"tokens must be integer ids (B, T), got shape {tuple(tokens.shape)}")
        x = self.tok(tokens)  # (B, T, d)
        for i, (kind, mixer, mlp) in enumerate(zip(self.pattern, self.mixers, self.mlps)):
            h = self.norms[2 * i](x)
            x = x + (mixer(h)[0] if kind == "G" else mixer(h))
            x = x + mlp(self.norms[2 * i + 1](x))
        return self.head(self.norms[-1](x))


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def matched_ff(pattern: str, vocab_size: int) -> int:
    """The MLP width that brings the model of `pattern` closest to the all-Gated-DeltaNet model with
    :data:`BASE_FF` (the largest mixer), at the same depth."""
    target = n_params(TextHybrid(vocab_size, "G" * len(pattern), BASE_FF))
    base = n_params(TextHybrid(vocab_size, pattern, BASE_FF))
    per_unit = len(pattern) * (2 * D_MODEL + 1)  # one more hidden unit in every block's MLP
    return BASE_FF + round((target - base) / per_unit)


def build(schedule: str, vocab_size: int, seed: int) -> TextHybrid:
    """The untrained model of `schedule` (a key of :data:`SCHEDULES`) and `seed`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    pattern = SCHEDULES[schedule]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return TextHybrid(vocab_size, pattern, matched_ff(pattern, vocab_size))


def eval_windows(held_out: torch.Tensor, n: int = EVAL_WINDOWS, context: int = CONTEXT) -> torch.Tensor:
    """`n` fixed, evenly spaced windows (n, context + 1) of the held-out text: the same for every model."""
    starts = torch.linspace(0, len(held_out) - context - 2, n).long()
    return torch.stack([held_out[s:s + context + 1] for s in starts.tolist()])


@torch.no_grad()
def held_out_loss(model: nn.Module, batch: torch.Tensor) -> float:
    """Mean next-character cross-entropy (nats) on `batch` (n, T + 1)."""
    model.eval()
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()
    model.train()
    return loss


def train(schedule: str, seed: int, data: tuple[torch.Tensor, torch.Tensor, str], steps: int = STEPS,
          eval_every: int = EVAL_EVERY, stop: int | None = None, lr: float = LR) -> dict:
    """Train one model; returns ``{"train": [loss per step], "eval_steps": [...], "held_out": [...]}`` (nats).
    AdamW (weight decay 0.01), one-cycle schedule to `lr` (default :data:`LR`) over `steps`, gradient clipping at 1, batch
    :data:`BATCH`. `stop`: end after that many steps of the same run (a slice of a stored run, re-measured)."""
    _validate.positive_int("steps", steps)
    _validate.positive_int("eval_every", eval_every)
    if not isinstance(lr, float) or not lr > 0:
        raise ValueError(f"lr must be a positive float, got {lr!r}")
    if stop is not None and not (isinstance(stop, int) and 0 < stop <= steps):
        raise ValueError(f"stop must be an int in 1..steps={steps}, got {stop!r}")
    train_ids, held, vocab = data
    model = build(schedule, len(vocab), seed)
    gen = torch.Generator().manual_seed(2000 + seed)
    batch_eval = eval_windows(held)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    out = {"train": [], "eval_steps": [], "held_out": []}
    for step in range(1, (stop or steps) + 1):
        batch = windows(train_ids, BATCH, CONTEXT, gen)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        out["train"].append(round(loss.item(), 5))
        if step % eval_every == 0 or step == steps:
            out["eval_steps"].append(step)
            out["held_out"].append(round(held_out_loss(model, batch_eval), 5))
    return out


def main(path: str | Path = "notebooks/results/ch13_text_lm.json", seeds: tuple[int, ...] = (0, 1, 2),
         steps: int = STEPS, lr: float = LR) -> dict:
    """Train every schedule of :data:`SCHEDULES` on every seed and write the results to `path` (JSON).
    ``SCHEDULE``, ``SEED`` and ``LR`` in the environment restrict one process to one schedule, seed and peak rate."""
    torch.set_num_threads(1)
    data = shakespeare_chars(Path(__file__).resolve().parents[1] / "notebooks/data/shakespeare/coriolanus.txt")
    vocab_size = len(data[2])
    result = {"config": {"context": CONTEXT, "d_model": D_MODEL, "n_heads": N_HEADS, "head_dim": HEAD_DIM,
                         "steps": steps, "batch": BATCH, "lr": lr, "eval_every": EVAL_EVERY,
                         "eval_windows": EVAL_WINDOWS, "seeds": list(seeds)},
              "schedules": {}}
    for name, pattern in SCHEDULES.items():
        result["schedules"][name] = {"pattern": pattern, "d_ff": matched_ff(pattern, vocab_size),
                                     "n_params": n_params(build(name, vocab_size, 0)), "runs": {}}
    only = os.environ.get("SCHEDULE")  # one schedule (and seed) per process in parallel jobs; merged by merge()
    if os.environ.get("SEED"):
        seeds = (int(os.environ["SEED"]),)
    for name in SCHEDULES:
        if only and name != only:
            continue
        for seed in seeds:
            run = train(name, seed, data, steps, lr=lr)
            result["schedules"][name]["runs"][str(seed)] = run
            print(f"{name} seed {seed}: held-out {run['held_out'][-1]:.4f}", file=sys.stderr, flush=True)
            Path(path).write_text(json.dumps(result))
    return result


def merge(paths: list[str | Path], path: str | Path) -> dict:
    """One result file from files written by separate :func:`main` processes (one schedule each)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    result = parts[0]
    for part in parts[1:]:
        for name, entry in part["schedules"].items():
            result["schedules"][name]["runs"].update(entry["runs"])
    Path(path).write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    if os.environ.get("FULL") != "1":
        raise SystemExit("set FULL=1 to train every schedule x 3 seeds (tens of CPU minutes)")
    main(os.environ.get("OUT", "notebooks/results/ch13_text_lm.json"), lr=float(os.environ.get("LR", LR)))
