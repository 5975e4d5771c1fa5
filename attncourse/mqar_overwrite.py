r"""MQAR with overwrites: the trained task on which the delta rule's update should matter.

In Zoology's MQAR (:mod:`attncourse.mqar_tokens`) every key is written once, so nothing in a sequence is ever
overwritten, and chapter 13's section 2 measured that one pass over distinct keys does not favour the delta rule.
Here a sequence writes ``n_writes`` pairs ``k v`` drawn from only ``n_keys`` distinct keys (every key at least once,
most several times, each time with a fresh value), then queries every key once; the answer is the value written
*last* for that key. A plain sum :math:`S = \sum_i k_i v_i^\top` returns every value ever written to a key with equal
weight; the delta rule replaces what the state returns for the key being written.

Same two-layer models as :mod:`attncourse.mqar_tokens` (:class:`attncourse.mqar_tokens.ZoologyModel`, with the
short convolution, no positional encoding), trained by :func:`train_overwrite`. ``FULL=1 python -m
attncourse.mqar_overwrite`` trains 5 kinds x 3 seeds and writes ``notebooks/results/ch13_mqar_overwrite.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from . import _validate
from .mqar_tokens import ZoologyModel, fit_queries

KINDS = ("softmax", "linear", "mamba2", "deltanet", "gated_deltanet")
N_KEYS, N_WRITES, VOCAB = 8, 32, 64  # 8 distinct keys written 32 times: 4 writes per key on average
STEPS, LR, BATCH = 300, 3e-2, 32  # the best rate of chapter 13's sweep for all three linear kinds (N = 32)


def overwrite_batch(gen: torch.Generator, batch_size: int, n_keys: int = N_KEYS, n_writes: int = N_WRITES,
                    vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids (B, 2 n_writes + n_keys): ``k v`` pairs (keys ids [0, vocab), values ids [vocab, 2 vocab)), then
    every key once in a random order. Returns (tokens, targets (B, n_keys): the value id - vocab written last for
    each queried key, writes (B, n_keys): how many times each queried key was written).

    Raises:
        ValueError: for sizes that are not positive ints, n_keys > vocab, or n_writes < n_keys.
    """
    for name, x in (("batch_size", batch_size), ("n_keys", n_keys), ("n_writes", n_writes), ("vocab", vocab)):
        _validate.positive_int(name, x)
    if n_keys > vocab or n_writes < n_keys:
        raise ValueError(f"need n_keys <= vocab and n_writes >= n_keys, got n_keys={n_keys}, n_writes={n_writes}, "
                         f"vocab={vocab}")
    ids = torch.rand(batch_size, vocab, generator=gen).argsort(-1)[:, :n_keys]  # (B, U) the sequence's keys
    slots = torch.cat([torch.arange(n_keys).expand(batch_size, n_keys),  # every key once, then random repeats
                       torch.randint(0, n_keys, (batch_size, n_writes - n_keys), generator=gen)], dim=1)
    slots = slots.gather(1, torch.rand(batch_size, n_writes, generator=gen).argsort(-1))  # (B, W) shuffled
    keys = ids.gather(1, slots)  # (B, W) key id of each write
    values = torch.randint(0, vocab, (batch_size, n_writes), generator=gen)  # (B, W) a fresh value per write
    pos = torch.arange(n_writes).expand(batch_size, n_writes)
    last = torch.full((batch_size, n_keys), -1).scatter_reduce(1, slots, pos, reduce="amax")  # (B, U) last write
    count = torch.zeros(batch_size, n_keys, dtype=torch.long).scatter_add_(1, slots, torch.ones_like(slots))
    order = torch.rand(batch_size, n_keys, generator=gen).argsort(-1)  # (B, U) query order
    pairs = torch.stack([keys, values + vocab], dim=-1).flatten(1)  # (B, 2W)
    tokens = torch.cat([pairs, ids.gather(1, order)], dim=1)
    return tokens, values.gather(1, last.gather(1, order)), count.gather(1, order)


def train_overwrite(kind: str, seed: int, steps: int = STEPS, lr: float = LR, batch_size: int = BATCH,
                    n_keys: int = N_KEYS, n_writes: int = N_WRITES, vocab: int = VOCAB) -> dict[str, float]:
    """Train a two-layer :class:`ZoologyModel` of `kind` (short convolution on) from `seed` with AdamW and a
    one-cycle schedule, as :func:`attncourse.mqar_tokens.train_zoology` does; returns held-out ``accuracy`` (the
    last value of each key, 256 sequences) and ``any_written`` (the answer is *some* value written to that key: what
    a memory that cannot overwrite can still get right)."""
    _validate.positive_int("steps", steps)
    torch.manual_seed(seed)
    model = ZoologyModel(kind, True, vocab=vocab)
    fit_queries(model, lambda gen: overwrite_batch(gen, batch_size, n_keys, n_writes, vocab), steps, lr,
                2 * n_writes, seed)  # the same recipe as attncourse.mqar_tokens.train_zoology
    gen_eval = torch.Generator().manual_seed(20_000 + seed)
    with torch.no_grad():
        tokens, targets, _ = overwrite_batch(gen_eval, 256, n_keys, n_writes, vocab)
        pred = model(tokens)[:, 2 * n_writes:].argmax(-1)  # (B, U)
    w = tokens[:, :2 * n_writes].view(256, n_writes, 2)  # (B, W, 2): key id, value id + vocab
    queried = tokens[:, 2 * n_writes:]  # (B, U)
    written = (w[:, None, :, 0] == queried[:, :, None]) & (w[:, None, :, 1] - vocab == pred[:, :, None])  # (B, U, W)
    return {"accuracy": float((pred == targets).float().mean()), "any_written": float(written.any(-1).float().mean())}


def main(path: str | Path = "notebooks/results/ch13_mqar_overwrite.json", seeds: tuple[int, ...] = (0, 1, 2),
         lr: float = LR) -> dict:
    """Train every kind of :data:`KINDS` on every seed at peak rate `lr`; write the results to `path` (JSON).
    ``KIND``, ``SEED`` and ``LR`` in the environment restrict one process to one kind, seed and rate (parallel jobs;
    merge the files by hand)."""
    torch.set_num_threads(1)
    only, seed_env = os.environ.get("KIND"), os.environ.get("SEED")
    seeds = (int(seed_env),) if seed_env else seeds
    result = {"config": {"n_keys": N_KEYS, "n_writes": N_WRITES, "vocab": VOCAB, "steps": STEPS, "lr": lr,
                         "batch": BATCH, "short_conv": True, "seeds": list(seeds)}, "runs": {}}
    for kind in KINDS:
        if only and kind != only:
            continue
        result["runs"][kind] = [train_overwrite(kind, s, lr=lr) for s in seeds]
        print(kind, result["runs"][kind], file=sys.stderr, flush=True)
        Path(path).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    if os.environ.get("FULL") != "1":
        raise SystemExit("set FULL=1 to train 5 kinds x 3 seeds (several CPU minutes each)")
    main(os.environ.get("OUT", "notebooks/results/ch13_mqar_overwrite.json"), lr=float(os.environ.get("LR", LR)))
