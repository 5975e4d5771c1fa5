"""Decode benchmark: time per generated token with and without a KV cache, against context length.

    python -m attncourse.bench_decode            # prints a table for a tiny GPT on this machine

Without a cache, generating token t re-runs the model over all t positions (and attention over t^2
pairs); with the cache it runs one position against t cached keys. Chapter 07 calls
:func:`time_per_token` in an ignored cell and plots the result.
"""

from __future__ import annotations

import time

import torch

from . import _validate
from .gpt import GPT, GPTConfig


@torch.no_grad()
def time_per_token(model: GPT, context_len: int, n_new: int = 8, *, use_cache: bool, repeats: int = 3,
                   batch_size: int = 1, best_step: bool = False) -> float:
    """Best-of-`repeats` seconds per generated token after a prompt of `context_len` tokens: the fastest run's
    mean over its `n_new` steps, or with ``best_step=True`` the fastest single step of all runs, each step
    timed on its own (on a loaded machine a run of several steps is rarely free of preemption; one step often is).

    Only the decode steps are timed (the prefill runs once before the clock starts, in both modes).
    """
    for name, v in (("context_len", context_len), ("n_new", n_new), ("repeats", repeats)):
        _validate.positive_int(name, v)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (batch_size, context_len), generator=gen)
    best = float("inf")
    for _ in range(repeats):
        caches = model.new_caches(batch_size, context_len + n_new) if use_cache else None
        seq = prompt
        logits = model(prompt, caches)  # prefill, not timed
        start = time.perf_counter()
        for _ in range(n_new):
            step_start = time.perf_counter()
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            seq = torch.cat([seq, nxt], dim=1)
            logits = model(nxt, caches) if use_cache else model(seq)
            if best_step:
                best = min(best, time.perf_counter() - step_start)
        if not best_step:
            best = min(best, (time.perf_counter() - start) / n_new)
    return best


def decode_speedup_runs(model: GPT, lengths: list[int], n_new: int = 8, repeats: int = 3, *,
                        best_step: bool = False) -> dict[int, tuple]:
    """{length: ([seconds/token without cache, one per run], [with cache, one per run])}: `repeats` runs, the
    cached and uncached runs alternating so that a change in the machine's load hits both (run i of each list
    were timed next to each other, so their ratio is run i's speed-up). Each entry is the run's mean step, or its
    fastest step with ``best_step=True`` (:func:`time_per_token`)."""
    _validate.positive_int("repeats", repeats)
    runs = {length: ([], []) for length in lengths}
    for _ in range(repeats):
        for length in lengths:
            for mode, use_cache in ((0, False), (1, True)):
                runs[length][mode].append(time_per_token(model, length, n_new, use_cache=use_cache, repeats=1,
                                                         best_step=best_step))
    return runs


def decode_speedups(model: GPT, lengths: list[int], n_new: int = 8, repeats: int = 3, *,
                    runs: dict | None = None, stat: str = "median") -> dict[int, tuple]:
    """{length: (seconds/token without cache, with cache, speed-up)} for each context length: the median
    (``stat="median"``) or the fastest (``stat="min"``, best of N: the run least disturbed by the machine's load)
    of `repeats` runs (:func:`decode_speedup_runs`, or its result passed as `runs`)."""
    if stat not in ("median", "min"):
        raise ValueError(f"stat must be 'median' or 'min', got {stat!r}")
    runs = decode_speedup_runs(model, lengths, n_new, repeats) if runs is None else runs
    out = {}
    for length, (slow, fast) in runs.items():
        pick = (lambda t: t.median()) if stat == "median" else (lambda t: t.min())
        slow, fast = float(pick(torch.tensor(slow))), float(pick(torch.tensor(fast)))
        out[length] = (slow, fast, slow / fast)
    return out


