"""Chapter 01's checks refuse the buggy code the exercises hand out, and accept independent right answers."""

import pytest
import torch

from attncourse.classroom import checks
from attncourse.classroom.checks.ch01 import BUGGY_ADDITIVE, _breaker_row_loop
from test_edits import cell_function


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


def _from_scratch(query, keys, W_q, W_k, v):  # right values, written from the formula: not a diagnosis
    scores = torch.einsum("a,bta->bt", v, torch.tanh((query @ W_q.T)[:, None] + keys @ W_k.T))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bt,btd->bd", weights, keys), weights


# the given function with its one line fixed, typed in a cell (the check reads its source)
_fixed = cell_function(BUGGY_ADDITIVE.replace("torch.tanh((q + k) @ v)", "torch.tanh(q + k) @ v")
                       .replace("_buggy(", "_fixed("), "additive_attention_fixed", {"torch": torch})


def test_the_bug_fails_and_the_fix_passes(capsys):
    with pytest.raises(checks.CheckFailed, match="01-find-the-bug"):
        checks.check("01-find-the-bug", _buggy)
    with pytest.raises(checks.CheckFailed, match="01-find-the-bug"):
        checks.check("01-find-the-bug", _old_note_bug)
    with pytest.raises(checks.CheckFailed, match="not the way"):
        checks.check("01-find-the-bug", _from_scratch)
    checks.check("01-find-the-bug", _fixed)
    assert "✓ 01-find-the-bug" in capsys.readouterr().out


def test_padding_mask_refuses_nan_rows():
    def nan_on_empty_rows(scores, lengths):
        mask = torch.arange(scores.shape[1]) < lengths[:, None]
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # NaN where lengths == 0

    with pytest.raises(checks.CheckFailed, match="length 0 gives a row of zeros"):
        checks.check("01-padding-mask", nan_on_empty_rows)


def test_query_influence_tells_the_variants_apart():
    from attncourse.classroom.checks.ch01_influence import VARIANTS, _weight_spread

    def tanh_everywhere(queries, keys, W_q, W_k, v):  # every variant scored like the first: the check must notice
        w = torch.softmax(torch.tanh((queries @ W_q.T)[:, None] + keys @ W_k.T) @ v, dim=-1)  # (N, T)
        return tuple(w for _ in VARIANTS)

    with pytest.raises(checks.CheckFailed, match="01-query-influence"):
        checks.check("01-query-influence", tanh_everywhere)
    expected = checks.get("01-query-influence").make_cases()[0].expected
    spread = {name: _weight_spread(w) for name, w in zip(VARIANTS, expected)}
    assert spread["linear"] < 1e-12 and spread["separate"] < 1e-12  # a constant per query: the softmax ignores it
    assert min(spread["tanh"], spread["relu"], spread["product"]) > 1e-3


# ----------------------------------------------------------------------------- routes a learner could try (issue 23)

from test_exercise_standard import as_learner, grader_reply, judge  # noqa: E402


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
    def lesson_formula_vmapped(query, keys, W_q, W_k, v):  # the review's route: the lesson's cell inside vmap
        return torch.vmap(torch.vmap(lambda s, h: v @ torch.tanh(W_q @ s + W_k @ h), in_dims=(None, 0)),
                          in_dims=(0, 0))(query, keys)

    def func_vmap(query, keys, W_q, W_k, v):  # the same under torch.func's name
        from torch.func import vmap
        return vmap(lambda s, h: torch.tanh(W_q @ s + h @ W_k.T) @ v)(query, keys)

    refused("01-additive-score", module_with_weights, tmp_path, monkeypatch)
    refused("01-additive-score", lesson_formula_vmapped, tmp_path, monkeypatch)
    refused("01-additive-score", func_vmap, tmp_path, monkeypatch)
    accepted("01-additive-score", _scores, tmp_path, monkeypatch)


def _moves_rule(alpha=1.0, beta=1.0):  # the split argument, and a scale of 0 on either side leaves no interaction
    both = alpha != 0 and beta != 0
    return {"tanh": both, "linear": False, "relu": both, "separate": False, "product": both}


def test_query_influence_prediction_is_judged_whole(tmp_path, monkeypatch):
    accepted("01-query-influence-predict", _moves_rule, tmp_path, monkeypatch)
    right = _moves_rule()
    for flip in right:  # one part wrong: told only that the prediction is wrong
        cell, (status, message) = _verdicts("01-query-influence-predict",
                                            lambda a, b, flip=flip: {**_moves_rule(a, b), flip: not right[flip]},
                                            tmp_path, monkeypatch)
        assert cell is not None and "not right" in cell and status == "failed" and flip not in cell.split("hint")[0]
    cell, _ = _verdicts("01-query-influence-predict", lambda a, b: {**right, "tanh": 1}, tmp_path, monkeypatch)
    assert "True or False" in cell  # the form is explained

    def measured(alpha, beta):  # computing the answer inside the prediction: refused
        w = torch.softmax(torch.randn(3, 4), -1)
        return {name: bool(w.std() > 0) for name in right}

    refused("01-query-influence-predict", measured, tmp_path, monkeypatch)


