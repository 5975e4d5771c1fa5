"""Chapter 01's checks refuse the buggy code the exercises hand out, and accept independent right answers."""

import pytest
import torch

from attncourse.classroom import checks


def _buggy(query, keys, W_q, W_k, v):  # the exercise's code: each score is squashed after its read-out by v
    q = (query @ W_q.T).unsqueeze(1)
    k = keys @ W_k.T
    scores = torch.tanh((q + k) @ v)  # (B, T): every score in (-1, 1)
    weights = torch.softmax(scores, dim=-1)
    return (weights.unsqueeze(-1) * keys).sum(dim=1), weights


def _old_note_bug(query, keys, W_q, W_k, v):  # the earlier version's bug (a softmax over a trailing axis of size 1)
    q = (query @ W_q.T).unsqueeze(1)
    k = keys @ W_k.T
    scores = torch.tanh(q + k) @ v.unsqueeze(-1)  # (B, T, 1)
    weights = torch.softmax(scores, dim=-1)
    return (weights * keys).sum(dim=1), weights.squeeze(-1)


def _fixed(query, keys, W_q, W_k, v):
    scores = torch.einsum("a,bta->bt", v, torch.tanh((query @ W_q.T)[:, None] + keys @ W_k.T))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bt,btd->bd", weights, keys), weights


def test_the_bug_fails_and_the_fix_passes(capsys):
    with pytest.raises(checks.CheckFailed, match="01-find-the-bug"):
        checks.check("01-find-the-bug", _buggy)
    with pytest.raises(checks.CheckFailed, match="01-find-the-bug"):
        checks.check("01-find-the-bug", _old_note_bug)
    checks.check("01-find-the-bug", _fixed)
    assert "✓ 01-find-the-bug" in capsys.readouterr().out


def test_padding_mask_refuses_nan_rows():
    def nan_on_empty_rows(scores, lengths):
        mask = torch.arange(scores.shape[1]) < lengths[:, None]
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # NaN where lengths == 0

    with pytest.raises(checks.CheckFailed, match="length 0 gives a row of zeros"):
        checks.check("01-padding-mask", nan_on_empty_rows)


def test_query_influence_tells_the_variants_apart():
    from attncourse.classroom.checks.ch01 import VARIANTS, _weight_spread

    def tanh_everywhere(queries, keys, W_q, W_k, v):  # every variant scored like the first: the check must notice
        w = torch.softmax(torch.tanh((queries @ W_q.T)[:, None] + keys @ W_k.T) @ v, dim=-1)  # (N, T)
        return tuple(_weight_spread(w) for _ in VARIANTS)

    with pytest.raises(checks.CheckFailed, match="01-query-influence"):
        checks.check("01-query-influence", tanh_everywhere)
    expected = checks.get("01-query-influence").make_cases()[0].expected
    spread = dict(zip(VARIANTS, expected))
    assert spread["linear"] < 1e-12 and spread["separate"] < 1e-12  # a constant per query: the softmax ignores it
    assert min(spread["tanh"], spread["relu"], spread["product"]) > 1e-3


# ----------------------------------------------------------------------------- routes a learner could try (issue 23)

from test_exercise_standard import as_learner, grader_reply, judge  # noqa: E402
from exercise_routes import whole_prediction_messages  # noqa: E402


def _verdicts(exercise_id, answer, tmp_path, monkeypatch):
    """(check cell's message or None, grader's status and message) for `answer` typed in a notebook cell."""
    ex = checks.get(exercise_id)
    answer = _as_cell(answer)
    try:
        checks.check(exercise_id, answer)
        cell = None
    except checks.CheckFailed as err:
        cell = str(err)
    cases = ex.make_cases()
    return cell, judge(ex, cases, grader_reply(ex, answer, cases, tmp_path, monkeypatch))


_as_cell = as_learner  # the standard test's: code filed under a notebook cell's name


def refused(exercise_id, answer, tmp_path, monkeypatch, why="called"):
    cell, (status, message) = _verdicts(exercise_id, answer, tmp_path, monkeypatch)
    assert cell is not None and why in cell, cell
    assert status in ("failed", "error") and why in message, (status, message)


def accepted(exercise_id, answer, tmp_path, monkeypatch):
    cell, (status, message) = _verdicts(exercise_id, answer, tmp_path, monkeypatch)
    assert cell is None and status == "passed", (cell, status, message)


def _scores(query, keys, W_q, W_k, v):
    return torch.tanh((query @ W_q.T)[:, None] + keys @ W_k.T) @ v


def test_additive_score_routes(tmp_path, monkeypatch):
    from attncourse.rnn_attention import AdditiveAttention

    def lesson_loop(query, keys, W_q, W_k, v):  # the lesson's loop over positions, for each sequence
        return torch.stack([torch.stack([v @ torch.tanh(W_q @ query[b] + W_k @ keys[b, j])
                                         for j in range(keys.shape[1])]) for b in range(keys.shape[0])])

    def module_with_weights(query, keys, W_q, W_k, v):
        m = AdditiveAttention(W_q.shape[1], W_k.shape[1], W_q.shape[0]).double()
        with torch.no_grad():
            m.query_proj.weight.copy_(W_q)
            m.key_proj.weight.copy_(W_k)
            m.v.weight.copy_(v[None])
            return m.score(query, keys)

    refused("01-additive-score", lesson_loop, tmp_path, monkeypatch, why="not the way")
    refused("01-additive-score", module_with_weights, tmp_path, monkeypatch)
    accepted("01-additive-score", _scores, tmp_path, monkeypatch)


