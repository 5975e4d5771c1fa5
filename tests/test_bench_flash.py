"""attncourse.bench's flash measurements: the exact tensor-byte peak and the paired ratio (no timing asserted)."""

import pytest

from attncourse.bench import paired_ratio, tensor_bytes_peak


def test_tensor_bytes_are_exact_and_repeatable():
    t, h, d = 256, 2, 16
    naive = tensor_bytes_peak("naive", t, heads=h, head_dim=d)
    assert naive == tensor_bytes_peak("naive", t, heads=h, head_dim=d)  # machine-independent: the same every time
    assert naive >= 2 * h * t * t * 4  # at least the scores and the weights, (H, T, T) float32 each
    ours = tensor_bytes_peak("ours", t, heads=h, head_dim=d)
    assert h * t * d * 4 <= ours < naive  # at least the output; no T x T matrix
    with_grads = tensor_bytes_peak("ours", t, heads=h, head_dim=d, backward=True)
    assert with_grads >= ours + 3 * h * t * d * 4  # dq, dk, dv are counted
    assert tensor_bytes_peak("naive", 2 * t, heads=h, head_dim=d) > 3.5 * naive  # O(T^2)


def test_paired_ratio_alternates_and_reports_the_median():
    r = paired_ratio("ours", "torch", 64, heads=1, head_dim=8, pairs=3)
    assert len(r["ratios"]) == 3 and r["ratio"] == sorted(r["ratios"])[1]
    assert r["time_ours"] > 0 and r["time_torch"] > 0
    with pytest.raises(ValueError, match="impl"):
        paired_ratio("mine", "torch", 64)
    with pytest.raises(ValueError, match="pairs"):
        paired_ratio("ours", "torch", 64, pairs=0)
