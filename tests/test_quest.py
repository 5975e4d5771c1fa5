"""attncourse.quest: the page bound never falls below a page's best exact score (partial last page included), the
selection equals a brute-force ranking by bounds computed key by key, and reading every page is plain attention."""

from __future__ import annotations

import pytest
import torch

from attncourse.heads import planted_induction_model
from attncourse.kv_compress import compressed_eval, retrieval_batch
from attncourse.quest import page_bounds, page_upper_bounds, quest_eval, quest_keep, quest_scores


def test_bound_is_an_upper_bound_and_tight_for_one_key_pages():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 23, 8, generator=gen, dtype=torch.float64)  # (B, H, S, D): 23 keys, pages of 5 (last: 3)
    q = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64)
    kmin, kmax = page_bounds(k, 5)
    assert kmin.shape == kmax.shape == (2, 3, 5, 8)
    torch.testing.assert_close(kmin[..., -1, :], k[..., 20:, :].amin(-2))  # padding never counted
    bound = page_upper_bounds(q, kmin, kmax)  # (B, H, 5)
    scores = (k @ q[..., None]).squeeze(-1)  # (B, H, 23)
    for p in range(5):
        assert (bound[..., p] >= scores[..., 5 * p:5 * p + 5].amax(-1) - 1e-12).all()
    torch.testing.assert_close(page_upper_bounds(q, *page_bounds(k, 1)), scores)  # one key per page: exact


def test_selection_equals_brute_force():
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(4, 19, 6, generator=gen, dtype=torch.float64)  # (H, S, D)
    q = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    keep = quest_keep(q, k, 4, 2)  # pages of 4: 5 pages, the last (3 keys) always read
    for h in range(4):
        pages = [list(range(p, min(p + 4, 19))) for p in range(0, 19, 4)]
        bound = [sum(max(float(q[h, d]) * min(float(k[h, j, d]) for j in pg),
                         float(q[h, d]) * max(float(k[h, j, d]) for j in pg)) for d in range(6)) for pg in pages]
        best = sorted(range(4), key=lambda p: -bound[p])[:2] + [4]
        assert keep[h].tolist() == [any(j in pages[p] for p in best) for j in range(19)]
    oracle = quest_keep(q, k, 4, 1, oracle=True)
    scores = (k @ q[..., None]).squeeze(-1)
    top = torch.stack([scores[:, p:p + 4].amax(-1) for p in range(0, 16, 4)], -1).argmax(-1)  # (H,)
    for h in range(4):
        assert oracle[h, 4 * int(top[h]):4 * int(top[h]) + 4].all() and int(oracle[h].sum()) == 4 + 3


def test_reading_every_page_is_plain_attention_and_few_pages_find_the_copy():
    model = planted_induction_model(16, 12, generator=torch.Generator().manual_seed(0))
    tokens, p = retrieval_batch(torch.Generator().manual_seed(1), 8, 12, 16, question=3, answer=6)
    full = compressed_eval(model, tokens, p, "full")["accuracy"]
    every = quest_eval(model, tokens, p, page_size=3, pages=20)
    assert every["accuracy"] == full == 1.0 and abs(every["recall"] - 1.0) < 1e-6
    assert quest_eval(model, tokens, p, page_size=3, pages=1)["accuracy"] == 1.0  # the bound finds the page
    assert quest_eval(model, tokens, p, page_size=3, pages=1, mode="recent")["accuracy"] < 0.5
    with pytest.raises(ValueError):
        quest_eval(model, tokens, p, page_size=3, pages=1, mode="lru")
    with pytest.raises(ValueError):
        page_upper_bounds(torch.ones(4), torch.ones(2, 3), torch.ones(2, 3))


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
