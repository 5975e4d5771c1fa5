"""The roofline module's arithmetic (FLOPs, bytes, intensity, the roof) and its measurements' shape.

Timings are not asserted against targets here (benchmarks do that); only that they are positive and finite."""

import math

import pytest
import torch

from attncourse.roofline import (RooflinePoint, WeightStack, attainable, measure_bandwidth, measure_peak_flops,
                                 roofline_points)


def test_counts_by_hand():
    stack = WeightStack(d_model=8, n_layers=3)
    assert stack.weight_bytes == 3 * 8 * 8 * 4
    assert stack.flops(5) == 2 * 5 * 8 * 8 * 3
    assert stack.bytes_moved(5) == 3 * 8 * 8 * 4 + 2 * 5 * 8 * 4 * 3
    assert math.isclose(stack.intensity(5), stack.flops(5) / stack.bytes_moved(5))
    x = torch.randn(5, 8)
    ref = x
    for w in stack.weights:
        ref = ref @ w
    torch.testing.assert_close(stack.forward(x), ref)


def test_decode_is_left_of_any_ridge_and_intensity_grows_with_tokens():
    stack = WeightStack(d_model=256, n_layers=2)
    assert stack.intensity(1) < 0.5  # 2 FLOPs per 4-byte weight, minus activations
    values = [stack.intensity(t) for t in (1, 4, 16, 64, 256)]
    assert values == sorted(values) and values[-1] > 50 * values[0]


def test_roof():
    assert attainable(0.5, peak_flops=100.0, bandwidth=10.0) == 5.0
    assert attainable(50.0, peak_flops=100.0, bandwidth=10.0) == 100.0
    p = RooflinePoint(tokens=4, seconds=2.0, flops=8, bytes_moved=16)
    assert p.intensity == 0.5 and p.achieved == 4.0 and p.seconds_per_token == 0.5


def test_measurements_are_positive():
    assert 0 < measure_bandwidth(mib=8, repeats=1) < math.inf
    assert 0 < measure_bandwidth(mib=8, repeats=1, kind="read") < math.inf
    assert 0 < measure_peak_flops(n=64, repeats=1) < math.inf
    points = roofline_points(WeightStack(d_model=32, n_layers=2), [1, 3], repeats=1)
    assert [p.tokens for p in points] == [1, 3] and all(p.seconds > 0 for p in points)


def test_bad_input():
    with pytest.raises(ValueError, match="d_model"):
        WeightStack(d_model=0)
    with pytest.raises(ValueError, match="tokens"):
        roofline_points(WeightStack(d_model=8, n_layers=1), [0])
    with pytest.raises(ValueError, match="mib"):
        measure_bandwidth(mib=-1)
    with pytest.raises(ValueError, match="kind"):
        measure_bandwidth(mib=8, kind="write")


def test_cached_step_and_speedups_are_positive_medians():
    from attncourse.bench_decode import cached_step_seconds, decode_speedups
    from attncourse.gpt import GPT, GPTConfig
    m = GPT(GPTConfig(vocab_size=11, block_size=32, d_model=16, n_heads=2, n_layers=1)).eval()
    step = cached_step_seconds(m, context_len=8, repeats=3)
    assert 0 < step < 1 and torch.is_grad_enabled()  # grad mode restored after the decorator
    table = decode_speedups(m, [4, 9], n_new=2, repeats=3)
    assert set(table) == {4, 9}
    for slow, fast, ratio in table.values():
        assert slow > 0 and fast > 0 and math.isclose(ratio, slow / fast)
    with pytest.raises(ValueError, match="context_len"):
        cached_step_seconds(m, context_len=0)
    with pytest.raises(ValueError, match="repeats"):
        decode_speedups(m, [4], repeats=0)
