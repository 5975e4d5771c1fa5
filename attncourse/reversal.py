"""Chapter 04's comparison on digit reversal: the encoder-decoder Transformer against chapter 01's GRU with additive
attention, both trained by one recipe (Adam, linear warm-up, cosine decay, gradient clipping) at a learning rate
chosen for each by the same small sweep on tuning seeds that are not the seeds reported.

Both models see the same batch stream for a given seed (one random length in 4..16 per batch of 64, drawn from a
generator seeded with ``seed + 1``, as :func:`attncourse.seq2seq.train` draws it). `steps` and `warmup` are counts of
optimiser steps.
"""

from __future__ import annotations

import io
import math
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate, seq2seq
from .transformer import EncoderDecoder

KINDS = ("Transformer", "GRU + additive attention")
VOCAB = 12  # ten digits, PAD and SOS (chapter 01's vocabulary)


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Multiplier of the peak learning rate at `step` (0-based): linear warm-up over `warmup` steps, then a cosine
    decay to a tenth of the peak at the last step (`warmup` 0: no warm-up)."""
    if step < warmup:
        return (step + 1) / warmup
    done = (step - warmup) / max(1, steps - warmup - 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))


def build(kind: str, seed: int) -> nn.Module:
    """A fresh model of `kind` (one of KINDS) initialised from `seed`."""
    if kind == KINDS[0]:
        torch.manual_seed(seed)
        return EncoderDecoder(VOCAB, VOCAB, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_len=32, norm_first=True)
    if kind == KINDS[1]:
        return seq2seq.build_model("additive", seq2seq.Seq2SeqConfig(seed=seed))
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def loss(kind: str, model: nn.Module, batch: seq2seq.Batch) -> torch.Tensor:
    """Teacher-forced cross-entropy over the non-padding target tokens."""
    if kind == KINDS[1]:
        return seq2seq.loss_on(model, batch)
    tgt_in = torch.cat([torch.full_like(batch.tgt[:, :1], seq2seq.SOS), batch.tgt[:, :-1]], dim=1)  # (B, T)
    logits = model(batch.src, tgt_in)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), batch.tgt.flatten(), ignore_index=seq2seq.PAD)


def train(kind: str, seed: int, steps: int, lr: float, warmup: int, clip: float = 1.0) -> nn.Module:
    """Train a fresh model of `kind` with the shared recipe; returns it in eval mode."""
    _validate.positive_int("steps", steps)
    if not (lr > 0 and 0 <= warmup < steps):
        raise ValueError(f"need lr > 0 and 0 <= warmup < steps, got lr={lr}, warmup={warmup}, steps={steps}")
    model = build(kind, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, warmup))
    model.train()
    for _ in range(steps):
        length = int(torch.randint(4, 17, (), generator=gen))
        value = loss(kind, model, seq2seq.reverse_batch(64, 4, 16, generator=gen, length=length))
        opt.zero_grad()
        value.backward()
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
    return model.eval()


@torch.no_grad()
def accuracy(kind: str, model: nn.Module, lengths: Sequence[int], n: int = 200, seed: int = 1234) -> list[float]:
    """Greedy-decoding digit accuracy at each length (fresh inputs from `seed`, no teacher forcing)."""
    if kind == KINDS[1]:
        return list(seq2seq.accuracy_by_length(model, list(lengths), n, seed).values())
    gen, out = torch.Generator().manual_seed(seed), []
    for length in lengths:
        batch = seq2seq.reverse_batch(n, 4, 16, generator=gen, length=length)
        tokens, _ = model.greedy(batch.src, steps=length, start_id=seq2seq.SOS)  # (n, length)
        out.append((tokens == batch.tgt).float().mean().item())
    return out


def _one(kind: str, seed: int, lr: float, steps: int, warmup: int, lengths: list[int]) -> tuple[list[float], bytes]:
    torch.set_num_threads(1)
    model = train(kind, seed, steps, lr, warmup)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return [round(a, 4) for a in accuracy(kind, model, lengths)], buffer.getvalue()


def run_grid(jobs: Sequence[tuple[str, int, float]], steps: int, warmup: int, lengths: Sequence[int],
             workers: int = 1, log: str | None = None) -> dict[tuple[str, int, float], tuple[list[float], bytes]]:
    """Train every (kind, seed, lr) of `jobs`; returns its accuracy by length and its state_dict's bytes.
    `workers` > 1 trains that many at once in forked processes (each on one thread: the same results). `log`: a
    file that gets one line per finished job (kind, seed, lr, accuracies), for a long run's progress."""
    lengths, done = list(lengths), {}

    def finish(job, result):
        done[job] = result
        if log:
            with open(log, "a") as f:
                f.write(f"{job[0]}\t{job[1]}\t{job[2]}\t{result[0]}\n")

    if _validate.positive_int("workers", workers) == 1:
        for job in jobs:
            finish(job, _one(*job, steps, warmup, lengths))
        return done
    with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
        futures = {pool.submit(_one, *job, steps, warmup, lengths): job for job in jobs}
        for future in as_completed(futures):
            finish(futures[future], future.result())
    return {job: done[job] for job in jobs}


