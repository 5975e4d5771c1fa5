"""Sparse patterns: their shapes, pair counts, and attention under them equal to dense attention."""

import pytest
import torch
import torch.nn.functional as F

from attncourse import masks, scaled_dot_product_attention
from attncourse.sparse import (allowed_keys, bigbird, bigbird_random, count_scored_pairs, dilated, gathered_attention,
                               global_tokens, local, log_dilated, longformer)

T = 37  # prime: no pattern lines up with it


def brute(rule, t=T):
    """The pattern written as a double loop over (i, j)."""
    return torch.tensor([[bool(rule(i, j)) for j in range(t)] for i in range(t)])


def test_dilated_matches_its_definition_and_window():
    got = masks.materialize(dilated(4, 3), T, T)
    torch.testing.assert_close(got, brute(lambda i, j: 0 <= i - j < 12 and (i - j) % 3 == 0))
    torch.testing.assert_close(masks.materialize(dilated(5, 1), T, T), masks.materialize(masks.sliding_window(5), T, T))


def test_log_dilated_levels():
    def rule(i, j):
        gap, level = i - j, 0
        if gap < 0:
            return False
        while gap >= 3 * (2 ** (level + 1) - 1):  # level l covers [w(2^l - 1), w(2^(l+1) - 1))
            level += 1
        return gap % (2 ** level) == 0
    torch.testing.assert_close(masks.materialize(log_dilated(3), T, T), brute(rule))


def test_longformer_and_causal_version():
    got = masks.materialize(longformer(6, 2), T, T)
    torch.testing.assert_close(got, brute(lambda i, j: abs(i - j) <= 3 or i < 2 or j < 2))
    torch.testing.assert_close(masks.materialize(longformer(6, 2, is_causal=True), T, T), got & brute(lambda i, j: j <= i))
    assert bool(masks.materialize(global_tokens(0), 5, 5).any()) is False
    torch.testing.assert_close(masks.materialize(local(1), 4, 4), torch.eye(4, dtype=torch.bool))


def test_bigbird_random_rows_seed_and_causality():
    r = bigbird_random(T, 3, block_size=4, seed=7)
    table = r.table
    assert table.shape == (10, 10) and table.sum(dim=1).tolist() == [3] * 10
    torch.testing.assert_close(masks.materialize(bigbird_random(T, 3, block_size=4, seed=7), T, T), masks.materialize(r, T, T))
    assert not torch.equal(bigbird_random(T, 3, block_size=4, seed=8).table, table)
    causal_table = bigbird_random(T, 3, block_size=4, seed=7, is_causal=True).table
    assert not causal_table.triu(diagonal=1).any()
    assert causal_table.sum(dim=1).tolist() == [1, 2] + [3] * 8  # early blocks have fewer earlier blocks to pick
    full = masks.materialize(bigbird(T, 5, 2, 3, block_size=4, seed=7), T, T)
    parts = (masks.materialize(local(5), T, T) | masks.materialize(global_tokens(2), T, T)
             | masks.materialize(r, T, T))
    torch.testing.assert_close(full, parts)


def test_count_scored_pairs_growth():
    for t in (17, 64, 130):
        assert count_scored_pairs(masks.causal, t, rows=7) == t * (t + 1) // 2
        w = 8
        assert count_scored_pairs(masks.sliding_window(w), t) == sum(min(i + 1, w) for i in range(t))
        assert count_scored_pairs(longformer(4, 1), t, rows=5) == int(masks.materialize(longformer(4, 1), t, t).sum())
    assert count_scored_pairs(masks.causal, 3, 5) == int(masks.materialize(masks.causal, 3, 5).sum())
    # log-dilated grows like T log T: doubling T a bit more than doubles the count, far less than 4x
    a, b = count_scored_pairs(log_dilated(4), 1024), count_scored_pairs(log_dilated(4), 2048)
    assert 2.0 < b / a < 2.4


PATTERNS = {
    "sliding": masks.sliding_window(5),
    "dilated": dilated(3, 4),
    "log_dilated": log_dilated(2),
    "longformer": longformer(6, 2),
    "longformer_causal": longformer(6, 2, is_causal=True),
    "bigbird": bigbird(T, 5, 2, 2, block_size=3, seed=1),
    "bigbird_causal": bigbird(T, 5, 1, 2, block_size=3, seed=1, is_causal=True),
}


@pytest.mark.parametrize("name", PATTERNS)
def test_masked_attention_equals_dense_under_the_same_mask(name):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 3, T, 8, dtype=torch.float64).unbind(0)
    mask = masks.materialize(PATTERNS[name], T, T)  # (T, T)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, mask), ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gathered_attention(q, k, v, mask), ref, rtol=1e-10, atol=1e-10)


def test_gathered_attention_gradients_and_empty_rows():
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 1, 2, 6, 4, dtype=torch.float64, requires_grad=True).unbind(0)
    mask = masks.materialize(dilated(2, 2), 6, 6)
    torch.autograd.gradcheck(lambda q, k, v: gathered_attention(q, k, v, mask), (q, k, v))
    mask = mask.clone()
    mask[2] = False  # a query with no key: zeros, not NaN
    out = gathered_attention(q, k, v, mask)
    assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, mask))


def test_allowed_keys_table():
    mask = torch.tensor([[True, False, True], [False, False, False], [False, True, False]])
    index, valid = allowed_keys(mask)
    assert index.tolist() == [[0, 2], [0, 0], [1, 0]] and valid.tolist() == [[True, True], [False, False], [True, False]]


@pytest.mark.parametrize("call,exc,words", [
    (lambda: dilated(0, 2), ValueError, "window"),
    (lambda: dilated(3, 1.5), TypeError, "dilation"),
    (lambda: log_dilated(-1), ValueError, "window"),
    (lambda: longformer(4, -1), ValueError, "n_global"),
    (lambda: longformer(4, 1, is_causal=1), TypeError, "is_causal"),
    (lambda: bigbird_random(10, 2, block_size=0), ValueError, "block_size"),
    (lambda: bigbird(10, 3, 1, 2, seed=-1), ValueError, "seed"),
    (lambda: count_scored_pairs(masks.causal, 0), ValueError, "q_len"),
    (lambda: count_scored_pairs("causal", 4), TypeError, "mask_mod"),
    (lambda: allowed_keys(torch.ones(3, 3)), ValueError, "bool"),
    (lambda: gathered_attention(torch.randn(1, 4, 2), torch.randn(1, 5, 2), torch.randn(1, 5, 2),
                                torch.ones(4, 4, dtype=torch.bool)), ValueError, "(4, 5)"),
])
def test_bad_input(call, exc, words):
    with pytest.raises(exc, match=r".*" + words.replace("(", r"\(").replace(")", r"\)")):
        call()
