"""The per-step decode timer of chapter 07: one time per step, positive, and the rate is the median's."""

import pytest
import torch

from attncourse.bench_decode import decode_speedup_runs, decode_speedups, decode_step_times, prefill_vs_decode
from attncourse.gpt import GPT, GPTConfig


def test_decode_step_times_shape_and_validation():
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=11, block_size=64, d_model=16, n_heads=2, n_layers=1)).eval()
    steps = decode_step_times(m, 10, 4, repeats=2)
    assert steps.shape == (8,) and steps.dtype == torch.float64 and bool((steps > 0).all())
    rates = prefill_vs_decode(m, 10, 4, repeats=2)
    assert 0 < rates["decode_tokens_per_s"] < float("inf")
    with pytest.raises(ValueError, match="n_new"):
        decode_step_times(m, 10, 0)


def test_decode_speedups_are_the_medians_of_the_runs():
    runs = {16: ([3.0, 1.0, 2.0], [1.0, 0.5, 2.0]), 64: ([9.0, 6.0, 3.0], [1.0, 1.0, 3.0])}  # seconds/token, per run
    table = decode_speedups(None, list(runs), runs=runs)      # the table from runs already timed: nothing is run
    assert table == {16: (2.0, 1.0, 2.0), 64: (6.0, 1.0, 6.0)}
    model = GPT(GPTConfig(vocab_size=11, block_size=32, d_model=16, n_heads=2, n_layers=1)).eval()
    timed = decode_speedup_runs(model, [4, 8], n_new=2, repeats=2)
    assert set(timed) == {4, 8} and all(len(slow) == len(fast) == 2 and min(slow + fast) > 0
                                        for slow, fast in timed.values())


def test_decode_speedups_best_of_n():
    runs = {16: ([3.0, 1.0, 2.0], [1.0, 0.5, 2.0]), 64: ([9.0, 6.0, 3.0], [1.0, 1.5, 3.0])}  # seconds/token, per run
    table = decode_speedups(None, list(runs), runs=runs, stat="min")   # the fastest run of each mode
    assert table == {16: (1.0, 0.5, 2.0), 64: (3.0, 1.0, 3.0)}
    with pytest.raises(ValueError, match="stat"):
        decode_speedups(None, list(runs), runs=runs, stat="mean")


def test_time_per_token_best_step_is_at_most_the_mean():
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=11, block_size=32, d_model=16, n_heads=2, n_layers=1)).eval()
    from attncourse.bench_decode import time_per_token
    step = time_per_token(m, 8, 4, use_cache=True, repeats=1, best_step=True)
    assert 0 < step < float("inf")
    timed = decode_speedup_runs(m, [4], n_new=2, repeats=1, best_step=True)
    assert len(timed[4][0]) == len(timed[4][1]) == 1 and min(timed[4][0] + timed[4][1]) > 0