def load(kind: str, weights: bytes) -> nn.Module:
    """A trained model of `kind` rebuilt from the bytes of its state_dict."""
    model = build(kind, 0)
    model.load_state_dict(torch.load(io.BytesIO(weights), weights_only=True))
    return model.eval()


MIRROR_EXAMPLE_SEED = 7  # the 12-digit input chapter 04 draws: seq2seq.reverse_batch(1, 12, 12, seed 7)


@torch.no_grad()
def mirrored_attention(model: nn.Module) -> tuple[list[float], int]:
    """Cross-attention of a trained Transformer on one fixed 12-digit input (`MIRROR_EXAMPLE_SEED`), decoded
    greedily: per decoder layer, the weight (mean over heads) on the mirrored input position 11 - t, averaged over
    the 12 output steps t (uniform: 1/12); and in how many of the 12 rows the last layer's largest weight is there."""
    example = seq2seq.reverse_batch(1, 12, 12, generator=torch.Generator().manual_seed(MIRROR_EXAMPLE_SEED))
    _, cross = model.greedy(example.src, steps=12, start_id=seq2seq.SOS)  # per layer (1, H, 12, 12)
    weight = [round(float(w[0].mean(0).flip(-1).diagonal().mean()), 4) for w in cross]
    hits = int((cross[-1][0].mean(0).argmax(-1) == torch.arange(11, -1, -1)).sum())
    return weight, hits


def compare(lrs: Sequence[float] = (1e-3, 3e-3, 1e-2), tune_seeds: Sequence[int] = (100,),
            seeds: Sequence[int] = tuple(range(8)), steps: int = 1000, warmup: int = 100,
            lengths: Sequence[int] = tuple(range(4, 17)), workers: int = 1, log: str | None = None) -> tuple[dict, bytes]:
    """The tuned comparison: for each kind, the peak rate of `lrs` with the best mean accuracy (over `lengths` and
    `tune_seeds`), then `seeds` trained at that rate. Returns a JSON-ready record and the weights of the first
    reported seed's Transformer. The record's "mirror_12_digits" holds :func:`mirrored_attention` of every reported
    Transformer."""
    lengths = list(lengths)
    tuning = run_grid([(k, s, lr) for k in KINDS for lr in lrs for s in tune_seeds], steps, warmup, lengths, workers,
                      log)
    record: dict = {"steps": steps, "warmup": warmup, "schedule": "linear warm-up, cosine decay to 0.1x, clip 1.0",
                    "lrs": list(lrs), "tune_seeds": list(tune_seeds), "seeds": list(seeds), "lengths": lengths,
                    "tuning": {}, "best_lr": {}, "accuracy": {}}
    for kind in KINDS:
        means = {lr: sum(sum(tuning[kind, s, lr][0]) / len(lengths) for s in tune_seeds) / len(tune_seeds)
                 for lr in lrs}
        record["tuning"][kind] = {str(lr): round(m, 4) for lr, m in means.items()}
        record["best_lr"][kind] = max(means, key=means.get)
    final = run_grid([(k, s, record["best_lr"][k]) for k in KINDS for s in seeds], steps, warmup, lengths, workers,
                     log)
    for kind in KINDS:
        record["accuracy"][kind] = [final[kind, s, record["best_lr"][kind]][0] for s in seeds]
    best_tf = record["best_lr"][KINDS[0]]
    mirror = [mirrored_attention(load(KINDS[0], final[KINDS[0], s, best_tf][1])) for s in seeds]
    record["mirror_12_digits"] = {"weight_per_layer": [m[0] for m in mirror],
                                  "rows_argmax_last_layer": [m[1] for m in mirror]}
    return record, final[KINDS[0], seeds[0], record["best_lr"][KINDS[0]]][1]
