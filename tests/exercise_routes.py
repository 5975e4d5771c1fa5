"""The route-test harness the chapter check tests share: an answer typed in a notebook cell, judged by the check cell
and by the grader's judging path (run in this process, as tests/test_exercise_standard.py does)."""

from __future__ import annotations

import pytest

from attncourse.classroom import checks
from attncourse.classroom.grading.remote import judge
from test_exercise_standard import as_learner, grader_reply

NOT_THE_WAY = "not the way this exercise asks"


def failure(exercise_id, answer):
    """The check cell's message for `answer` (which must fail)."""
    with pytest.raises(checks.CheckFailed) as info:
        checks.check(exercise_id, answer)
    return str(info.value)


def refused(exercise_id, answer, tmp_path, monkeypatch, statuses=("failed", "error")):
    """(check cell's message, grader's message) for `answer`, which both must refuse."""
    ex = checks.get(exercise_id)
    learner = as_learner(answer)
    msg = failure(exercise_id, learner)
    cases = ex.make_cases()
    status, graded = judge(ex, cases, grader_reply(ex, learner, cases, tmp_path, monkeypatch))
    assert status in statuses, (status, graded)
    return msg, graded


def accepted(exercise_id, answer, tmp_path, monkeypatch):
    """`answer` passes the check cell and the grader."""
    ex = checks.get(exercise_id)
    learner = as_learner(answer)
    checks.check(exercise_id, learner)
    cases = ex.make_cases()
    assert judge(ex, cases, grader_reply(ex, learner, cases, tmp_path, monkeypatch))[0] == "passed"
