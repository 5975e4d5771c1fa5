"""A prediction check stops judging after three different wrong answers (attncourse.classroom.checks.tries)."""

import pytest

from attncourse.classroom import checks
from attncourse.classroom.checks import CheckFailed, tries

EX = "01-predict-shapes"


@pytest.fixture
def limited(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNCOURSE_PREDICTION_TRIES", "3")
    monkeypatch.setenv("ATTNCOURSE_STATE", str(tmp_path))
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
    monkeypatch.setenv("ATTNCOURSE_PREDICTION_TRIES", "unlimited")
    checks.check(EX, right_rule())


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv("ATTNCOURSE_PREDICTION_TRIES", "many")
    with pytest.raises(ValueError, match="ATTNCOURSE_PREDICTION_TRIES"):
        tries.limit()
