"""Chapter 08's checks refuse what a learner could hand in without the skill (issue 23): the review's routes and
others of the same kinds, by the check cell and by the grader; the right answers pass."""

from __future__ import annotations

import math
import re

import nbformat
import pytest
import torch

from attncourse import online_softmax_trace, softmax_state
from attncourse.classroom import checks
from attncourse.classroom.grading.remote import judge
from attncourse.classroom.nbtools import ROOT
from test_exercise_standard import as_learner, grader_reply
from exercise_routes import NOT_THE_WAY, accepted, failure  # noqa: E402,F401
from exercise_routes import refused as _refused  # noqa: E402


refused = _refused


# The breakers (right outputs computed the wrong way) are run by check and grader for every chapter in
# test_exercise_standard.test_properties_refuse_their_breakers; here the shortcuts of every category.
@pytest.mark.parametrize("ex", [e for e in checks.exercises_for("08") if e.shortcuts], ids=lambda e: e.id)
def test_shortcuts_refused_by_check_and_grader(ex, tmp_path, monkeypatch):
    for shortcut in ex.shortcuts:
        msg, graded = refused(ex.id, shortcut, tmp_path, monkeypatch)
        assert "called" in msg and "called" in graded, (shortcut.__name__, msg)


# ----------------------------------------------------------------------------- 1. merge many


def merge_many(m_all, l_all):
    m = m_all.amax(dim=0)
    shift = m.masked_fill(torch.isneginf(m), 0.0)
    return m, (torch.exp(m_all - shift) * l_all).sum(dim=0)


def test_merge_many(tmp_path, monkeypatch):
    accepted("08-merge-many", merge_many, tmp_path, monkeypatch)

    def special_logsumexp(m_all, l_all):  # another spelling of the forbidden reduction
        m = m_all.amax(0)
        ref = m.masked_fill(torch.isneginf(m), 0.0)
        return m, torch.exp(torch.special.logsumexp(m_all - ref + torch.log(l_all), dim=0))

    def aten_logsumexp(m_all, l_all):
        m = m_all.amax(0)
        ref = m.masked_fill(torch.isneginf(m), 0.0)
        return m, torch.exp(torch.ops.aten.logsumexp(m_all - ref + torch.log(l_all), [0]))

    def package_state(m_all, l_all):  # the package's softmax_state on log-weights
        return tuple(softmax_state((m_all + torch.log(l_all)).movedim(0, -1)))

    for route in (special_logsumexp, aten_logsumexp, package_state):
        assert "called" in refused("08-merge-many", route, tmp_path, monkeypatch)[0]


# ----------------------------------------------------------------------------- 2. one-pass log-softmax


def log_softmax_one_pass(chunks, chunk_size):  # each chunk written once; the row's shift applied once, at the end
    written, run_max, run_sum = [], None, None
    for part in chunks:
        if run_max is None:
            run_max = part.new_full(part.shape[:-1], -math.inf)
            run_sum = part.new_zeros(part.shape[:-1])
        written.append(part.clone())
        new_max = torch.maximum(run_max, part.amax(dim=-1))
        shift = new_max.masked_fill(torch.isneginf(new_max), 0.0)
        run_sum = run_sum * torch.exp(run_max - shift) + torch.exp(part - shift[..., None]).sum(dim=-1)
        run_max = new_max
    lse = torch.log(run_sum) + run_max.masked_fill(torch.isneginf(run_max), 0.0)
    out = torch.cat(written, dim=-1)
    return torch.where(torch.isneginf(lse)[..., None], torch.full_like(out, -math.inf), out - lse[..., None])


