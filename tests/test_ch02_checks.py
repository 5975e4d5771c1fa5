"""Chapter 02's checks refuse the buggy code the exercises hand out, and accept independent right answers."""

import pytest
import torch

from attncourse import scaled_dot_product_attention
from attncourse.classroom import checks


def _buggy(query, keys, values, lengths):  # the exercise's code: the mask marks the padding, not the tokens
    pad = torch.arange(keys.shape[1]) >= lengths[:, None]
    return scaled_dot_product_attention(query.unsqueeze(1), keys, values, pad.unsqueeze(1), scale=1.0).squeeze(1)


def _fixed(query, keys, values, lengths):
    valid = torch.arange(keys.shape[1]) < lengths[:, None]  # (B, T)
    scores = torch.einsum("bd,btd->bt", query, keys).masked_fill(~valid, float("-inf"))
    return torch.einsum("bt,btv->bv", torch.softmax(scores, dim=-1), values)


def test_the_bug_fails_and_the_fix_passes(capsys):
    with pytest.raises(checks.CheckFailed, match="02-find-the-bug"):
        checks.check("02-find-the-bug", _buggy)
    checks.check("02-find-the-bug", _fixed)
    assert "✓ 02-find-the-bug" in capsys.readouterr().out


def test_the_scaled_score_is_refused_as_wrong():
    def scaled(query, keys, values, lengths):
        valid = torch.arange(keys.shape[1]) < lengths[:, None]
        return scaled_dot_product_attention(query.unsqueeze(1), keys, values, valid.unsqueeze(1)).squeeze(1)

    with pytest.raises(checks.CheckFailed):
        checks.check("02-find-the-bug", scaled)


def test_init_width_needs_both_halves_of_the_matrix():
    def query_half_only(W, query_size, queries, keys):
        return float((queries @ W[:, :query_size].T).pow(2).mean().sqrt())

    with pytest.raises(checks.CheckFailed, match="02-init-width"):
        checks.check("02-init-width", query_half_only)
    counts = checks.get("02-parameter-counts").make_cases()[0].expected
    assert counts["dot"] is None and counts["concat"] == counts["additive"] > counts["general"] > 0
