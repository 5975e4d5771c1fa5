"""attncourse.quest: Quest's page bounds against brute force (every key of every page scored)."""

from __future__ import annotations

import pytest
import torch

from attncourse.quest import page_bounds, quest_scores


def _brute(query, key, page_size):
    """The best single score per page, every key scored: (B, H, Tq, nP). Quest's bound may never be below it."""
    h, hkv, s = query.shape[1], key.shape[1], key.shape[2]
    scores = query @ key.repeat_interleave(h // hkv, 1).transpose(-2, -1)  # (B, H, Tq, S)
    return torch.stack([scores[..., a:a + page_size].amax(-1) for a in range(0, s, page_size)], -1)


@pytest.mark.parametrize("b,h,hkv,tq,s,d,page", [(2, 4, 2, 3, 37, 8, 6), (1, 1, 1, 1, 64, 16, 16), (1, 3, 1, 5, 7, 5, 1)])
def test_bound_is_never_below_the_best_key(b, h, hkv, tq, s, d, page):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, tq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, s, d, generator=gen, dtype=torch.float64)
    bound, best = quest_scores(q, k, page), _brute(q, k, page)
    assert bound.shape == best.shape == (b, h, tq, -(-s // page))
    assert (bound >= best - 1e-12).all()
    if page == 1:  # a page of one key: the bound is the score itself
        torch.testing.assert_close(bound, best)


def test_page_bounds_cover_the_short_last_page_only():
    k = torch.arange(10.0).reshape(1, 5, 2)  # 5 keys, pages of 2: the last page holds key 4 alone
    low, high = page_bounds(k, 2)
    torch.testing.assert_close(low[0, -1], k[0, 4])
    torch.testing.assert_close(high[0, -1], k[0, 4])
    torch.testing.assert_close(low[0, 0], k[0, 0])
    torch.testing.assert_close(high[0, 0], k[0, 1])


def test_identical_keys_make_the_bound_exact_and_half_precision_scores_in_float32():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 4, 8, generator=gen)
    k = torch.randn(1, 1, 3, 8, generator=gen).repeat_interleave(4, 2)  # pages of 4 identical keys
    torch.testing.assert_close(quest_scores(q, k, 4), _brute(q, k, 4))
    half = quest_scores(q.bfloat16(), k.bfloat16(), 4)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, _brute(q.bfloat16().float(), k.bfloat16().float(), 4))


def test_bad_input_is_refused():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 6, 8)
    with pytest.raises(TypeError, match="query"):
        quest_scores(q.numpy(), k, 2)
    with pytest.raises(ValueError, match="key"):
        quest_scores(q, torch.randn(1, 1, 6, 4), 2)
    with pytest.raises(ValueError, match="key"):
        quest_scores(torch.randn(1, 3, 3, 8), torch.randn(1, 2, 6, 8), 2)
    with pytest.raises(ValueError, match="page_size"):
        quest_scores(q, k, 0)
    with pytest.raises(TypeError, match="key"):
        page_bounds(torch.ones(4, 2, dtype=torch.long), 2)