def rewrite_at_each_chunk(chunks, chunk_size):  # one pass, but all that is written is shifted again at every chunk
    out = run_max = run_sum = None
    for part in chunks:
        if out is None:
            out = part.new_empty(*part.shape[:-1], 0)
            run_max = part.new_full(part.shape[:-1], -math.inf)
            run_sum = part.new_zeros(part.shape[:-1])
        new_max = torch.maximum(run_max, part.amax(dim=-1))
        shift = new_max.masked_fill(torch.isneginf(new_max), 0.0)
        old = run_max.masked_fill(torch.isneginf(run_max), 0.0)
        out = torch.cat([out - (shift - old)[..., None], part - shift[..., None]], dim=-1)   # about N^2 / C moves
        run_sum = run_sum * torch.exp(run_max - shift) + torch.exp(part - shift[..., None]).sum(dim=-1)
        run_max = new_max
    log_sum = torch.log(run_sum)
    return torch.where(torch.isneginf(log_sum)[..., None], torch.full_like(out, -math.inf), out - log_sum[..., None])


def shift_in_place_when_max_grows(chunks, chunk_size):  # no new tensor, but every kept chunk shifted at each growth
    written, run_max, run_sum = [], None, None
    for part in chunks:
        if run_max is None:
            run_max = part.new_full(part.shape[:-1], -math.inf)
            run_sum = part.new_zeros(part.shape[:-1])
        new_max = torch.maximum(run_max, part.amax(dim=-1))
        shift = new_max.masked_fill(torch.isneginf(new_max), 0.0)
        grow = (shift - run_max.masked_fill(torch.isneginf(run_max), 0.0))[..., None]
        for w in written:
            w.sub_(grow)
        written.append(part - shift[..., None])
        run_sum = run_sum * torch.exp(run_max - shift) + torch.exp(part - shift[..., None]).sum(dim=-1)
        run_max = new_max
    out, log_sum = torch.cat(written, -1), torch.log(run_sum)[..., None]
    return torch.where(torch.isneginf(log_sum), torch.full_like(out, -math.inf), out - log_sum)


def three_pass_ignoring_chunks(x, chunk_size):  # the review's route, on the old signature: x is now a stream
    m = x.amax(-1, keepdim=True)
    ref = m.masked_fill(torch.isneginf(m), 0.0)
    return x - ref - torch.log(torch.exp(x - ref).sum(-1, keepdim=True))


def keeps_references(chunks, chunk_size):  # keeps the chunks without copying: they are NaN by the end
    kept = list(chunks)
    return three_pass_ignoring_chunks(torch.cat(kept, dim=-1), chunk_size)


def buffer_then_three_pass(chunks, chunk_size):
    x = torch.cat([c.clone() for c in chunks], dim=-1)
    m = x.amax(-1, keepdim=True)
    ref = m.masked_fill(torch.isneginf(m), 0.0)
    lse = torch.log(torch.exp(x - ref).sum(-1, keepdim=True)) + ref
    return torch.where(torch.isneginf(lse), torch.full_like(x, -math.inf), x - lse)


def buffer_then_sum_by_matmul(chunks, chunk_size):  # the row sums as a product with ones
    x = torch.cat([c.clone() for c in chunks], dim=-1)
    m = x.amax(-1, keepdim=True)
    ref = m.masked_fill(torch.isneginf(m), 0.0)
    lse = torch.log(torch.exp(x - ref) @ torch.ones(x.shape[-1], 1, dtype=x.dtype)) + ref
    return torch.where(torch.isneginf(lse), torch.full_like(x, -math.inf), x - lse)


def buffer_then_loop(chunks, chunk_size):  # keeps every chunk, then two passes over them, a chunk at a time
    kept = [c.clone() for c in chunks]
    m = kept[0].amax(-1)
    for c in kept[1:]:
        m = torch.maximum(m, c.amax(-1))
    ref = m.masked_fill(torch.isneginf(m), 0.0)
    total = sum(torch.exp(c - ref[..., None]).sum(-1) for c in kept)
    lse = (torch.log(total) + ref)[..., None]
    return torch.cat([torch.where(torch.isneginf(lse), torch.full_like(c, -math.inf), c - lse) for c in kept], -1)


def online_max_then_buffered_sum(chunks, chunk_size):  # the max online, but the sum in a second pass over a copy
    m, kept = None, []
    for c in chunks:
        kept.append(c.clone())
        m = c.amax(-1) if m is None else torch.maximum(m, c.amax(-1))
    ref = m.masked_fill(torch.isneginf(m), 0.0)
    x = torch.cat(kept, -1)
    lse = (torch.log(torch.exp(x - ref[..., None]).sum(-1)) + ref)[..., None]
    return torch.where(torch.isneginf(lse), torch.full_like(x, -math.inf), x - lse)


