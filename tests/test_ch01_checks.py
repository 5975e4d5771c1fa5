"""Chapter 01's checks refuse the buggy code the exercises hand out, and accept independent right answers."""

import pytest
import torch

from attncourse.classroom import checks


def _buggy(query, keys, W_q, W_k, v):  # the exercise's code: the softmax runs over a trailing axis of size 1
    q = (query @ W_q.T).unsqueeze(1)
    k = keys @ W_k.T
    scores = torch.tanh(q + k) @ v.unsqueeze(-1)  # (B, T, 1)
    weights = torch.softmax(scores, dim=-1)
    return (weights * keys).sum(dim=1), weights.squeeze(-1)


def _fixed(query, keys, W_q, W_k, v):
    scores = torch.einsum("a,bta->bt", v, torch.tanh((query @ W_q.T)[:, None] + keys @ W_k.T))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bt,btd->bd", weights, keys), weights


def test_the_bug_fails_and_the_fix_passes(capsys):
    with pytest.raises(checks.CheckFailed, match="01-find-the-bug"):
        checks.check("01-find-the-bug", _buggy)
    checks.check("01-find-the-bug", _fixed)
    assert "✓ 01-find-the-bug" in capsys.readouterr().out


def test_padding_mask_refuses_nan_rows():
    def nan_on_empty_rows(scores, lengths):
        mask = torch.arange(scores.shape[1]) < lengths[:, None]
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # NaN where lengths == 0

    with pytest.raises(checks.CheckFailed, match="length 0 gives a row of zeros"):
        checks.check("01-padding-mask", nan_on_empty_rows)


def test_query_influence_tells_the_variants_apart():
    from attncourse.classroom.checks.ch01 import VARIANTS, _weight_spread

    def tanh_everywhere(queries, keys, W_q, W_k, v):  # every variant scored like the first: the check must notice
        w = torch.softmax(torch.tanh((queries @ W_q.T)[:, None] + keys @ W_k.T) @ v, dim=-1)  # (N, T)
        return tuple(_weight_spread(w) for _ in VARIANTS)

    with pytest.raises(checks.CheckFailed, match="01-query-influence"):
        checks.check("01-query-influence", tanh_everywhere)
    expected = checks.get("01-query-influence").make_cases()[0].expected
    spread = dict(zip(VARIANTS, expected))
    assert spread["linear"] < 1e-12 and spread["separate"] < 1e-12  # a constant per query: the softmax ignores it
    assert min(spread["tanh"], spread["relu"], spread["product"]) > 1e-3
