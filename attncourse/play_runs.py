r"""Chapter 11's stored runs on the *Coriolanus* model (:mod:`attncourse.play_lm`): ``python -m attncourse.play_runs``
writes ``notebooks/results/ch11_play_kv.json`` (a few minutes of CPU for the three seeds; the lesson re-measures a
slice of each experiment live and checks it against the file).

* ``stream``: StreamingLLM's experiment (Xiao et al. 2024, Figure 3): loss along held-out streams of
  :data:`STREAM` characters, 4 times the trained length, read through a cache of :data:`CACHE` slots: dense (every
  key), window, 4 sinks + window at cache positions, the same at true positions, and recompute.
* ``compress``: a prompt of :data:`PROMPT` characters compressed once to a budget of keys (window, window + 4 sinks,
  H2O, SnapKV) or rounded (KIVI), and the loss of the next characters.
* ``sinks``: the attention weight on key 0 per layer and head.
* ``duo``: DuoAttention's split: a few heads read everything, the rest read 4 sinks + a window; heads chosen by the
  loss each costs when it alone streams (measured on training text) against heads chosen at random.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from .char_lm import windows
from .play_eval import compressed_forward, losses, recompute_losses, sink_mass, streaming_forward
from .play_lm import CONTEXT, RESULTS, SEEDS, load_play_lm, play_text

STREAM, CACHE, SINKS, BIN, EVERY = 1024, 128, 4, 32, 8
STREAM_STARTS = (0, 2000, 4000, 6000, 8000)
PROMPT, BUDGETS, BITS = 224, (16, 32, 64, 112), (2, 3, 4)
DUO_CACHE, DUO_FULL = 32, (0, 2, 4, 8)


def stream_batch(held_out: torch.Tensor, starts=STREAM_STARTS, length: int = STREAM) -> torch.Tensor:
    return torch.stack([held_out[s:s + length] for s in starts])  # (B, length)


def stream_losses(model, streams: torch.Tensor, cache: int = CACHE, recompute: bool = True) -> dict:
    """Loss of each cache: mean over the streams in bins of :data:`BIN` positions ("binned"), and each stream's
    mean past the trained length ("past_context")."""
    def run(*args, **kw):  # one stream at a time: the (T, T) maps of a batch would not fit in a small memory
        return torch.cat([losses(streaming_forward(model, s[None], *args, **kw), s[None]) for s in streams])
    runs = {"dense": run(), "window": run(0, cache), "sinks": run(SINKS, cache - SINKS),
            "sinks_true_pos": run(SINKS, cache - SINKS, reindex=False)}
    if recompute:
        runs["recompute"] = torch.stack([recompute_losses(model, s, cache, every=EVERY) for s in streams])
    runs = {k: torch.cat([v[:, :1], v], 1) for k, v in runs.items()}  # (B, T): the first bin's mean over BIN - 1
    binned = {k: [round(x, 4) for x in v.nanmean(0).view(-1, BIN).nanmean(1).tolist()] for k, v in runs.items()}
    past = {k: v[:, CONTEXT:].nanmean(1).tolist() for k, v in runs.items()}  # per stream, past the trained length
    return {"binned": binned, "past_context": past}


def compress_losses(model, batch: torch.Tensor, budgets=BUDGETS, bits=BITS) -> dict:
    """Mean loss of the continuation's predictions (queries PROMPT .. T - 2) under each compression."""
    def score(**kw):
        return losses(compressed_forward(model, batch, PROMPT, **kw), batch)[:, PROMPT:].mean().item()
    out = {"full": score()}
    for b in budgets:
        out[f"window_{b}"] = score(method="window", budget=b)
        out[f"sinks_{b}"] = score(method="window", budget=b, sinks=SINKS)
        out[f"h2o_{b}"] = score(method="h2o", budget=b, recent=b // 2)
        out[f"snapkv_{b}"] = score(method="snapkv", budget=b, recent=8)
    for n in bits:
        out[f"kivi_{n}"] = score(method="kivi", bits=n)
        out[f"kivi_token_{n}"] = score(method="kivi", bits=n, key_axis="token")
    return out


def head_costs(model, batch: torch.Tensor, cache: int = DUO_CACHE) -> torch.Tensor:
    """(n_layers, H): how much the loss rises when that head alone reads 4 sinks + a window of `cache` slots."""
    n_layers, n_heads = len(model.blocks), model.blocks[0].attn.n_heads
    base = losses(streaming_forward(model, batch), batch).mean()
    cost = torch.zeros(n_layers, n_heads)
    for layer in range(n_layers):
        for h in range(n_heads):
            heads = torch.zeros(n_layers, n_heads, dtype=torch.bool)
            heads[layer, h] = True
            logits = streaming_forward(model, batch, SINKS, cache - SINKS, heads=heads)
            cost[layer, h] = losses(logits, batch).mean() - base
    return cost


def duo_losses(model, batch: torch.Tensor, cost: torch.Tensor, gen: torch.Generator, cache: int = DUO_CACHE) -> dict:
    """Loss with k full heads chosen by `cost` (largest first) or at random (mean of 2 draws), the rest streaming."""
    n = cost.numel()
    out = {"full": losses(streaming_forward(model, batch), batch).mean().item()}
    for k in DUO_FULL:
        def run(full_idx):
            heads = torch.ones(n, dtype=torch.bool)
            heads[full_idx] = False
            return losses(streaming_forward(model, batch, SINKS, cache - SINKS, heads=heads.view_as(cost)),
                          batch).mean().item()
        out[f"chosen_{k}"] = run(cost.flatten().argsort(descending=True)[:k])
        out[f"random_{k}"] = sum(run(torch.randperm(n, generator=gen)[:k]) for _ in range(2)) / 2
    return out


def run_seed(seed: int) -> dict:
    """Every experiment of the module docstring on the stored model of `seed`."""
    train, held_out, vocab = play_text()
    model = load_play_lm(seed, len(vocab))
    batch = windows(held_out, 32, CONTEXT - 1, torch.Generator().manual_seed(7))  # (32, 256)
    train_batch = windows(train, 16, CONTEXT - 1, torch.Generator().manual_seed(8))
    cost = head_costs(model, train_batch)
    return {"stream": stream_losses(model, stream_batch(held_out)), "compress": compress_losses(model, batch),
            "sink_mass": sink_mass(model, batch).tolist(), "head_cost": cost.tolist(),
            "duo": duo_losses(model, batch, cost, torch.Generator().manual_seed(seed))}


def main(args: list[str]) -> None:
    """``python -m attncourse.play_runs SEED`` runs one seed into a part file (three can run side by side);
    ``python -m attncourse.play_runs`` runs the missing seeds and joins the parts into the stored file."""
    torch.set_num_threads(1)
    def part(seed: int) -> Path:
        return RESULTS / f"ch11_play_kv_part{seed}.json"
    for seed in [int(a) for a in args] or SEEDS:
        if not args and part(seed).exists():
            continue
        t0 = time.time()
        part(seed).write_text(json.dumps(run_seed(seed)))
        print(seed, f"{time.time() - t0:.0f} s", flush=True)
    if args:
        return
    record = {"date": time.strftime("%Y-%m-%d"), "stream": STREAM, "cache": CACHE, "sinks": SINKS, "bin": BIN,
              "every": EVERY, "prompt": PROMPT, "budgets": list(BUDGETS), "bits": list(BITS), "duo_cache": DUO_CACHE,
              "duo_full": list(DUO_FULL), "seeds": {str(s): json.loads(part(s).read_text()) for s in SEEDS}}
    (RESULTS / "ch11_play_kv.json").write_text(json.dumps(record))
    for s in SEEDS:
        part(s).unlink()


if __name__ == "__main__":
    main(sys.argv[1:])
