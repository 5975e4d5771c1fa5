"""A prediction check stops judging after three different wrong answers (attncourse.classroom.checks.tries)."""

import nbformat
import pytest
import torch

from attncourse.classroom import checks
from attncourse.classroom.checks import CheckFailed, tries
from attncourse.classroom.nbtools import ROOT

EX = "01-predict-shapes"


@pytest.fixture
def limited(monkeypatch, tmp_path):
    monkeypatch.setattr(tries, "_SETTING", "3")  # the environment is read once, at import: set what it read
    monkeypatch.setattr(tries, "_STATE_ROOT", str(tmp_path))
    tries._SEEN.clear()
    yield tmp_path
    tries._SEEN.clear()


def right_rule():
    table = {c.args: c.expected for c in checks.get(EX).make_cases()}

    def shapes(*args):
        return table[args]
    return shapes


def wrong_rule(n):
    def shapes(*args):
        return ((n, 1, 1), (1, 1), (1, 1), (1, 1))
    return shapes


def test_a_loop_over_candidate_answers_is_stopped_after_three_wrong_ones(limited):
    for n in range(3):
        with pytest.raises(CheckFailed) as err:
            checks.check(EX, wrong_rule(n))
        assert f"{n + 1} of 3 tries used" in str(err.value) or "last of 3 tries" in str(err.value)
    with pytest.raises(CheckFailed, match="judges no more answers"):
        checks.check(EX, right_rule())  # the right answer, found by the search, is no longer judged


def test_the_count_survives_a_new_kernel(limited):
    for n in range(3):
        with pytest.raises(CheckFailed):
            checks.check(EX, wrong_rule(n))
    tries._SEEN.clear()  # a fresh kernel: only the file remembers
    assert (limited / "tries.json").exists()
    with pytest.raises(CheckFailed, match="judges no more answers"):
        checks.check(EX, right_rule())


def test_the_same_wrong_answer_and_a_wrong_form_are_not_counted(limited):
    for _ in range(4):
        with pytest.raises(CheckFailed, match="1 of 3 tries used"):
            checks.check(EX, wrong_rule(0))
    for _ in range(4):  # a list of two items where four shapes are asked: told about the form, not counted
        with pytest.raises(CheckFailed) as err:
            checks.check(EX, lambda *a: [(1, 1), (1, 1)])
        assert "tries" not in str(err.value)
    checks.check(EX, right_rule())  # one try used: still judged
    assert checks.passed(EX)


def test_other_exercises_and_the_unlimited_setting_are_unaffected(limited, monkeypatch):
    for n in range(3):
        with pytest.raises(CheckFailed):
            checks.check(EX, wrong_rule(n))
    assert tries.exhausted("03-predict-shapes") is None
    monkeypatch.setenv("ATTNCOURSE_PREDICTION_TRIES", "unlimited")  # a notebook cell changing the environment
    with pytest.raises(CheckFailed, match="judges no more answers"):
        checks.check(EX, right_rule())
    monkeypatch.setattr(tries, "_SETTING", "unlimited")  # what the course's tests run under
    checks.check(EX, right_rule())


def test_lesson_00s_demonstration_is_not_counted(limited):
    cell = next(c.source for c in nbformat.read(ROOT / "notebooks/00_start_here.ipynb", 4).cells
                if c.cell_type == "code" and 'check("01-predict-shapes", predicted_shapes)' in c.source)
    namespace = {}
    exec(cell.split("try:")[0], namespace)
    case = checks.get(EX).make_cases()[0]
    assert tries.fingerprint(case.name, namespace["predicted_shapes"](*case.args)) == tries.DEMO[EX]
    for _ in range(2):
        with pytest.raises(CheckFailed) as err:
            checks.check(EX, namespace["predicted_shapes"])
        assert "tries" not in str(err.value)
    assert tries.used(EX) == set()


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setattr(tries, "_SETTING", "many")
    with pytest.raises(ValueError, match="ATTNCOURSE_PREDICTION_TRIES"):
        tries.limit()


BUG = "11-find-the-bug-1"


def wrong_fix(n):
    def fix(*args, **kwargs):
        return torch.full((1,), float(n))  # a different wrong result each time, as a search over edits gives
    return fix


def test_a_search_over_edits_of_a_find_the_bug_function_is_stopped(limited):
    """A cold reader passed 11-find-the-bug-1 by swapping names in the given function until the check passed
    (152 calls); a bug exercise judges tries.BUG_LIMIT different wrong results, then no more."""
    assert checks.get(BUG).category == "bug"
    for _ in range(3):  # an edit that raises is told what went wrong and not counted
        with pytest.raises(CheckFailed) as err:
            checks.check(BUG, lambda *a, **k: 1 / 0)
        assert "tries" not in str(err.value)
    for n in range(tries.BUG_LIMIT):
        with pytest.raises(CheckFailed) as err:
            checks.check(BUG, wrong_fix(n))
        assert f"{n + 1} of {tries.BUG_LIMIT} tries used" in str(err.value) or "last of" in str(err.value)
    with pytest.raises(CheckFailed, match="different fixes gave wrong results"):
        checks.check(BUG, wrong_fix(0))
    assert tries.exhausted("12-find-the-bug-1", "bug") is None  # other exercises keep theirs
    assert tries.limit("implement") is None and tries.limit("experiment") is None


def test_unlimited_lifts_the_bug_limit_too(limited, monkeypatch):
    monkeypatch.setattr(tries, "_SETTING", "unlimited")
    for n in range(tries.BUG_LIMIT + 2):
        with pytest.raises(CheckFailed) as err:
            checks.check(BUG, wrong_fix(n))
        assert "tries" not in str(err.value)


def test_a_graded_kernel_counts_tries_in_its_own_folder():
    """The grader runs each submission in a kernel whose ATTNCOURSE_STATE is that submission's temporary folder, so
    one student's loop over `check` neither uses up another's tries nor writes to the grader's own file."""
    from attncourse.classroom.grading import notebook
    from attncourse.classroom.nbtools import kernel_manager

    assert kernel_manager(env={"ATTNCOURSE_STATE": "/tmp/x"}).kernel_spec.env == {"ATTNCOURSE_STATE": "/tmp/x"}
    assert kernel_manager().kernel_spec.env == {}
    import inspect
    assert 'kernel_manager(env={"ATTNCOURSE_STATE"' in inspect.getsource(notebook._run_and_grade)