def buffer_behind_unit_axis(chunks, chunk_size):  # review 6: the whole row on axis -2, the last axis 1 wide
    x = torch.cat([c.clone() for c in chunks], dim=-1).unsqueeze(-1)
    m = x.amax(dim=-2, keepdim=True)
    ref = m.masked_fill(torch.isneginf(m), 0.0)
    lse = torch.log(torch.exp(x - ref).sum(dim=-2, keepdim=True)) + ref
    return torch.where(torch.isneginf(lse), torch.full_like(x, -math.inf), x - lse).squeeze(-1)


def buffer_row_by_row_unit_axis(chunks, chunk_size):  # the same, one row at a time (a row is (N, 1))
    x = torch.cat([c.clone() for c in chunks], dim=-1)
    rows = x.reshape(-1, x.shape[-1])
    outs = []
    for r in rows:
        col = r[:, None]
        m = col.amax(dim=0, keepdim=True)
        ref = m.masked_fill(torch.isneginf(m), 0.0)
        lse = torch.log(torch.exp(col - ref).sum(dim=0, keepdim=True)) + ref
        outs.append(torch.where(torch.isneginf(lse), torch.full_like(col, -math.inf), col - lse)[:, 0])
    return torch.stack(outs).reshape(x.shape)


def subtract_chunk_by_chunk(chunks, chunk_size):  # review 10: the same one pass, the lse subtracted per kept chunk
    kept, run_max, run_sum = [], None, None
    for part in chunks:
        if run_max is None:
            run_max = part.new_full(part.shape[:-1], -math.inf)
            run_sum = part.new_zeros(part.shape[:-1])
        kept.append(part.clone())
        new_max = torch.maximum(run_max, part.amax(dim=-1))
        shift = new_max.masked_fill(torch.isneginf(new_max), 0.0)
        run_sum = run_sum * torch.exp(run_max - shift) + torch.exp(part - shift[..., None]).sum(dim=-1)
        run_max = new_max
    lse = (torch.log(run_sum) + run_max.masked_fill(torch.isneginf(run_max), 0.0))[..., None]
    return torch.cat([torch.where(torch.isneginf(lse), torch.full_like(c, -math.inf), c - lse) for c in kept], -1)


def states_per_chunk_folded(chunks, chunk_size):  # a (max, sum) per chunk, merged after the stream by a fold
    kept, states = [], []
    for c in chunks:
        kept.append(c.clone())
        mc = c.amax(-1)
        shift = mc.masked_fill(torch.isneginf(mc), 0.0)
        states.append((mc, torch.exp(c - shift[..., None]).sum(-1)))
    m, l = states[0]
    for m_b, l_b in states[1:]:  # elementwise only: no reduction wider than a chunk
        new = torch.maximum(m, m_b)
        ref = new.masked_fill(torch.isneginf(new), 0.0)
        l = l * torch.exp(m - ref) + l_b * torch.exp(m_b - ref)
        m = new
    lse = (torch.log(l) + m.masked_fill(torch.isneginf(m), 0.0))[..., None]
    out = torch.cat(kept, -1)
    return torch.where(torch.isneginf(lse), torch.full_like(out, -math.inf), out - lse)


def test_one_pass_log_softmax_both_finalisations_pass(tmp_path, monkeypatch):
    """The check tests the fixed-size state kept between chunks, not how many operators apply the finished
    log-sum-exp: one subtraction per kept chunk passes as one over the concatenation does (review 10)."""
    x = torch.randn(3, 10, dtype=torch.float64)
    torch.testing.assert_close(subtract_chunk_by_chunk(iter(x.split(4, -1)), 4), torch.log_softmax(x, -1))
    accepted("08-one-pass-log-softmax", subtract_chunk_by_chunk, tmp_path, monkeypatch)


