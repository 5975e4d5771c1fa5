"""Chapter 11's checks refuse the routes of issue 23 (review ch10-12, section 4, and routes of the same kinds).

Each route is learner code (this file), tried through the check cell and the grader; a right answer passes.
"""

from __future__ import annotations

import math

import pytest
import torch

from attncourse.classroom import checks
from test_exercise_standard import Grader, as_learner


def refused(exercise_id, answer, tmp_path, monkeypatch, *, because):
    """`answer` is refused by the check cell and by the grader, with `because` in both messages."""
    ex = checks.get(exercise_id)
    with pytest.raises(checks.CheckFailed) as info:
        checks.check(exercise_id, answer)
    status, message = Grader(tmp_path, monkeypatch)(ex, answer, ex.make_cases())
    assert status == "failed", message
    assert because in str(info.value) and because in message, (str(info.value), message)


def tile_states_reduce(mask, block_q, block_k):
    t_q, t_k = mask.shape
    n_q, n_k = -(-t_q // block_q), -(-t_k // block_k)
    allowed = torch.zeros(n_q * block_q, n_k * block_k, dtype=torch.long)
    real = torch.zeros_like(allowed)
    allowed[:t_q, :t_k] = mask.long()
    real[:t_q, :t_k] = 1
    count = allowed.view(n_q, block_q, n_k, block_k).sum(dim=(1, 3))
    size = real.view(n_q, block_q, n_k, block_k).sum(dim=(1, 3))
    return torch.where(count == 0, 0, torch.where(count == size, 2, 1))


def test_tile_states(tmp_path, monkeypatch):
    checks.check("11-tile-states", tile_states_reduce)

    def per_tile_row(mask, block_q, block_k):  # one row of tiles at a time, as the package's tile_states
        return torch.cat([tile_states_reduce(mask[r:r + block_q], block_q, block_k)
                          for r in range(0, mask.shape[0], block_q)])

    refused("11-tile-states", per_tile_row, tmp_path, monkeypatch, because="loops over tiles")

    def package(mask, block_q, block_k):
        from attncourse.block_sparse import tile_states
        return tile_states(lambda b, h, i, j: mask[i, j], mask.shape[0], mask.shape[1], block_q, block_k)

    refused("11-tile-states", package, tmp_path, monkeypatch, because="called attncourse.block_sparse")
    for breaker in checks.get("11-tile-states").breakers:
        refused("11-tile-states", as_learner(breaker), tmp_path, monkeypatch, because="not the way")


def test_slot_mapping_refuses_the_cache(tmp_path, monkeypatch):
    def cache_append(block_table, length, n_new, page_size, free_pages, last_page_shared):
        from attncourse.paged_cache import PagedKVCache
        cache = PagedKVCache(64, page_size, 1, 1, dtype=torch.float64)
        seq = cache.add_sequence()
        cache.block_tables[seq], cache.lengths[seq] = list(block_table), length
        cache.free_pages = list(free_pages)
        cache.refcount = [1] * 64
        if last_page_shared and block_table:
            cache.refcount[block_table[-1]] = 2
        cache.append(seq, torch.zeros(1, n_new, 1, dtype=torch.float64), torch.zeros(1, n_new, 1, dtype=torch.float64))
        return torch.tensor(cache.block_tables[seq]), torch.tensor(
            [p * page_size + o for p, o in (cache.slot(seq, t) for t in range(length, length + n_new))])

    refused("11-slot-mapping", cache_append, tmp_path, monkeypatch, because="called attncourse.paged_cache")


def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(lse_a - ref)[..., None] * out_a + torch.exp(lse_b - ref)[..., None] * out_b, lse


def test_merge_ranks(tmp_path, monkeypatch):
    checks.check("11-merge-ranks", merge)

    def ring_private(out_a, lse_a, out_b, lse_b):  # the review's X5: ring._merge is exactly the exercise
        from attncourse.ring import _merge
        return _merge(out_a, lse_a, out_b, lse_b)

    refused("11-merge-ranks", ring_private, tmp_path, monkeypatch, because="called attncourse.ring")

    def softmax_of_lses(out_a, lse_a, out_b, lse_b):  # the weights as a softmax over the two lses
        w = torch.nan_to_num(torch.softmax(torch.stack([lse_a, lse_b]), 0))
        return w[0][..., None] * out_a + w[1][..., None] * out_b, torch.logaddexp(lse_a, lse_b)

    refused("11-merge-ranks", softmax_of_lses, tmp_path, monkeypatch, because="softmax")

    def reference(*args):
        from attncourse.classroom.checks.ch11 import _merge_reference
        return _merge_reference(*args)

    refused("11-merge-ranks", reference, tmp_path, monkeypatch, because="called attncourse.classroom")


def paged_fixed(query, k_pages, v_pages, block_table, length, slopes):
    h, d = query.shape
    hkv, page = k_pages.shape[1], k_pages.shape[2]
    kv_of = torch.arange(h) // (h // hkv)
    m = torch.full((h,), -math.inf, dtype=query.dtype)
    l, acc = torch.zeros(h, dtype=query.dtype), torch.zeros(h, d, dtype=query.dtype)
    for i, p in enumerate(block_table):
        n = min(page, length - i * page)
        if n <= 0:
            break
        k, v = k_pages[p, kv_of, :n], v_pages[p, kv_of, :n]
        s = (k @ query[:, :, None]).squeeze(-1) / math.sqrt(d)
        s = s - slopes[:, None] * ((length - 1) - (i * page + torch.arange(n)))[None, :]
        m_new = torch.maximum(m, s.amax(-1))
        alpha, e = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
        l, acc, m = alpha * l + e.sum(-1), alpha[:, None] * acc + (e[:, None, :] @ v).squeeze(1), m_new
    return acc / l[:, None]


def test_paged_alibi_bug(tmp_path, monkeypatch):
    checks.check("11-find-the-bug-1", paged_fixed)
    checks.check("11-paged-alibi-bug", paged_fixed)  # the old id still grades

    def scores_then_softmax(query, k_pages, v_pages, block_table, length, slopes):  # pages read one at a time,
        h, d = query.shape  # but every page's scores kept and normalised at the end: the sequence in one tensor
        hkv, page = k_pages.shape[1], k_pages.shape[2]
        kv_of = torch.arange(h) // (h // hkv)
        scores, values = [], []
        for i, p in enumerate(block_table):
            n = min(page, length - i * page)
            s = (k_pages[p, kv_of, :n] @ query[:, :, None]).squeeze(-1) / math.sqrt(d)
            scores.append(s - slopes[:, None] * ((length - 1) - (i * page + torch.arange(n)))[None, :])
            values.append(v_pages[p, kv_of, :n])
        w = torch.softmax(torch.cat(scores, -1), -1)
        return (w[:, None, :] @ torch.cat(values, 1)).squeeze(1)

    refused("11-find-the-bug-1", scores_then_softmax, tmp_path, monkeypatch, because="whole sequence")

    def page_number_as_position(query, k_pages, v_pages, block_table, length, slopes):  # the exercise's bug
        h, d = query.shape
        hkv, page = k_pages.shape[1], k_pages.shape[2]
        kv_of = torch.arange(h) // (h // hkv)
        m = torch.full((h,), -math.inf, dtype=query.dtype)
        l, acc = torch.zeros(h, dtype=query.dtype), torch.zeros(h, d, dtype=query.dtype)
        for i, p in enumerate(block_table):
            n = min(page, length - i * page)
            k, v = k_pages[p, kv_of, :n], v_pages[p, kv_of, :n]
            s = (k @ query[:, :, None]).squeeze(-1) / math.sqrt(d)
            s = s - slopes[:, None] * ((length - 1) - (p * page + torch.arange(n)))[None, :]
            m_new = torch.maximum(m, s.amax(-1))
            alpha, e = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
            l, acc, m = alpha * l + e.sum(-1), alpha[:, None] * acc + (e[:, None, :] @ v).squeeze(1), m_new
        return acc / l[:, None]

    with pytest.raises(checks.CheckFailed, match="out of order"):  # the case that shows it is named
        checks.check("11-find-the-bug-1", page_number_as_position)

    def package(query, k_pages, v_pages, block_table, length, slopes):
        from attncourse.classroom.checks.ch11 import paged_alibi_reference
        return paged_alibi_reference(query, k_pages, v_pages, block_table, length, slopes)

    refused("11-find-the-bug-1", package, tmp_path, monkeypatch, because="called attncourse")
    for breaker in checks.get("11-find-the-bug-1").breakers:
        refused("11-find-the-bug-1", as_learner(breaker), tmp_path, monkeypatch, because="whole sequence")


def test_chunking_experiment(tmp_path, monkeypatch):
    from attncourse.scheduler import A100_7B

    def reference(seed):
        from attncourse.classroom.checks.ch11 import budget_reference
        return budget_reference(seed)

    with pytest.raises(checks.CheckFailed, match="called attncourse.classroom"):
        checks.check("11-chunking-experiment", reference)

    def rule(seed):  # a rule read off the lesson: 128 tokens, full throughput, one step's time
        return torch.tensor([128.0, 1.0, A100_7B(128)], dtype=torch.float64)

    with pytest.raises(checks.CheckFailed):
        checks.check("11-chunking-experiment", rule)