def test_query_influence_prediction_is_not_handed_out(tmp_path, monkeypatch):
    """Cold review 13: the answer was a zero-argument reference in the check module, callable from another cell.
    The answer is now a rule of two scales the grader draws: a table of the check cell's own cases (what a notebook
    can build from the registry), falling back on the alpha = beta = 1 answer, passes that cell and fails the grader;
    the measurement is refused inside the answer."""
    from attncourse.classroom.checks.ch01_influence import _moves
    from test_salting import SALT, _grader

    ex = checks.get("01-query-influence-predict")
    table = {c.args: c.expected for c in ex.make_cases()}  # top-level code, unguarded
    looked_up = _as_cell(lambda alpha, beta: dict(table.get((alpha, beta), table[(1.0, 1.0)])))
    checks.check(ex.id, looked_up)  # the check cell is fooled: it uses the fixed seeds
    assert _grader(ex, looked_up, SALT, tmp_path, monkeypatch)[0] == "failed"
    assert _grader(ex, _as_cell(_moves_rule), SALT, tmp_path, monkeypatch)[0] == "passed"
    refused("01-query-influence-predict", lambda a, b: _moves(a, b), tmp_path, monkeypatch)


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
    refused("01-find-the-bug", _from_scratch, tmp_path, monkeypatch, why="not the way")
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

    def masked_api(scores, lengths):  # PyTorch's public masked softmax: Python in torch/masked, then F.softmax
        return torch.masked.softmax(scores, -1, mask=real(scores, lengths)).nan_to_num(0.0)

    def masked_api_log(scores, lengths):
        return torch.masked.log_softmax(scores, 1, mask=real(scores, lengths)).exp().nan_to_num(0.0)

    for route in (aten_safe, private_safe, masked, course, sparse, masked_api, masked_api_log):
        refused("01-padding-mask", route, tmp_path, monkeypatch)
    accepted("01-padding-mask", mine, tmp_path, monkeypatch)


def test_query_influence_refuses_the_reference(tmp_path, monkeypatch):
    from attncourse.classroom.checks.ch01_influence import variant_weights_reference

    def reference(*args):
        return variant_weights_reference(*args)

    refused("01-query-influence", reference, tmp_path, monkeypatch)


def test_query_influence_refuses_typed_zero_influence(tmp_path, monkeypatch):
    """The answer is five weight tables, not five spreads: the two variants whose spread is 0 by a theorem cannot be
    typed in (a uniform table, the 0 the lesson states, fails), and the right tables pass."""
    def scores(queries, keys, W_q, W_k, v):
        q, k = queries @ W_q.T, keys @ W_k.T
        pair = q[:, None] + k
        return (torch.tanh(pair) @ v, pair @ v, pair.clamp(min=0) @ v,
                (torch.tanh(q) @ v)[:, None] + torch.tanh(k) @ v, (q[:, None] * k) @ v)

    def right(*args):
        return tuple(torch.softmax(e, -1) for e in scores(*args))

    def typed(*args):  # tanh, relu and product computed; linear and separate "ignore the query": typed as uniform
        w = [torch.softmax(e, -1) for e in scores(*args)]
        w[1] = w[3] = torch.full_like(w[0], 1 / w[0].shape[1])
        return tuple(w)

    accepted("01-query-influence", right, tmp_path, monkeypatch)
    cell, (status, _) = _verdicts("01-query-influence", typed, tmp_path, monkeypatch)
    assert cell is not None and status == "failed", (cell, status)


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
    msg, _ = _verdicts("01-padding-mask", fill(-1e9, True), tmp_path, monkeypatch)  # chapter 03's silent bug
    assert msg is not None and "near -3e9" in msg, msg
    msg, _ = _verdicts("01-padding-mask", fill(-1e30, False), tmp_path, monkeypatch)
    assert msg is not None and "length 0" in msg, msg  # uniform weights on the empty row
    accepted("01-padding-mask", fill(-1e30, True), tmp_path, monkeypatch)


def test_padding_mask_refuses_softmax_then_renormalise(tmp_path, monkeypatch):
    """The review's route: a softmax over the whole row, then zeroing the padding and renormalising, is right only
    while the padding's scores are not far above the real ones; the case with padding 1000 above refuses it."""
    def renormalised(scores, lengths):
        w = torch.softmax(scores, -1) * (torch.arange(scores.shape[1]) < lengths[:, None])
        return w / w.sum(-1, keepdim=True).clamp_min(1e-300)

    msg, _ = _verdicts("01-padding-mask", renormalised, tmp_path, monkeypatch)
    assert msg is not None and "1000 above" in msg, msg