@pytest.mark.parametrize("route", [buffer_then_loop, states_per_chunk_folded])
def test_one_pass_log_softmax_second_pass_after_the_stream_refused(route, tmp_path, monkeypatch):
    """A second pass over what was kept (chunk-wide reductions, or a fold of per-chunk states) is refused for
    the statistics it computes after the stream."""
    x = torch.randn(3, 10, dtype=torch.float64)
    torch.testing.assert_close(route(iter([c.clone() for c in x.split(4, -1)]), 4), torch.log_softmax(x, -1))
    msg, graded = refused("08-one-pass-log-softmax", route, tmp_path, monkeypatch)
    assert "normaliser" in msg and "normaliser" in graded, msg


def test_one_pass_log_softmax_right_answer_and_the_stream(tmp_path, monkeypatch):
    accepted("08-one-pass-log-softmax", log_softmax_one_pass, tmp_path, monkeypatch)
    x = torch.randn(2, 11, dtype=torch.float64)
    torch.testing.assert_close(log_softmax_one_pass(iter(x.split(3, -1)), 3), torch.log_softmax(x, -1))


@pytest.mark.parametrize("route", [buffer_then_three_pass, buffer_then_sum_by_matmul, buffer_then_loop,
                                   online_max_then_buffered_sum, rewrite_at_each_chunk, shift_in_place_when_max_grows,
                                   buffer_behind_unit_axis, buffer_row_by_row_unit_axis])
def test_one_pass_log_softmax_buffering_refused(route, tmp_path, monkeypatch):
    x = torch.randn(3, 10, dtype=torch.float64)
    torch.testing.assert_close(route(iter([c.clone() for c in x.split(4, -1)]), 4), torch.log_softmax(x, -1))
    msg, graded = refused("08-one-pass-log-softmax", route, tmp_path, monkeypatch)
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded


def states_per_chunk_merged(chunks, chunk_size):  # review 8: one read per entry, a (max, sum) kept per chunk
    outs, ms, ls = [], [], []
    for c in chunks:
        mc = c.amax(-1)
        shift = torch.where(torch.isinf(mc), torch.zeros_like(mc), mc)
        outs.append(c.clone())
        ms.append(mc)
        ls.append(torch.exp(c - shift[..., None]).sum(-1))
    m_all, l_all = torch.stack(ms), torch.stack(ls)  # (K, ...): one state per chunk
    m = m_all.amax(0)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    lse = shift + torch.log((l_all * torch.exp(m_all - shift)).sum(0))
    out = torch.cat(outs, -1)
    return torch.where(torch.isneginf(lse)[..., None], torch.full_like(out, -math.inf), out - lse[..., None])


def test_one_pass_log_softmax_states_per_chunk_told_the_true_reason(tmp_path, monkeypatch):
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(states_per_chunk_merged(iter([c.clone() for c in x.split(2, -1)]), 2),
                               torch.log_softmax(x, -1))
    msg, graded = refused("08-one-pass-log-softmax", states_per_chunk_merged, tmp_path, monkeypatch)
    for text in (msg, graded):
        assert "a state per chunk" in text and "fixed size per row" in text and "another pass" not in text, text


@pytest.mark.parametrize("route", [three_pass_ignoring_chunks, keeps_references])
def test_one_pass_log_softmax_whole_input_routes_fail(route, tmp_path, monkeypatch):
    refused("08-one-pass-log-softmax", route, tmp_path, monkeypatch)  # a stream has no .amax; kept chunks are NaN


def test_one_pass_log_softmax_forbidden_spellings(tmp_path, monkeypatch):
    def via(fn):
        def answer(chunks, chunk_size):
            return fn(torch.cat([c.clone() for c in chunks], dim=-1))
        return answer

    for fn in (lambda x: torch.nn.LogSoftmax(dim=-1)(x), lambda x: torch.ops.aten._log_softmax(x, -1, False),
               lambda x: torch.distributions.Categorical(logits=x).logits, lambda x: x - x.logsumexp(-1, keepdim=True),
               lambda x: torch.special.log_softmax(x, -1)):
        assert "called" in refused("08-one-pass-log-softmax", via(fn), tmp_path, monkeypatch)[0]


