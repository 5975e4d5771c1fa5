"""Chapter 02's checks refuse the buggy code the exercises hand out, and accept independent right answers."""

import pytest
import torch

from attncourse import scaled_dot_product_attention
from attncourse.classroom import checks


def _buggy(query, keys, values, lengths):  # the exercise's code: the mask marks the padding, not the tokens
    mask = torch.arange(keys.shape[1]) >= lengths[:, None]
    return scaled_dot_product_attention(query.unsqueeze(1), keys, values, mask.unsqueeze(1), scale=1.0).squeeze(1)


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
    def query_half_only(queries, keys, hidden_size, seed):  # ignores the keys' part of each tanh input
        from attncourse.classroom.checks.ch02 import initial_weights

        dq, dk = queries.shape[1], keys.shape[2]
        rms = [float((queries @ initial_weights(s, seed, dq, dk, hidden_size)[:, :dq].T).pow(2).mean().sqrt())
               for s in ("additive", "concat")]
        return rms[0] / rms[1]

    with pytest.raises(checks.CheckFailed, match="02-init-width"):
        checks.check("02-init-width", query_half_only)
    counts = checks.get("02-parameter-counts").make_cases()[0].expected
    assert counts["dot"] is None and counts["additive"] == counts["concat"] + 32 and counts["general"] == 64 * 48 + 64
