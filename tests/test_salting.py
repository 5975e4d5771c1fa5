"""The grader's salted seeds (attncourse/classroom/checks/salting.py): a table of the check cells' expected values,
built by the notebook from the registry, does not answer the grader; right answers still pass under any salt."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch

from attncourse.classroom import checks
from attncourse.classroom.checks import gradients, salting
from attncourse.classroom.grading.remote import KERNEL_SIDE, judge

SALT = 20261128

# Exercises whose cases take no seed (fixed sizes or hand-written inputs): salting cannot change them, so a table
# of their expected values would still answer the grader. None is left: every exercise draws at least some of its
# cases from a seed. The test below fails when an exercise joins this list, so that joining it stays a decision.
# Exercises whose cases are the same under every salt, each with its reason. 05-conversion-predict: its eight
# verdicts are a table measured offline over 12 seeds (tests/test_ch05_predict.py re-measures some), which a
# salted grader cannot re-measure in time; the prediction's tries limit (checks/tries.py) stops a search over it.
# 06-passkey-predict: one verdict measured on the three stored models (tests/test_ch06_predict.py re-measures its
# edges), judged whole under the same tries limit.
FIXED_CASES: set[str] = {"05-conversion-predict", "06-passkey-predict"}


def test_every_seeding_route_is_mixed_and_restored():
    def draws():
        return (torch.rand(2, generator=torch.Generator().manual_seed(3)).tolist(),
                (torch.manual_seed(3), torch.rand(2).tolist())[1],
                np.random.default_rng(3).random(2).tolist(), (np.random.seed(3), np.random.rand(2).tolist())[1],
                np.random.RandomState(3).rand(2).tolist(), (random.seed(3), random.random())[1],
                random.Random(3).random())

    plain = draws()
    with salting.salted(SALT):
        salted = draws()
        again = draws()
        assert isinstance(torch.default_generator, torch.Generator)  # isinstance keeps its meaning
    assert draws() == plain  # everything restored
    assert salted == again  # deterministic under one salt
    assert all(a != b for a, b in zip(plain, salted)), "a seeding route the salt does not reach"
    with salting.salted(None):
        assert draws() == plain


def _key(x):
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.double().sum().item() if x.numel() else 0.0)
    if isinstance(x, np.ndarray):
        return _key(torch.from_numpy(x))
    if isinstance(x, (list, tuple)):
        return tuple(_key(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _key(v)) for k, v in sorted(x.items()))
    return repr(x)

# exercises whose expected value carries more than a right answer: the bfloat16 measurements' (reference errors,
# the band the legitimate orders of operations span for the all-bfloat16 error)
ANSWER_IN_EXPECTED = {"09-bf16-error": lambda e: e[0], "09-bf16-study": lambda e: e[0]}


def test_salted_cases_differ_and_their_expected_values_pass_their_own_comparison():
    """Under a salt, every function exercise's cases are new (except the listed fixed ones), and each case's
    expected value passes that case's comparison: a comparison written for one seed would fail a right answer."""
    unchanged, refused = set(), []
    for exercise_id, ex in sorted(checks.registry().items()):
        if ex.kind != "function":
            continue
        plain = ex.make_cases()
        with salting.salted(SALT):
            salted = ex.make_cases()
        if _key([(c.args, c.kwargs, c.expected) for c in plain]) == _key([(c.args, c.kwargs, c.expected)
                                                                           for c in salted]):
            unchanged.add(exercise_id)
        for case in salted:
            message = checks.feedback(ex, ANSWER_IN_EXPECTED.get(exercise_id, lambda e: e)(case.expected), case)
            if message:
                refused.append((exercise_id, case.name, message[:200]))
    assert not refused
    assert unchanged == FIXED_CASES


def _grader(ex, answer, salt, tmp_path, monkeypatch):
    """The grader's path, in process: cases built under `salt`, the answer called by the kernel side."""
    namespace: dict = {}
    exec(KERNEL_SIDE, namespace)
    monkeypatch.setitem(sys.modules["__main__"].__dict__, ex.target, answer)
    with salting.salted(salt):
        cases = ex.make_cases()
    torch.save([(tuple(c.args), dict(c.kwargs)) for c in cases], tmp_path / "in.pt")
    namespace["__attncourse_grade"](str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), ex.target, ex.kind,
                                    ex.numpy, ex.policy, salt)
    return judge(ex, cases, torch.load(tmp_path / "out.pt", weights_only=True))


@pytest.mark.parametrize("exercise_id", ["03-variance-experiment", "06-rope-convert", "11-merge-ranks", "14-moba-gate"])
def test_a_table_of_the_check_cells_answers_passes_the_cell_but_not_the_grader(exercise_id, tmp_path, monkeypatch):
    """The lookup-table route: top-level code builds the registry's cases (the check cell's, from fixed seeds) and
    the answer looks its input up. The check cell cannot tell (unless the exercise has a gradient case: a looked-up
    value carries no gradient); the grader's salted cases can."""
    ex = checks.get(exercise_id)
    table = [(c.args, c.kwargs, c.expected) for c in ex.make_cases()]  # top-level code, unguarded

    def lookup(*args, **kwargs):
        for a, k, expected in table:
            if _key((a, k)) == _key((args, kwargs)):
                return expected
        raise KeyError("not in my table")

    if any(gradients.is_added(c) for c in ex.make_cases()):  # a looked-up value carries no gradient
        with pytest.raises(checks.CheckFailed):
            checks.check(exercise_id, lookup)
    else:
        checks.check(exercise_id, lookup)  # the check cell is fooled: it uses the fixed seeds
    status, message = _grader(ex, lookup, SALT, tmp_path, monkeypatch)
    assert status in ("failed", "error"), (status, message)  # a wrong value, or an input not in the table


def dot_product_variance(d_k, std, n, seed):
    """A learner's honest measurement for 03-variance-experiment, seeded as the hint says."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d_k, generator=gen, dtype=torch.float64) * std
    k = torch.randn(n, d_k, generator=gen, dtype=torch.float64) * std
    return float((q * k).sum(-1).var())


def test_an_experiment_that_seeds_itself_passes_under_any_salt(tmp_path, monkeypatch):
    """The answer runs under the grader's salt too, so an honest experiment meets the reference's random numbers."""
    ex = checks.get("03-variance-experiment")
    checks.check(ex.id, dot_product_variance)
    for salt in (1, SALT):
        assert _grader(ex, dot_product_variance, salt, tmp_path, monkeypatch) == ("passed", "all 8 cases passed") or \
            _grader(ex, dot_product_variance, salt, tmp_path, monkeypatch)[0] == "passed"