# ----------------------------------------------------------------------------- 3. find the bug


def test_merge_bug_renamed_and_refuses_the_package(tmp_path, monkeypatch):
    accepted("08-find-the-bug-1", merge_fixed, tmp_path, monkeypatch)
    checks.check("08-merge-bug", merge_fixed)  # the earlier id still checks
    from attncourse.online_softmax import AttentionState, merge_attention_states

    def package(m_a, l_a, acc_a, m_b, l_b, acc_b):
        return tuple(merge_attention_states(AttentionState(m_a, l_a, acc_a), AttentionState(m_b, l_b, acc_b)))

    def lse_merge(m_a, l_a, acc_a, m_b, l_b, acc_b):  # via logaddexp of the two lse
        m = torch.maximum(m_a, m_b)
        shift = m.masked_fill(torch.isneginf(m), 0.0)
        l = torch.exp(torch.logaddexp(m_a - shift + torch.log(l_a), m_b - shift + torch.log(l_b)))
        w_a, w_b = torch.exp(m_a - shift), torch.exp(m_b - shift)
        return m, l, w_a[..., None] * acc_a + w_b[..., None] * acc_b

    for route in (package, lse_merge):
        assert "called" in refused("08-find-the-bug-1", route, tmp_path, monkeypatch)[0]


