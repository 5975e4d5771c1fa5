"""Chapter 07's checks can fail: wrong answers of the kinds a learner writes are refused, for the right reason,
and right answers written without the forbidden functions pass."""

from __future__ import annotations

import math

import pytest
import torch

from attncourse import KVCache, MultiHeadAttention, sinusoidal_positions
from attncourse.classroom import checks


def failure(exercise_id, answer):
    with pytest.raises(checks.CheckFailed) as info:
        checks.check(exercise_id, answer)
    return str(info.value)


# ----------------------------------------------------------------------------- 1. cache mask


def cache_mask(q_len, k_len, window=None):
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    k_pos = torch.arange(k_len)[None, :]
    keep = k_pos <= q_pos
    return keep if window is None else keep & (q_pos - k_pos < window)


def test_cache_mask_right_and_wrong():
    checks.check("07-cache-mask", cache_mask)
    top_left = lambda q, k, w=None: cache_mask(k, k, w)[:q]  # noqa: E731 - queries at 0..Tq-1
    assert "called" not in failure("07-cache-mask", top_left)
    no_window = lambda q, k, w=None: cache_mask(q, k)  # noqa: E731
    assert "window=3" in failure("07-cache-mask", no_window)
    off_by_one = lambda q, k, w=None: cache_mask(q, k, None if w is None else w + 1)  # noqa: E731
    assert "called" not in failure("07-cache-mask", off_by_one)


# ----------------------------------------------------------------------------- 2. cache update


def cache_update(buf_k, buf_v, length, k_new, v_new):
    end = length + k_new.shape[2]
    buf_k[:, :, length:end] = k_new
    buf_v[:, :, length:end] = v_new
    return buf_k[:, :, :end], buf_v[:, :, :end]


def test_cache_update_right_and_wrong():
    checks.check("07-cache-update", cache_update)

    def forgets_old(buf_k, buf_v, length, k_new, v_new):
        return k_new, v_new

    failure("07-cache-update", forgets_old)

    def whole_buffer(buf_k, buf_v, length, k_new, v_new):
        cache_update(buf_k, buf_v, length, k_new, v_new)
        return buf_k, buf_v

    failure("07-cache-update", whole_buffer)


# ----------------------------------------------------------------------------- 3. decode bug


def decode(state, x, *, fixed):
    b, t, d = x.shape
    mha = MultiHeadAttention(d, 4)
    mha.load_state_dict(state)
    cache = KVCache(b, 4, d // 4, capacity=t)
    pe = sinusoidal_positions(t, d)
    with torch.no_grad():
        outs = [mha(x[:, i:i + 1] + (pe[i] if fixed else pe[0]), is_causal=True, kv_cache=cache) for i in range(t)]
    return torch.cat(outs, dim=1)


def test_decode_bug_fixed_passes_and_buggy_fails():
    checks.check("07-decode-bug", lambda s, x: decode(s, x, fixed=True))
    assert "B=" in failure("07-decode-bug", lambda s, x: decode(s, x, fixed=False))


# ----------------------------------------------------------------------------- 4. eviction


def keep(positions, n_sink, window):
    return (positions < n_sink) | (positions.max() + 1 - positions < window)


def test_sink_eviction_right_and_wrong():
    checks.check("07-sink-eviction", keep)
    failure("07-sink-eviction", lambda p, s, w: p.max() + 1 - p < w)  # forgets the sinks
    failure("07-sink-eviction", lambda p, s, w: (p < s) | (p.max() - p < w))  # keeps one key too many


# ----------------------------------------------------------------------------- 5. predict


def test_prediction_wrong_part_named_value_hidden():
    ex = checks.get("07-predict-sizes")
    expected = ex.make_cases()[0].expected
    checks.check("07-predict-sizes", expected)
    msg = failure("07-predict-sizes", (expected[0], expected[1] + 1, expected[2]))
    assert "SinkWindowCache length" in msg and str(expected[1]) not in msg


# ----------------------------------------------------------------------------- 6. experiment


def dropped_mass(q, k, window, slope):
    seq_len = q.shape[0]
    dist = torch.arange(seq_len)[:, None] - torch.arange(seq_len)[None, :]
    p = torch.softmax((q @ k.T / 4.0 - slope * dist).masked_fill(dist < 0, -math.inf), dim=-1)
    return p[dist >= window].sum().item() / seq_len


def test_dropped_mass_right_and_wrong():
    checks.check("07-window-dropped-mass", dropped_mass)
    failure("07-window-dropped-mass", lambda q, k, w, m: dropped_mass(q, k, w + 1, m))  # keeps one key too many
    failure("07-window-dropped-mass", lambda q, k, w, m: dropped_mass(q, k, w, -m))  # bias sign flipped
    failure("07-window-dropped-mass", lambda q, k, w, m: dropped_mass(k, q, w, m))  # queries and keys swapped