@torch.no_grad()
def cached_step_seconds(model: GPT, context_len: int, repeats: int = 15, batch_size: int = 1) -> float:
    """Median seconds of one cached decode step (one new token against `context_len` or more cached keys)."""
    for name, v in (("context_len", context_len), ("repeats", repeats), ("batch_size", batch_size)):
        _validate.positive_int(name, v)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (batch_size, context_len), generator=gen)
    caches = model.new_caches(batch_size, context_len + repeats + 1)
    logits = model(prompt, caches)  # prefill, not timed
    nxt = logits[:, -1:].argmax(-1)  # (B, 1)
    model(nxt, caches)  # warm-up step
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        logits = model(nxt, caches)  # (B, 1, V)
        times.append(time.perf_counter() - start)
        nxt = logits[:, -1:].argmax(-1)
    return float(torch.tensor(times).median())


@torch.no_grad()
def prefill_vs_decode(model: GPT, context_len: int, n_new: int = 16, *, repeats: int = 3,
                      batch_size: int = 1) -> dict[str, float]:
    """Tokens per second of prefill (the whole prompt of `context_len` tokens in one forward, best of
    `repeats`) and of decode (`n_new` tokens, one forward each, with the KV cache), from the **median**
    decode step over all `repeats` x `n_new` steps, each timed on its own.

    Why the median: on a shared machine a few steps are preempted (milliseconds each, every few steps under
    load), and a mean over a run absorbs them; the median of single steps does not
    (:func:`decode_step_times` returns every step, to show the difference).

    Prefill pushes many tokens through each weight matrix per read (matrix-matrix products: compute-bound
    on real hardware); decode pushes one (matrix-vector products: bound by reading weights and cache on a
    model too large for the processor's caches, see :mod:`attncourse.roofline`). On a tiny model whose
    weights sit in cache the gap is per-call overhead instead: a forward costs about the same for 1 token
    as for 16. Raises ValueError for a non-positive size.
    """
    for name, v in (("context_len", context_len), ("n_new", n_new), ("repeats", repeats),
                    ("batch_size", batch_size)):
        _validate.positive_int(name, v)
    best_prefill, steps = _prefill_and_steps(model, context_len, n_new, repeats, batch_size)
    return {"prefill_tokens_per_s": batch_size * context_len / best_prefill,
            "decode_tokens_per_s": batch_size / float(steps.median())}


@torch.no_grad()
def _prefill_and_steps(model: GPT, context_len: int, n_new: int, repeats: int, batch_size: int
                       ) -> tuple[float, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (batch_size, context_len), generator=gen)
    best_prefill, steps = float("inf"), []
    for _ in range(repeats):
        caches = model.new_caches(batch_size, context_len + n_new)
        start = time.perf_counter()
        logits = model(prompt, caches)  # (B, T0, V): one forward over the whole prompt
        best_prefill = min(best_prefill, time.perf_counter() - start)
        for _ in range(n_new):
            start = time.perf_counter()
            logits = model(logits[:, -1:].argmax(-1), caches)  # (B, 1) -> (B, 1, V)
            steps.append(time.perf_counter() - start)
    return best_prefill, torch.tensor(steps, dtype=torch.float64)


def decode_step_times(model: GPT, context_len: int, n_new: int = 16, *, repeats: int = 3,
                      batch_size: int = 1) -> torch.Tensor:
    """Seconds of every cached decode step, (repeats * n_new,) float64, in the order they ran (each run starts
    with a fresh prefill of `context_len` tokens, not timed here). Raises ValueError for a non-positive size."""
    for name, v in (("context_len", context_len), ("n_new", n_new), ("repeats", repeats),
                    ("batch_size", batch_size)):
        _validate.positive_int(name, v)
    return _prefill_and_steps(model, context_len, n_new, repeats, batch_size)[1]


def main() -> None:  # pragma: no cover - prints timings
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=2048, d_model=128, n_heads=4, n_layers=4)).eval()
    print(f"{'context':>8} {'no cache ms/token':>18} {'cache ms/token':>15} {'speed-up':>9}")
    for length, (slow, fast, ratio) in decode_speedups(model, [64, 128, 256, 512, 1024]).items():
        print(f"{length:>8} {slow * 1e3:>18.2f} {fast * 1e3:>15.2f} {ratio:>8.1f}x")
    rates = prefill_vs_decode(model, 512)
    print(f"prefill of 512 tokens: {rates['prefill_tokens_per_s']:.0f} tokens/s; "
          f"decode: {rates['decode_tokens_per_s']:.0f} tokens/s")


if __name__ == "__main__":  # pragma: no cover
    main()
