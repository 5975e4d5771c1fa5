"""Chapter 10's checks can fail: wrong answers of the kinds a learner writes are refused, for the right reason.

The answers here are plain PyTorch (the checks judge results; the notebook's launchers run the learner's Triton),
so they are checked with the exercise's forbidden list emptied: the guard would rightly refuse their torch.exp.
"""

from __future__ import annotations

import dataclasses
import math
from unittest import mock

import pytest
import torch

from attncourse.classroom import checks


def check(exercise_id, answer):
    """checks.check with nothing forbidden: these PyTorch answers stand in for the learner's Triton."""
    ex = dataclasses.replace(checks.get(exercise_id), forbid=())
    with mock.patch.dict(checks._REGISTRY, {exercise_id: ex}):
        checks.check(exercise_id, answer)


def failure(exercise_id, answer):
    with pytest.raises(checks.CheckFailed) as info:
        check(exercise_id, answer)
    assert "called" not in str(info.value)  # a wrong answer, not a forbidden call
    return str(info.value)


def lse_update_torch(out, lse, s, v, *, guard=True, weight_old=True):
    ref = torch.maximum(lse, s.amax(-1))
    if guard:
        ref = torch.where(torch.isinf(ref), torch.zeros_like(ref), ref)
    w_old = (lse - ref).exp() if weight_old else torch.ones_like(lse)
    p = (s - ref[:, None]).exp()  # (R, C)
    total = w_old + p.sum(-1)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out_new = (w_old[:, None] * out + p @ v) / safe[:, None]  # (R, C) @ (C, D) -> (R, D)
    lse_new = torch.where(total > 0, ref + safe.log(), torch.full_like(ref, float("-inf")))
    return out_new, lse_new


def test_online_update_check():
    check("10-online-update", lse_update_torch)
    assert "has seen no key and sees none" in failure("10-online-update",
                                                      lambda *a: lse_update_torch(*a, guard=False))
    failure("10-online-update", lambda *a: lse_update_torch(*a, weight_old=False))


def query_blocks_torch(t_q, t_k, block_q, block_k, causal_align, window, *, round_down=True, use_window=True):
    offset = t_k - t_q if causal_align == "bottom_right" else 0
    n_qb, n_kb = math.ceil(t_q / block_q), math.ceil(t_k / block_k)
    visit = torch.zeros(n_kb, n_qb, dtype=torch.bool)
    for kb in range(n_kb):
        k_start = kb * block_k
        lo = max(k_start - offset, 0)
        lo = lo // block_q * block_q if round_down else lo
        hi = t_q
        if window is not None and use_window:
            hi = max(min(t_q, min(k_start + block_k, t_k) - 1 + window - offset), 0)
        for qb in range(n_qb):
            visit[kb, qb] = lo <= qb * block_q < hi
    return visit


def test_causal_blocks_check():
    check("10-causal-blocks", query_blocks_torch)
    failure("10-causal-blocks", lambda *a: query_blocks_torch(*a, round_down=False))
    assert "window" in failure("10-causal-blocks", lambda *a: query_blocks_torch(*a, use_window=False))


def decode_torch(query, key, value, *, kv_head):
    heads, kv_heads = query.shape[1], key.shape[1]
    index = torch.tensor([kv_head(h, heads, kv_heads) for h in range(heads)])
    k, v = key[:, index], value[:, index]  # (B, H, Tk, D)
    weights = torch.softmax((query @ k.transpose(-2, -1)) / math.sqrt(query.shape[-1]), -1)  # (B, H, 1, Tk)
    return weights @ v  # (B, H, 1, Tk) @ (B, H, Tk, D) -> (B, H, 1, D)


def test_decode_bug_check_catches_the_bug_and_only_it():
    check("10-decode-bug", lambda q, k, v: decode_torch(q, k, v, kv_head=lambda h, H, G: h // (H // G)))
    message = failure("10-decode-bug", lambda q, k, v: decode_torch(q, k, v, kv_head=lambda h, H, G: h % G))
    assert "GQA: 8 query heads over 2 KV heads" in message  # MHA and MQA cases pass with the bug


def test_prediction_says_which_part_never_the_value():
    ex = checks.get("10-predict-decode")
    expected = ex.make_cases()[0].expected
    wrong = list(expected)
    wrong[2] = expected[3]  # the per-KV-head bytes given for the per-query-head grid
    with pytest.raises(checks.CheckFailed) as info:
        checks.check("10-predict-decode", tuple(wrong))
    message = str(info.value)
    assert "K and V bytes, one per query head" in message and str(expected[2]) not in message


def test_experiment_recomputes_per_seed():
    reference = checks.get("10-split-experiment").make_cases()[0].expected
    with pytest.raises(checks.CheckFailed):
        checks.check("10-split-experiment", lambda seed: reference)  # seed 0's numbers for every seed


def test_plain_pytorch_instead_of_triton_is_refused():
    """The exercise asks for Triton: a launcher rewritten in PyTorch tensor methods calls torch.exp and fails."""
    with pytest.raises(checks.CheckFailed, match="torch.exp"):
        checks.check("10-online-update", lse_update_torch)
