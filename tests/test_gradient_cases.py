"""The gradient case (attncourse.classroom.checks.gradients): an answer that computes its result outside PyTorch
(the numbers carried out as scaled integers, which the read-out budget does not count) is refused by the check and
by the grader's judging path; an honest answer passes both; an exercise whose job has no gradient gets no case."""

from __future__ import annotations

import math

import pytest
import torch

from attncourse.classroom import checks
from attncourse.classroom.checks import gradients
from test_exercise_standard import Grader, as_learner


def honest(q, k, v, is_causal=False):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) - math.log(k.shape[-2])
    if is_causal:
        s = s.masked_fill(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1), float("-inf"))
    return torch.sigmoid(s) @ v


def via_integers(q, k, v, is_causal=False):
    """The right numbers, computed in plain Python on integers read out of the tensors."""
    scale = 2 ** 40
    qi, ki, vi = ((t * scale).round().long().tolist() for t in (q, k, v))
    lead, (tq, d), (tk, dv) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    flat = lambda x: [x] if not isinstance(x[0][0], list) else [m for y in x for m in flat(y)]  # noqa: E731
    out = []
    for qm, km, vm in zip(flat(qi), flat(ki), flat(vi)):
        rows = []
        for i in range(tq):
            w = [0.0 if is_causal and j > i else
                 1 / (1 + math.exp(-(sum(a * b for a, b in zip(qm[i], km[j])) / scale ** 2 / math.sqrt(d)
                                     - math.log(tk)))) for j in range(tk)]
            rows.append([sum(w[j] * vm[j][c] / scale for j in range(tk)) for c in range(dv)])
        out.append(rows)
    return torch.tensor(out, dtype=q.dtype).reshape(*lead, tq, dv)


def via_integers_glued(q, k, v, is_causal=False):
    """The same, glued to the inputs by a term that is zero: it carries a gradient, the wrong one."""
    return via_integers(q, k, v, is_causal) + 0 * (q.sum() + k.sum() + v.sum())


def test_a_result_computed_outside_pytorch_is_refused_by_its_gradient(tmp_path, monkeypatch):
    ex = checks.get("12-sigmoid")
    cases = ex.make_cases()
    assert sum(gradients.is_added(c) for c in cases) == 1 and gradients.declared(cases) == len(cases) - 1
    for answer in map(as_learner, (via_integers, via_integers_glued)):
        for case in cases[:-1]:  # the declared cases pass: the read-out budget does not see integers
            got = checks.evaluate(ex, answer, case)
            assert checks.feedback(ex, got, case) is None
        with pytest.raises(checks.CheckFailed, match="gradient"):
            checks.check("12-sigmoid", answer)
        status, message = Grader(tmp_path, monkeypatch)(ex, answer, cases)
        assert status in ("failed", "error") and "gradient" in message, message
    checks.check("12-sigmoid", as_learner(honest))
    assert Grader(tmp_path, monkeypatch)(ex, as_learner(honest), cases) == ("passed", f"all {len(cases) - 1} case(s) passed")


def test_the_added_case_compares_gradients_of_real_inputs_only():
    ex = checks.get("12-sigmoid")
    case = ex.make_cases()[-1]
    good = checks.forbidden.run(as_learner(honest), case.args, case.kwargs, {})["result"]
    assert checks.feedback(ex, good, case) is None
    out, *grads = good
    assert checks.feedback(ex, (out, grads[0] * 1.01, *grads[1:]), case) is not None  # a gradient 1% off is wrong
    assert "zero" in checks.feedback(ex, (out, torch.zeros_like(grads[0]), *grads[1:]), case)


@pytest.mark.parametrize("exercise_id", ["07-cache-mask", "11-slot-mapping", "10-forward-kernel", "03-sdpa-numpy",
                                         "05-mean-pool"])
def test_no_gradient_case_where_the_job_has_none_or_no_library_answer_has_one(exercise_id):
    assert not any(gradients.is_added(c) for c in checks.get(exercise_id).make_cases())


