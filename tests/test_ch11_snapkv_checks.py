"""Chapter 11's exercise 8 (11-snapkv-keep): a right answer written another way passes the check cell and the grader;
each slip the cases were built to separate fails; the package's selection is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attncourse.classroom import checks
from attncourse.kv_compress import snapkv_keep
from exercise_routes import accepted, refused
from test_exercise_standard import as_learner


def select(weights, budget, window, kernel, *, voters=None, span_all=False, count_pad=True, pool="avg"):
    """SnapKV's selection with each step switchable to a slip (defaults: the reference code's)."""
    p = weights.shape[-1]
    keep = torch.ones(weights.shape[:-1], dtype=torch.bool)
    if budget >= p:
        return keep
    votes = weights[..., (p - window if voters is None else voters):, :].sum(-2)
    votes = votes if span_all else votes[..., :p - window]
    lead, n = votes.shape[:-1], votes.shape[-1]
    flat = votes.reshape(-1, 1, n)
    if pool == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=count_pad)
    keep[..., :p - window] = False
    top = pooled.reshape(*lead, n)[..., :p - window].topk(budget - window, -1).indices
    return keep.scatter(-1, top, True)


def snapkv_avgpool(weights, budget, window, kernel):
    return select(weights, budget, window, kernel)


def test_right_answer_passes_and_slips_fail(tmp_path, monkeypatch):
    accepted("11-snapkv-keep", snapkv_avgpool, tmp_path, monkeypatch)
    slips = {"the whole prompt votes (H2O)": dict(voters=0), "the window's keys pooled too": dict(span_all=True),
             "padding not counted": dict(count_pad=False), "max pooling": dict(pool="max")}
    for name, slip in slips.items():
        def wrong(weights, budget, window, kernel, slip=slip):
            return select(weights, budget, window, kernel, **slip)
        with pytest.raises(checks.CheckFailed):
            checks.check("11-snapkv-keep", as_learner(wrong))


def test_package_selection_refused(tmp_path, monkeypatch):
    def package(weights, budget, window, kernel):
        return snapkv_keep(weights, budget, window, kernel, pool="avg", pool_window=False)

    message, graded = refused("11-snapkv-keep", package, tmp_path, monkeypatch, statuses=("failed",))
    assert "snapkv_keep" in message and "snapkv_keep" in graded, (message, graded)


def test_trained_case_judges_answers():
    """On the trained model's maps a wrong selection is told the answers its cache leaves, beside SnapKV's."""
    case = next(c for c in checks.get("11-snapkv-keep").make_cases() if "trained" in c.name)
    wrong = select(*case.args, voters=0)
    message = case.compare(wrong, case.expected)
    assert message and "trained model" in message, message
    assert case.compare(case.expected.clone(), case.expected) is None