def test_padding_mask_refuses_renormalise_in_float32(tmp_path, monkeypatch):
    """The same route taken only on float32 scores (a right masked softmax otherwise) meets the float32 case, where
    the padding is 200 above the real ones: exp underflows there long before it does in float64."""
    def renormalised_in_float32(scores, lengths):
        keep = torch.arange(scores.shape[1]) < lengths[:, None]
        if scores.dtype == torch.float32:
            w = torch.softmax(scores, -1) * keep
            return w / w.sum(-1, keepdim=True).clamp_min(1e-30)
        return torch.softmax(scores.masked_fill(~keep, float("-inf")), -1).nan_to_num(0.0)

    msg, _ = _verdicts("01-padding-mask", renormalised_in_float32, tmp_path, monkeypatch)
    assert msg is not None and "float32" in msg and "200 above" in msg, msg


def test_padding_mask_accepts_the_logsumexp_spellings(tmp_path, monkeypatch):
    """The review's route: a right masked softmax written as exp(s - logsumexp(s)) rounds the logsumexp of scores near
    -3e9 (float64 spacing 4.8e-7 there); it and exp(log_softmax) pass, check cell and grader alike."""
    def real(scores, lengths):
        return torch.arange(scores.shape[1]) < lengths[:, None]

    def via_logsumexp(scores, lengths):
        s = scores.masked_fill(~real(scores, lengths), float("-inf"))
        return torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True)).nan_to_num(0.0)

    def via_log_softmax(scores, lengths):
        return torch.log_softmax(scores.masked_fill(~real(scores, lengths), float("-inf")), -1).exp().nan_to_num(0.0)

    accepted("01-padding-mask", via_logsumexp, tmp_path, monkeypatch)
    accepted("01-padding-mask", via_log_softmax, tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- predictions written as rules


def rule_prediction_routes(exercise_id, right, tmp_path, monkeypatch, measured=(), wrong=()):
    """A prediction written as a function of the configuration: the right rule passes the check cell, the grader
    and a salted grader's draw; a hard-coded answer for the printed configuration and a table of the check cell's
    configurations fail (the second only under the salted draw); every measurement in `measured` is refused as a
    call; every rule in `wrong` fails; and an answer with one part wrong always gets the same words."""
    import exercise_routes
    from test_salting import SALT, _grader as salted_grader

    ex = checks.get(exercise_id)
    assert ex.kind == "function" and ex.category == "predict" and "torch" in ex.forbidden_ops
    cases = ex.make_cases()
    assert len(cases) >= 3, "the exercise's configuration and at least two drawn ones"
    exercise_routes.accepted(exercise_id, right, tmp_path, monkeypatch)
    assert salted_grader(ex, right, SALT, tmp_path, monkeypatch)[0] == "passed"

    printed = cases[0].expected
    msg, _ = exercise_routes.refused(exercise_id, lambda *args: printed, tmp_path, monkeypatch)
    assert "not right" in msg, msg
    table = {tuple(map(repr, c.args)): c.expected for c in cases}
    looked_up = lambda *args: table[tuple(map(repr, args))]  # noqa: E731
    checks.check(exercise_id, looked_up)  # the check cell's fixed draws are fooled ...
    assert salted_grader(ex, looked_up, SALT, tmp_path, monkeypatch)[0] in ("failed", "error")  # ... the grader's not
    for route in measured:
        msg, graded = exercise_routes.refused(exercise_id, route, tmp_path, monkeypatch)
        assert "called" in msg and "called" in graded, (msg, graded)
    for rule in wrong:
        assert "not right" in exercise_routes.failure(exercise_id, rule)

    said = set()
    for i in range(len(printed)):  # one part wrong on the exercise's configuration, the rule right elsewhere
        bad = exercise_routes.one_part_wrong(printed, i)
        first = tuple(map(repr, cases[0].args))
        answer = lambda *args, bad=bad: bad if tuple(map(repr, args)) == first else right(*args)  # noqa: E731
        said.add(exercise_routes.failure(exercise_id, answer))
    assert len(said) == 1, said  # nothing tells which part differs: guessing part by part learns nothing
    message = said.pop()
    assert "not right" in message and all(f"wrong: {name}" not in message for name in (ex.parts or list(printed)))


def _shapes_rule(batch, source_len, target_len, embed_size, encoder_size, decoder_size, attention_size, directions):
    annotations = (batch, source_len, directions * encoder_size)  # each direction's state, side by side
    return (annotations, (batch, target_len, source_len), (batch, target_len, directions * encoder_size),
            (batch, target_len, decoder_size + directions * encoder_size))


def _shapes_by_model(batch, source_len, target_len, embed_size, encoder_size, decoder_size, attention_size,
                     directions):
    """The review's route: the gated verify cell's measurement, run inside the answer."""
    from attncourse.seq2seq import Seq2SeqConfig, build_model
    model = build_model("additive", Seq2SeqConfig(embed_size=embed_size, encoder_size=encoder_size,
                                                  decoder_size=decoder_size, attention_size=attention_size))
    src = torch.randint(2, 12, (batch, source_len))
    with torch.no_grad():
        annotations, state = model.encode(src, torch.full((batch,), source_len))
        states, _ = model.decoder(model.embed(torch.randint(2, 12, (batch, target_len))), state[None])
        context, weights = model.attention(states, annotations)
    return tuple(tuple(x.shape) for x in (annotations, weights, context, torch.cat([states, context], -1)))


def _shapes_by_checker(*args):
    from attncourse.classroom.checks.ch01 import measured_shapes
    return measured_shapes(*args)


def _shapes_by_torch_gru(batch, source_len, target_len, embed_size, encoder_size, decoder_size, attention_size,
                         directions):
    """PyTorch's GRU alone (no course code): still a measurement, refused as a tensor operation."""
    gru = torch.nn.GRU(embed_size, encoder_size, batch_first=True, bidirectional=directions == 2)
    width = gru(torch.zeros(batch, source_len, embed_size))[0].shape[-1]
    return _shapes_rule(batch, source_len, target_len, embed_size, width // directions, decoder_size, attention_size,
                        directions)


def _shapes_read_off_the_lesson(batch, source_len, target_len, embed_size, encoder_size, decoder_size,
                                attention_size, directions):
    """The rule a learner reads off measurements of the lesson's model (always bidirectional): right on every
    configuration the lesson's model can be built for, wrong on an encoder that reads one way."""
    return _shapes_rule(batch, source_len, target_len, embed_size, encoder_size, decoder_size, attention_size, 2)


def _shapes_one_direction(batch, source_len, target_len, embed_size, encoder_size, decoder_size, attention_size,
                          directions):
    return _shapes_rule(batch, source_len, target_len, embed_size, encoder_size, decoder_size, attention_size, 1)


def _shapes_weights_transposed(batch, source_len, target_len, embed_size, encoder_size, decoder_size,
                               attention_size, directions):  # right whenever the two lengths are equal, as in the lesson
    a, w, c, o = _shapes_rule(batch, source_len, target_len, embed_size, encoder_size, decoder_size, attention_size,
                              directions)
    return a, (batch, source_len, target_len), c, o


def test_predict_shapes_is_a_rule(tmp_path, monkeypatch):
    rule_prediction_routes("01-predict-shapes", _shapes_rule, tmp_path, monkeypatch,
                           measured=(_shapes_by_model, _shapes_by_checker, _shapes_by_torch_gru),
                           wrong=(_shapes_one_direction, _shapes_weights_transposed, _shapes_read_off_the_lesson))
    with pytest.raises(checks.CheckFailed, match="tuple of four shapes"):  # the form is still explained
        checks.check("01-predict-shapes", lambda *args: ((8, 13, 64), (8, 13, 13)))


def test_padding_mask_is_one_batched_softmax(tmp_path, monkeypatch):
    """Review 12's routes: one softmax per row over its real scores (no mask at all) and a nested (ragged) tensor's
    softmax gave the right weights and passed. The check now asks for one masked softmax over the whole batch."""
    row_loop = _breaker_row_loop  # the check's own breaker for this route (one softmax per row, no mask)

    def nested(scores, lengths):
        rows = [scores[b, :int(lengths[b])] for b in range(scores.shape[0])]
        return torch.nested.to_padded_tensor(torch.softmax(torch.nested.nested_tensor(rows), -1), 0.0, scores.shape)

    def by_hand(scores, lengths):  # the skill written out: mask, shift by the row max, exponentiate, normalise
        keep = torch.arange(scores.shape[1]) < lengths[:, None]
        x = scores.masked_fill(~keep, float("-inf"))
        top = x.amax(-1, keepdim=True)
        e = torch.exp(x - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
        total = e.sum(-1, keepdim=True)
        return torch.where(total > 0, e / total.clamp_min(1e-300), torch.zeros_like(e))

    refused("01-padding-mask", row_loop, tmp_path, monkeypatch, why="Python loop")
    refused("01-padding-mask", nested, tmp_path, monkeypatch)
    accepted("01-padding-mask", by_hand, tmp_path, monkeypatch)