def test_find_the_bug_routes(tmp_path, monkeypatch):
    from attncourse import AdditiveAttention

    def module_with_weights(query, keys, W_q, W_k, v):  # the course's module, weights copied in: no bug found
        m = AdditiveAttention(W_q.shape[1], W_k.shape[1], W_q.shape[0]).double()
        with torch.no_grad():
            m.query_proj.weight.copy_(W_q)
            m.key_proj.weight.copy_(W_k)
            m.v.weight.copy_(v[None])
            return m(query, keys)

    def aten_kernel(query, keys, W_q, W_k, v):
        s = _scores(query, keys, W_q, W_k, v)
        b, t = s.shape
        ctx = torch.ops.aten.scaled_dot_product_attention(torch.zeros(b, 1, 1, dtype=s.dtype),
                                                          torch.zeros(b, t, 1, dtype=s.dtype), keys,
                                                          attn_mask=s[:, None])
        return ctx.squeeze(1), torch.softmax(s, -1)

    refused("01-find-the-bug", module_with_weights, tmp_path, monkeypatch)
    refused("01-find-the-bug", aten_kernel, tmp_path, monkeypatch)
    refused("01-find-the-bug", _buggy, tmp_path, monkeypatch, why="differ")

    def capped_then_scaled(query, keys, W_q, W_k, v):  # a guess: keep the bug, make the capped scores larger
        q = (query @ W_q.T).unsqueeze(1)
        weights = torch.softmax(10 * torch.tanh((q + keys @ W_k.T) @ v), dim=-1)
        return (weights.unsqueeze(-1) * keys).sum(dim=1), weights

    refused("01-find-the-bug", capped_then_scaled, tmp_path, monkeypatch, why="differ")
    accepted("01-find-the-bug", _fixed, tmp_path, monkeypatch)


def test_padding_mask_routes(tmp_path, monkeypatch):
    def real(scores, lengths):
        return torch.arange(scores.shape[1]) < lengths[:, None]

    def aten_safe(scores, lengths):
        return torch.ops.aten._safe_softmax(scores.masked_fill(~real(scores, lengths), float("-inf")), -1)

    def private_safe(scores, lengths):
        return torch._safe_softmax(scores.masked_fill(~real(scores, lengths), float("-inf")), -1)

    def masked(scores, lengths):
        return torch._masked_softmax(scores, ~real(scores, lengths), 1, 0).nan_to_num(0.0)

    def course(scores, lengths):
        from attncourse.sdpa import safe_softmax
        return safe_softmax(scores.masked_fill(~real(scores, lengths), float("-inf")))

    def sparse(scores, lengths):
        keep = real(scores, lengths)
        return torch.sparse.softmax(torch.sparse_coo_tensor(keep.nonzero().T, scores[keep], scores.shape), 1).to_dense()

    def mine(scores, lengths):
        w = torch.softmax(scores.masked_fill(~real(scores, lengths), float("-inf")), -1)
        return w.nan_to_num(0.0)

    for route in (aten_safe, private_safe, masked, course, sparse):
        refused("01-padding-mask", route, tmp_path, monkeypatch)
    accepted("01-padding-mask", mine, tmp_path, monkeypatch)


def test_query_influence_refuses_the_reference(tmp_path, monkeypatch):
    from attncourse.classroom.checks.ch01 import variant_influence_reference

    def reference(*args):
        return variant_influence_reference(*args)

    refused("01-query-influence", reference, tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- a prediction is judged whole


def test_predict_shapes_is_judged_whole(tmp_path, monkeypatch):
    said = whole_prediction_messages("01-predict-shapes", tmp_path, monkeypatch)
    assert "not right" in said and "hint:" in said
    with pytest.raises(checks.CheckFailed, match="tuple of four shapes"):  # the form is still explained
        checks.check("01-predict-shapes", ((8, 13, 64), (8, 13, 13)))


def test_padding_mask_fills(tmp_path, monkeypatch):
    """A fill that is only "very negative" next to scores near 0 is refused (one case has every real score near
    -5000); a fill far below every score followed by zeroing the empty rows decides the empty row and passes;
    a far fill that leaves an empty row uniform is refused."""
    def real(scores, lengths):
        return torch.arange(scores.shape[1]) < lengths[:, None]

    def fill(value, zero_empty_rows):
        def masked_softmax(scores, lengths):
            keep = real(scores, lengths)
            w = torch.softmax(scores.masked_fill(~keep, value), dim=-1)
            return w * keep if zero_empty_rows else w
        return masked_softmax

    for small in (-30.0, -1000.0):
        msg, _ = _verdicts("01-padding-mask", fill(small, True), tmp_path, monkeypatch)
        assert msg is not None and "near -5000" in msg and "times the right one" not in msg, msg
    msg, _ = _verdicts("01-padding-mask", fill(-1e30, False), tmp_path, monkeypatch)
    assert msg is not None and "length 0" in msg, msg  # uniform weights on the empty row
    accepted("01-padding-mask", fill(-1e30, True), tmp_path, monkeypatch)
