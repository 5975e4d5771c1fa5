"""Chapter 07's exercise 2b (one decode step through a rolling buffer): a right step passes the check cell and the
grader; the mistakes a learner makes (slot index taken for the position, empty slots attended, the shift, the
reordered copy, an elementwise score, a write by index tensor) are refused for the right reason."""

from __future__ import annotations

import math

import torch

from attncourse.classroom import checks
from attncourse.classroom.checks.ch07_ring import ring_step_reference
from exercise_routes import accepted, failure


def ring_decode_step(q, k, v, cache_k, cache_v, slot_pos, t, slopes):
    slot = t % cache_k.shape[2]
    cache_k[:, :, slot] = k[:, :, 0]
    cache_v[:, :, slot] = v[:, :, 0]
    slot_pos[slot] = t
    scores = q @ cache_k.transpose(-1, -2) / math.sqrt(q.shape[-1])          # (B, H, 1, W)
    scores = scores - slopes[:, None, None] * (t - slot_pos)
    scores = scores.masked_fill(slot_pos < 0, float("-inf"))
    return scores.softmax(-1) @ cache_v                                      # (B, H, 1, D)


def test_ring_step_right(tmp_path, monkeypatch):
    accepted("07-ring-decode", ring_decode_step, tmp_path, monkeypatch)


def test_ring_step_streamed_equals_full_recompute():
    """The step, run over a stream three windows long, equals the full recompute at every position, and the
    buffers are the same storage at the end as at the start."""
    gen = torch.Generator().manual_seed(3)
    b, h, w, d, n = 2, 2, 4, 8, 13
    k, v, q = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) for _ in range(3))
    slopes = torch.tensor([0.5, 0.0625], dtype=torch.float64)
    ck, cv, pos = torch.zeros(b, h, w, d, dtype=torch.float64), torch.zeros(b, h, w, d, dtype=torch.float64), \
        torch.full((w,), -1)
    ptr = ck.data_ptr()
    for t in range(n):
        out = ring_decode_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], ck, cv, pos, t, slopes)
        ref = ring_step_reference(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], slopes, w)
        torch.testing.assert_close(out, ref)
    assert ck.data_ptr() == ptr and pos.tolist() == [12, 9, 10, 11]


def test_ring_step_mistakes_refused():
    def slot_as_position(q, k, v, cache_k, cache_v, slot_pos, t, slopes):  # distance from the slot index
        slot = t % cache_k.shape[2]
        cache_k[:, :, slot], cache_v[:, :, slot], slot_pos[slot] = k[:, :, 0], v[:, :, 0], t
        scores = q @ cache_k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        dist = (cache_k.shape[2] - 1 - torch.arange(cache_k.shape[2])).to(q.dtype)
        scores = (scores - slopes[:, None, None] * dist).masked_fill(slot_pos < 0, float("-inf"))
        return scores.softmax(-1) @ cache_v

    assert "wrap" in failure("07-ring-decode", slot_as_position)

    def empty_slots_seen(q, k, v, cache_k, cache_v, slot_pos, t, slopes):
        slot = t % cache_k.shape[2]
        cache_k[:, :, slot], cache_v[:, :, slot], slot_pos[slot] = k[:, :, 0], v[:, :, 0], t
        scores = q @ cache_k.transpose(-1, -2) / math.sqrt(q.shape[-1]) - slopes[:, None, None] * (t - slot_pos)
        return scores.softmax(-1) @ cache_v

    assert "first token" in failure("07-ring-decode", empty_slots_seen)

    def elementwise(q, k, v, cache_k, cache_v, slot_pos, t, slopes):
        slot = t % cache_k.shape[2]
        cache_k[:, :, slot], cache_v[:, :, slot], slot_pos[slot] = k[:, :, 0], v[:, :, 0], t
        scores = (q * cache_k).sum(-1, keepdim=True).transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = (scores - slopes[:, None, None] * (t - slot_pos)).masked_fill(slot_pos < 0, float("-inf"))
        return scores.softmax(-1) @ cache_v

    assert "made a new tensor from the cached keys" in failure("07-ring-decode", elementwise)

    def by_index_tensor(q, k, v, cache_k, cache_v, slot_pos, t, slopes):
        slot = torch.tensor([t % cache_k.shape[2]])
        cache_k.index_copy_(2, slot, k)
        cache_v.index_copy_(2, slot, v)
        slot_pos[slot] = t
        scores = q @ cache_k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = (scores - slopes[:, None, None] * (t - slot_pos)).masked_fill(slot_pos < 0, float("-inf"))
        return scores.softmax(-1) @ cache_v

    assert "Python int" in failure("07-ring-decode", by_index_tensor)

    def per_head_loop(q, k, v, cache_k, cache_v, slot_pos, t, slopes):  # a legitimate spelling of the write
        slot = t % cache_k.shape[2]
        for b in range(q.shape[0]):
            for h in range(q.shape[1]):
                cache_k[b, h, slot] = k[b, h, 0]
                cache_v[b, h, slot] = v[b, h, 0]
        slot_pos[slot] = t
        scores = torch.einsum("bhqd,bhkd->bhqk", q, cache_k) / math.sqrt(q.shape[-1])
        scores = (scores - slopes[:, None, None] * (t - slot_pos)).masked_fill(slot_pos < 0, float("-inf"))
        return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), cache_v)

    checks.check("07-ring-decode", per_head_loop)


def test_ring_step_roll_refused_and_slice_write_accepted():
    def rolled(q, k, v, cache_k, cache_v, slot_pos, t, slopes):  # the buffer kept in temporal order by torch.roll
        for buf, new in ((cache_k, k), (cache_v, v)):
            buf.copy_(torch.roll(buf, -1, 2))
            buf[:, :, -1] = new[:, :, 0]
        slot_pos.copy_(torch.roll(slot_pos, -1, 0))
        slot_pos[-1] = t
        scores = q @ cache_k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = (scores - slopes[:, None, None] * (t - slot_pos)).masked_fill(slot_pos < 0, float("-inf"))
        return scores.softmax(-1) @ cache_v

    failure("07-ring-decode", rolled)  # the buffers arrive in ring order: a rolled buffer loses it, or is a copy

    def slice_write(q, k, v, cache_k, cache_v, slot_pos, t, slopes):
        s = t % cache_k.shape[2]
        cache_k[:, :, s:s + 1] = k
        cache_v[:, :, s:s + 1].copy_(v)
        slot_pos[s:s + 1] = t
        scores = torch.matmul(q, cache_k.mT) / math.sqrt(q.shape[-1])
        scores = torch.where(slot_pos >= 0, scores - slopes.view(-1, 1, 1) * (t - slot_pos).to(q.dtype),
                             float("-inf"))
        return torch.softmax(scores, dim=-1) @ cache_v

    checks.check("07-ring-decode", slice_write)
