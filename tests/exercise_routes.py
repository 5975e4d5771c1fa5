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


# ----------------------------------------------------------------------------- a prediction judged whole


def one_part_wrong(expected, i):
    """`expected` with only part `i` changed (a shape gets one more row, a count one more, None becomes 0)."""
    if isinstance(expected, dict):
        key = list(expected)[i]
        v = expected[key]
        return {**expected, key: 0 if v is None else v + 1}
    parts = list(expected)
    parts[i] = (parts[i][0] + 1, *parts[i][1:])
    return tuple(parts)


def whole_prediction_messages(exercise_id, tmp_path, monkeypatch):
    """What the check cell and the grader say to each answer with one part wrong, and to one with every part wrong:
    the same words every time (nothing tells which part differs), none of them a part's name."""
    ex = checks.get(exercise_id)
    (case,) = ex.make_cases()
    expected = case.expected
    answers = [one_part_wrong(expected, i) for i in range(len(expected))]
    every = expected
    for i in range(len(expected)):
        every = one_part_wrong(every, i)
    answers.append(every)
    said = set()
    for answer in answers:
        try:
            checks.check(exercise_id, answer)
            raise AssertionError(f"{exercise_id} accepted the wrong prediction {answer!r}")
        except checks.CheckFailed as err:
            cell = str(err)
        reply = {"status": "ok", "results": [("ok", checks.to_portable(answer))]}
        status, graded = judge(ex, [case], reply)
        assert status == "failed", (status, graded)
        said.add(cell.split("\n", 1)[1])  # past the first line (the exercise and the case)
        for name in (ex.parts or [str(k) for k in expected]):
            assert f"wrong: {name}" not in cell and f"wrong: {name}" not in graded, cell
        assert "other parts are right" not in cell + graded
    assert len(said) == 1, said  # one message for every wrong answer: guessing part by part learns nothing
    return said.pop()
