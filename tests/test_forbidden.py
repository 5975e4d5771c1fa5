"""The call guard (attncourse.classroom.checks.forbidden): a forbidden library function is refused however the
answer reaches it, by the check cell and by the grader's kernel-side code alike; the learner's own code never is."""

from __future__ import annotations

import sys

import pytest
import torch

import attncourse
import attncourse.positions
from attncourse.classroom import checks
from attncourse.classroom.checks import forbidden
from attncourse.classroom.grading.remote import KERNEL_SIDE, judge

REAL_SLOPES = attncourse.positions.alibi_slopes


def slope_cases():
    return [checks.Case(f"{n} heads", (n,), expected=REAL_SLOPES(n)) for n in (4, 6)]


def softmax_cases():
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return [checks.Case("rows", (x,), expected=torch.softmax(x, -1))]


def my_slopes(n):
    """The learner's own slopes (Press et al.'s rule, written out)."""
    import math

    def power_of_two(k):
        start = 2 ** (-(2 ** -(math.log2(k) - 3)))
        return [start * start**i for i in range(k)]

    if math.log2(n).is_integer():
        return torch.tensor(power_of_two(n))
    closest = 2 ** math.floor(math.log2(n))
    extra = power_of_two(2 * closest)[0::2][: n - closest]
    return torch.tensor(power_of_two(closest) + extra)


@pytest.fixture
def exercise(monkeypatch):
    def register(make_cases, forbid, target="answer"):
        ex = checks.Exercise("99-guard", target, make_cases, forbid=forbid, category="implement")
        monkeypatch.setitem(checks._REGISTRY, ex.id, ex)
        return ex

    return register


@pytest.fixture
def verdicts(tmp_path, monkeypatch, capsys):
    """(check cell message or None, grader status and message) for an answer."""
    def run(ex, answer):
        try:
            checks.check(ex.id, answer)
            cell = None
        except checks.CheckFailed as err:
            cell = str(err)
        capsys.readouterr()
        namespace: dict = {}
        exec(KERNEL_SIDE, namespace)
        monkeypatch.setitem(sys.modules["__main__"].__dict__, ex.target, answer)
        cases = ex.make_cases()
        torch.save([(tuple(c.args), dict(c.kwargs)) for c in cases], tmp_path / "in.pt")
        namespace["__attncourse_grade"](str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), ex.target, ex.kind,
                                        ex.numpy, tuple(ex.forbid))
        assert sys.getprofile() is None and not torch.overrides._get_current_function_mode_stack()
        return cell, judge(ex, cases, torch.load(tmp_path / "out.pt", weights_only=True))

    return run


def refused(result, name: str) -> bool:
    cell, (status, message) = result
    return (cell is not None and f"called {name}" in cell) and status == "failed" and f"called {name}" in message


def passed(result) -> bool:
    cell, (status, _) = result
    return cell is None and status == "passed"


def test_every_route_to_a_forbidden_package_function_is_refused(exercise, verdicts, monkeypatch):
    ex = exercise(slope_cases, ("attncourse.positions.alibi_slopes",))
    assert passed(verdicts(ex, my_slopes))
    assert refused(verdicts(ex, lambda n: attncourse.positions.alibi_slopes(n)), "attncourse.positions.alibi_slopes")
    assert refused(verdicts(ex, lambda n: attncourse.alibi_slopes(n)), "attncourse.positions.alibi_slopes")  # re-export
    from attncourse import alibi_slopes as renamed  # imported under another name before the check

    assert refused(verdicts(ex, lambda n: renamed(n)), "attncourse.positions.alibi_slopes")
    assert refused(verdicts(ex, REAL_SLOPES), "attncourse.positions.alibi_slopes")  # the library's function as the answer


def test_a_rebound_name_is_the_learners_code_but_the_original_is_still_refused(exercise, verdicts, monkeypatch):
    ex = exercise(slope_cases, ("attncourse.positions.alibi_slopes",))
    for name, module in list(sys.modules.items()):  # every module-level name of the library's function, re-bound
        if name.startswith("attncourse") and getattr(module, "alibi_slopes", None) is REAL_SLOPES:
            monkeypatch.setattr(module, "alibi_slopes", my_slopes)
    assert passed(verdicts(ex, lambda n: attncourse.alibi_slopes(n)))  # the learner's own function, by that name
    # ... but the original, saved in the notebook under another name before re-binding, is still the library's
    monkeypatch.setitem(sys.modules["__main__"].__dict__, "kept", REAL_SLOPES)
    assert refused(verdicts(ex, lambda n: REAL_SLOPES(n)), "attncourse.positions.alibi_slopes")


def test_every_spelling_of_a_pytorch_op_is_refused(exercise, verdicts):
    ex = exercise(softmax_cases, ("torch.softmax",))
    assert passed(verdicts(ex, lambda x: torch.exp(x - x.amax(-1, keepdim=True)) / torch.exp(
        x - x.amax(-1, keepdim=True)).sum(-1, keepdim=True)))
    for answer in (lambda x: torch.softmax(x, -1), lambda x: x.softmax(-1), lambda x: torch.nn.functional.softmax(x, -1),
                   lambda x: torch.special.softmax(x, -1)):
        assert refused(verdicts(ex, answer), "torch.")
    f = torch.nn.functional.softmax
    assert refused(verdicts(ex, lambda x, _f=f: _f(x, -1)), "torch.")  # a default argument bound earlier


def test_a_forbidden_class_forbids_building_or_calling_it(exercise, verdicts):
    ex = exercise(softmax_cases, ("torch.nn.MultiheadAttention",))

    def via_module(x):
        torch.nn.MultiheadAttention(5, 1)
        return torch.softmax(x, -1)

    assert refused(verdicts(ex, via_module), "torch.nn.MultiheadAttention")
    assert passed(verdicts(ex, lambda x: torch.softmax(x, -1)))


def test_switching_the_guard_off_is_refused(exercise, verdicts):
    ex = exercise(softmax_cases, ("torch.softmax",))

    def sneaky(x):
        sys.setprofile(None)
        return torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)

    assert refused(verdicts(ex, sneaky), "sys.setprofile")


def test_the_guard_chains_a_profiler_already_installed():
    events = []
    sys.setprofile(lambda frame, event, arg: events.append(event))
    try:
        with forbidden.CallGuard(("torch.softmax",)) as guard:
            torch.softmax(torch.ones(3), -1)
        assert guard.used == ["torch.softmax"] and events
        assert sys.getprofile() is not None  # the previous profiler is back
    finally:
        sys.setprofile(None)


def test_nothing_is_watched_without_a_forbidden_name():
    with forbidden.CallGuard(()) as guard:
        assert sys.getprofile() is None
    assert guard.used == []
    assert forbidden.resolve("attncourse.no_such_function") == []