def test_bug_words_stay_out_of_the_exercise_notebook():
    nb = nbformat.read(ROOT / "exercises" / "08_online_softmax.ipynb", as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    ex = checks.get("08-find-the-bug-1")
    assert "08-merge-bug" in ex.aliases and "What was wrong" not in text
    for word in ex.bug_words:
        assert not re.search(rf"(?<![A-Za-z0-9]){re.escape(word)}", text, flags=re.IGNORECASE), word


# ----------------------------------------------------------------------------- 4. predict


def test_prediction_verify_cell_waits_for_a_pass():
    nb = nbformat.read(ROOT / "exercises" / "08_online_softmax.ipynb", as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "online_softmax_trace" in text
    for cell in nb.cells:
        if cell.cell_type == "code" and "online_softmax_trace" in cell.source:
            assert cell.source.startswith('if passed("08-predict-rescale")')


def pooled_two_pass(chunks, chunk_size):  # the cold review's route 08-b: kept chunks, max by a pool, sum by a conv
    import torch.nn.functional as F
    x = torch.cat([c.clone() for c in chunks], dim=-1)
    flat = x.reshape(-1, 1, x.shape[-1])
    m = F.adaptive_max_pool1d(flat, 1)  # (R, 1, 1) the row max
    ref = m.masked_fill(torch.isneginf(m), 0.0)
    total = F.conv1d(torch.exp(flat - ref), torch.ones(1, 1, x.shape[-1], dtype=x.dtype))  # (R, 1, 1) the row sum
    lse = (torch.log(total) + ref).reshape(*x.shape[:-1], 1)
    return torch.where(torch.isneginf(lse), torch.full_like(x, float("-inf")), x - lse)


def test_one_pass_refuses_reductions_under_other_names(tmp_path, monkeypatch):
    msg, graded = refused("08-one-pass-log-softmax", pooled_two_pass, tmp_path, monkeypatch)
    assert NOT_THE_WAY in msg and "reduces over" in msg


def predicted(row, chunk_size):
    m, l, out = -math.inf, 0.0, ([], [], [])
    for start in range(0, len(row), chunk_size):
        chunk = row[start:start + chunk_size]
        m_new = max(m, max(chunk))
        alpha = math.exp(m - m_new) if m > -math.inf else 0.0
        l, m = alpha * l + sum(math.exp(x - m_new) for x in chunk), m_new
        for values, v in zip(out, (m, alpha, l)):
            values.append(v)
    return out


def test_prediction_is_a_rule_the_package_cannot_answer(tmp_path, monkeypatch):
    from test_salting import SALT, _grader as salted_grader

    accepted("08-predict-rescale", predicted, tmp_path, monkeypatch)
    ex = checks.get("08-predict-rescale")
    assert salted_grader(ex, predicted, SALT, tmp_path, monkeypatch)[0] == "passed"
    assert any(c.args[1] > 1 for c in ex.make_cases())  # chunks of several entries are asked too

    def package(row, chunk_size):  # the cold review's route 08-c
        from attncourse import online_softmax_trace
        t = online_softmax_trace(torch.tensor(row, dtype=torch.float64), chunk_size=chunk_size)
        return t["running_max"].tolist(), t["rescale"].tolist(), t["running_sum"].tolist()

    def checker_reference(row, chunk_size):
        from attncourse.classroom.checks.ch08 import rescale_trace_reference
        return rescale_trace_reference(row, chunk_size)

    for route in (package, checker_reference):
        assert "called" in refused("08-predict-rescale", route, tmp_path, monkeypatch)[0]

    printed = predicted((2.0, 1.0, 4.0, 4.0, 3.0), 1)

    def typed(row, chunk_size):  # the printed row's trace, typed in
        return printed

    def last_entry_only(row, chunk_size):  # a chunk's max read off its last entry
        return predicted(tuple(row[min(i + chunk_size, len(row)) - 1] for i in range(0, len(row), chunk_size)), 1)

    for wrong in (typed, last_entry_only):
        msg = failure("08-predict-rescale", wrong)
        assert "prediction is not right" in msg and "0.1353" not in msg and "0.135" not in msg


# ----------------------------------------------------------------------------- 5. experiment


def _rescales(row, chunk_size, *, ties=False):
    chunk_max = [float(piece.max()) for piece in row.split(chunk_size)]
    best, rescales, rescaled = chunk_max[0], 0, 0
    for j, top in enumerate(chunk_max[1:], start=1):
        if top > best or (ties and top == best):
            rescales, rescaled, best = rescales + 1, rescaled + j * chunk_size, top
    return rescales, rescaled


def test_rescale_cost_reference_and_typed_numbers_refused(tmp_path, monkeypatch):
    from attncourse.classroom.checks.ch08 import rescale_cost

    accepted("08-rescale-cost", _rescales, tmp_path, monkeypatch)
    assert "called" in failure("08-rescale-cost", rescale_cost)
    assert "called" in failure("08-rescale-cost", lambda row, c: online_softmax_trace(torch.zeros(3), 1) and (0, 0))
    expected = checks.get("08-rescale-cost").make_cases()[0].expected
    failure("08-rescale-cost", lambda *a: expected)
    failure("08-rescale-cost", lambda row, c: (round(math.log(len(row) / c)), len(row)))  # the expected-value formula
    failure("08-rescale-cost", lambda row, c: _rescales(row, c, ties=True))  # a tie counted as a rescale
    # every chunk after a rescale counted from the row's start, not the elements written before it
    failure("08-rescale-cost", lambda row, c: (_rescales(row, c)[0], _rescales(row, c)[0] * c))


def test_rescale_cost_reference_transcribed_refused():
    """Review 11 passed a hand-edited transcription of the 10-line reference loop. The reference now reads the
    course's trace, so its transcription (names changed, method spellings) enters course code and is refused."""
    def transcribed(r, c):
        trace = online_softmax_trace(r.to(torch.float64), chunk_size=c)
        best = trace["running_max"]
        up = best[1:].gt(best[:-1])
        return up.sum().item(), (torch.arange(1, len(best)) * c)[up].sum().item()

    assert "called" in failure("08-rescale-cost", transcribed)


# ----------------------------------------------------------------------------- 3. find the bug: the split-KV merge


def merge_weights_acc_by_its_sum(m_a, l_a, acc_a, m_b, l_b, acc_b):  # the exercise's bug: acc treated as an output
    m = torch.maximum(m_a, m_b)
    ref = m.masked_fill(torch.isneginf(m), 0.0)
    w_a, w_b = l_a * torch.exp(m_a - ref), l_b * torch.exp(m_b - ref)
    return m, w_a + w_b, w_a[..., None] * acc_a + w_b[..., None] * acc_b


def merge_unguarded(m_a, l_a, acc_a, m_b, l_b, acc_b):  # right weights, but NaN on a row with no key
    m = torch.maximum(m_a, m_b)
    w_a, w_b = torch.exp(m_a - m), torch.exp(m_b - m)
    return m, w_a * l_a + w_b * l_b, w_a[..., None] * acc_a + w_b[..., None] * acc_b


def _edited_merge(old, new):
    """The given merge_partial_buggy with one edit, typed in a cell (the edit judge reads its source)."""
    from attncourse.classroom.checks.ch08_routes import BUGGY_MERGE
    from test_edits import cell_function

    assert old in BUGGY_MERGE
    return cell_function(BUGGY_MERGE.replace(old, new).replace("_buggy(", "_fixed("), "merge_partial_fixed",
                         {"torch": torch})


# the fix: the rescaling alone on acc, l times it on l (8 tokens)
merge_fixed = _edited_merge("w_a, w_b = l_a * torch.exp(m_a - ref), l_b * torch.exp(m_b - ref)       # (..., Tq) "
                            "each side's weight\n    return m, w_a + w_b,",
                            "w_a, w_b = torch.exp(m_a - ref), torch.exp(m_b - ref)\n    return m, w_a * l_a + w_b * l_b,")


def test_merge_bug_refused_and_fix_accepted(tmp_path, monkeypatch):
    accepted("08-find-the-bug-1", merge_fixed, tmp_path, monkeypatch)
    for route in (merge_weights_acc_by_its_sum, merge_unguarded):
        refused("08-find-the-bug-1", route, tmp_path, monkeypatch)
    from test_edits import cell_function

    rewrite = cell_function("def merge_partial_fixed(m_a, l_a, acc_a, m_b, l_b, acc_b):\n"
                            "    m = torch.maximum(m_a, m_b)\n"
                            "    shift = m.masked_fill(torch.isneginf(m), 0.0)\n"
                            "    w_a, w_b = torch.exp(m_a - shift), torch.exp(m_b - shift)\n"
                            "    return m, w_a * l_a + w_b * l_b, w_a[..., None] * acc_a + w_b[..., None] * acc_b\n",
                            "merge_partial_fixed", {"torch": torch})
    msg, graded = refused("08-find-the-bug-1", rewrite, tmp_path, monkeypatch)  # right values, written afresh
    assert "not the way" in msg and ("uses names" in msg or "differs from the given" in msg)


# ----------------------------------------------------------------------------- 5b. the study, graded


def _count(row, chunk_size):
    best, rescales, rescaled = float(row[:chunk_size].max()), 0, 0
    for start in range(chunk_size, row.shape[0], chunk_size):
        top = float(row[start:start + chunk_size].max())
        if top > best:
            rescales, rescaled, best = rescales + 1, rescaled + start, top
    return rescales, rescaled


def rescale_study(n, chunk_size, drifts, seeds):
    runs = torch.tensor([[_count(torch.randn(n, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                                 + d * torch.arange(n, dtype=torch.float64), chunk_size) for s in seeds]
                         for d in drifts])
    return runs, runs.double().mean(1)


def shared_generator(n, chunk_size, drifts, seeds):
    """One generator per seed, shared by the drifts: not the draw the exercise states."""
    gens = {s: torch.Generator().manual_seed(s) for s in seeds}
    runs = torch.tensor([[_count(torch.randn(n, generator=gens[s], dtype=torch.float64)
                                 + d * torch.arange(n, dtype=torch.float64), chunk_size) for s in seeds]
                         for d in drifts])
    return runs, runs.double().mean(1)


def test_rescale_study_judges_the_measurement(tmp_path, monkeypatch):
    from attncourse.classroom.checks.ch08 import rescale_study_reference

    accepted("08-rescale-study", rescale_study, tmp_path, monkeypatch)
    typed = rescale_study_reference(4096, 64, (0.0, 0.01), (0, 1, 2))  # one design's numbers, typed in
    msg, _ = refused("08-rescale-study", lambda n, c, d, s: typed, tmp_path, monkeypatch)
    assert "shape" in msg and "called" not in msg
    msg, _ = refused("08-rescale-study", shared_generator, tmp_path, monkeypatch)
    assert "draw each row exactly" in msg, msg