def test_chapters_01_to_03_keep_their_own_backward_cases_and_get_no_second():
    for exercise_id in ("01-additive-score", "02-general-score", "03-masked-attention"):
        cases = checks.get(exercise_id).make_cases()
        assert any((c.kwargs or {}).get(checks.forbidden.BACKWARD) for c in cases)
        assert not any(gradients.is_added(c) for c in cases)


def test_building_the_case_leaves_the_global_random_stream_alone():
    """04-mha-per-head's shortcuts build nn.MultiheadAttention, which draws weights: the notebook's next unseeded
    draw must be the one it was before the gradient case existed (nbval compares it)."""
    ex = checks.get("04-mha-per-head")
    declared_only = ex.make_cases.declared
    torch.manual_seed(0)
    declared_only()
    expected = torch.randn(3)
    torch.manual_seed(0)
    assert any(gradients.is_added(c) for c in ex.make_cases())
    torch.testing.assert_close(torch.randn(3), expected)


def test_every_exercise_still_names_its_chapter_module():
    """The grader's watch (grading.watch) finds an exercise's check module by its case builder's module."""
    for ex in checks.registry().values():
        assert ex.make_cases.__module__.rsplit(".", 1)[-1].startswith(ex.chapter.join(("ch", ""))), ex.id


def merge_many_honest(m_all, l_all):
    m = m_all.amax(dim=0)
    return m, (torch.exp(m_all - m.masked_fill(torch.isneginf(m), 0.0)) * l_all).sum(dim=0)


def merge_many_via_integers(m_all, l_all):
    """08-merge-many's (max, sum) computed in plain Python on integers read out of the tensors."""
    scale = 2 ** 40
    empty = torch.isneginf(m_all).flatten().tolist()
    ms = (m_all.masked_fill(torch.isneginf(m_all), 0) * scale).round().long().flatten().tolist()
    ls = (l_all * scale).round().long().flatten().tolist()
    ms = [-math.inf if e else x / scale for x, e in zip(ms, empty)]
    k, n = m_all.shape[0], len(ms) // m_all.shape[0]
    m = [max(ms[j * n + i] for j in range(k)) for i in range(n)]
    lsum = [sum(math.exp(ms[j * n + i] - m[i]) * ls[j * n + i] / scale if ms[j * n + i] > -math.inf else 0.0
                for j in range(k)) for i in range(n)]
    m = torch.tensor(m, dtype=m_all.dtype)
    return m.reshape(m_all.shape[1:]), torch.tensor(lsum, dtype=l_all.dtype).reshape(l_all.shape[1:])


def test_a_tuple_result_is_judged_by_its_first_item_gradient(tmp_path, monkeypatch):
    """An exercise whose answer is a tuple gets the case too, judged on the first item (the result): 08-merge-many's
    declared cases pass the integer route; its gradient case and the grader refuse it, and pass the honest answer."""
    ex = checks.get("08-merge-many")
    cases = ex.make_cases()
    assert sum(gradients.is_added(c) for c in cases) == 1
    cheat = as_learner(merge_many_via_integers)
    for case in cases[:-1]:
        assert checks.feedback(ex, checks.evaluate(ex, cheat, case), case) is None, case.name
    with pytest.raises(checks.CheckFailed, match="gradient"):
        checks.check(ex.id, cheat)
    status, message = Grader(tmp_path, monkeypatch)(ex, cheat, cases)
    assert status in ("failed", "error") and "gradient" in message, message
    checks.check(ex.id, as_learner(merge_many_honest))


@pytest.mark.parametrize("exercise_id", ["09-tiled-forward", "10-online-update", "07-cache-update"])
def test_no_gradient_case_where_right_answers_have_no_graph(exercise_id):
    """In-place updates of full-size state (09) or of the arguments (07), a Triton kernel (10): right answers
    autograd cannot follow."""
    assert not any(gradients.is_added(c) for c in checks.get(exercise_id).make_cases())
