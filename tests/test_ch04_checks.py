"""Chapter 04's checks can fail: the routes a learner could take to the points without the skill (fused kernels
under their ATen names, the course's module with copied weights, the checks' own references, a prediction read off
the feedback) are refused by the check cell and by the grader, and right answers pass."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attncourse import MultiHeadAttention, TransformerBlock
from attncourse.classroom import checks
from attncourse.classroom.checks import ch04
from test_edits import cell_function
from test_exercise_standard import grader_reply, judge
from test_salting import SALT, _grader as salted_grader


def refused(exercise_id, answer, tmp_path, monkeypatch, called=True) -> str:
    """The check cell and the grader both refuse `answer` (as a forbidden call when `called`)."""
    with pytest.raises(checks.CheckFailed) as info:
        checks.check(exercise_id, answer)
    msg = str(info.value)
    assert ("called" in msg) == called, msg
    ex = checks.get(exercise_id)
    cases = ex.make_cases()
    status, message = judge(ex, cases, grader_reply(ex, answer, cases, tmp_path, monkeypatch))
    assert status == "failed", (status, message)
    assert ("called" in message) == called, message
    return msg


def graded(exercise_id, answer, tmp_path, monkeypatch) -> str:
    ex = checks.get(exercise_id)
    cases = ex.make_cases()
    return judge(ex, cases, grader_reply(ex, answer, cases, tmp_path, monkeypatch))[0]


# ----------------------------------------------------------------------------- 1. per-head weights


def mha_per_head(x, context, w_q, w_k, w_v, w_o):
    q = torch.einsum("btm,hmj->bhtj", x, w_q)
    k, v = (torch.einsum("bsm,hmj->bhsj", context, w) for w in (w_k, w_v))
    w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return torch.einsum("bhtj,hjm->btm", w @ v, w_o)


def _qkv(x, context, w_q, w_k, w_v):
    return (torch.einsum("btm,hmj->bhtj", x, w_q), *(torch.einsum("bsm,hmj->bhsj", context, w) for w in (w_k, w_v)))


def per_head_aten_flash(x, context, w_q, w_k, w_v, w_o):
    heads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*_qkv(x, context, w_q, w_k, w_v))[0]
    return torch.einsum("bhtj,hjm->btm", heads, w_o)


def per_head_aten_math(x, context, w_q, w_k, w_v, w_o):
    heads = torch.ops.aten._scaled_dot_product_attention_math(*_qkv(x, context, w_q, w_k, w_v))[0]
    return torch.einsum("bhtj,hjm->btm", heads, w_o)


def per_head_aten_public(x, context, w_q, w_k, w_v, w_o):
    heads = torch.ops.aten.scaled_dot_product_attention(*_qkv(x, context, w_q, w_k, w_v))
    return torch.einsum("bhtj,hjm->btm", heads, w_o)


def per_head_course_module(x, context, w_q, w_k, w_v, w_o):
    return ch04.reference_mha(x, context, *ch04.per_head_to_linear(w_q, w_k, w_v, w_o), w_q.shape[0])


def per_head_course_class(x, context, w_q, w_k, w_v, w_o):
    h, d, dh = w_q.shape
    m = MultiHeadAttention(d, h, bias=False).to(x.dtype)
    with torch.no_grad():
        for proj, w in zip((m.q_proj, m.k_proj, m.v_proj),
                           (w_q, w_k, w_v)):
            proj.weight.copy_(w.transpose(1, 2).reshape(h * dh, d))
        m.o_proj.weight.copy_(w_o.reshape(h * dh, d).T)
        return m(x, context)


def test_mha_per_head(tmp_path, monkeypatch):
    checks.check("04-mha-per-head", mha_per_head)
    assert graded("04-mha-per-head", mha_per_head, tmp_path, monkeypatch) == "passed"
    for route in (per_head_aten_flash, per_head_aten_math, per_head_aten_public, per_head_course_module,
                  per_head_course_class, ch04._per_head_by_module):
        refused("04-mha-per-head", route, tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- 2. find the bug


def mha_rewrite(x, w_q, w_k, w_v, w_o, n_heads):  # right values, written afresh: no diagnosis of the given code
    q, k, v = ((x @ w.T).unflatten(-1, (n_heads, -1)).transpose(1, 2) for w in (w_q, w_k, w_v))
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return (weights @ v).transpose(1, 2).flatten(2) @ w_o.T


def mha_lesson_pasted(x, w_q, w_k, w_v, w_o, n_heads):  # lesson 04's split/attend/merge cell, pasted and adapted
    B, T, d = x.shape                                       # (cold review 10: it passed before the small-edit rule)
    H, D = n_heads, d // n_heads
    q = (x @ w_q.T).view(B, T, H, D).transpose(1, 2)
    k = (x @ w_k.T).view(B, T, H, D).transpose(1, 2)
    v = (x @ w_v.T).view(B, T, H, D).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    heads = torch.softmax(scores, dim=-1) @ v
    merged = heads.transpose(1, 2).reshape(B, T, d)
    return merged @ w_o.T


def mha_buggy(x, w_q, w_k, w_v, w_o, n_heads):  # the exercise's colleague: heads in the batch axis, merged by a reshape
    B, T, d = x.shape
    D = d // n_heads
    q, k, v = ((x @ w.T).transpose(0, 1).reshape(T, B * n_heads, D).transpose(0, 1) for w in (w_q, w_k, w_v))
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D), dim=-1)
    return (weights @ v).reshape(B, T, d) @ w_o.T


def mha_scaled_by_d(x, w_q, w_k, w_v, w_o, n_heads):  # the earlier colleague: scores scaled by the model width
    q, k, v = ((x @ w.T).unflatten(-1, (n_heads, -1)).transpose(1, 2) for w in (w_q, w_k, w_v))
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1]), dim=-1)
    return (weights @ v).transpose(1, 2).flatten(2) @ w_o.T


# the lesson's merge pasted onto the colleague's (B*H, T, D) heads: a fix by pattern, not by diagnosis: wrong values
mha_lesson_merge = cell_function(ch04.BUGGY_MHA.replace("(weights @ v).reshape", "(weights @ v).transpose(1, 2).reshape")
                                 .replace("def mha_buggy(", "def mha_lesson_merge("), "mha_lesson_merge",
                                 {"torch": torch, "math": math})
# the lesson's split and merge both pasted in: right values, but line 4 (the split) was not wrong
mha_lesson_both = cell_function(ch04.BUGGY_MHA.replace(".transpose(0, 1).reshape(T, B * n_heads, D).transpose(0, 1)",
                                                       ".view(B, T, n_heads, D).transpose(1, 2)")
                                .replace("(weights @ v).reshape", "(weights @ v).transpose(1, 2).reshape")
                                .replace("def mha_buggy(", "def mha_lesson_both("), "mha_lesson_both",
                                {"torch": torch, "math": math})


def fixed_by_course_module(x, w_q, w_k, w_v, w_o, n_heads):
    m = MultiHeadAttention(x.shape[-1], n_heads).to(x.dtype)
    with torch.no_grad():
        for proj, w in zip((m.q_proj, m.k_proj, m.v_proj, m.o_proj), (w_q, w_k, w_v, w_o)):
            proj.weight.copy_(w)
            proj.bias.zero_() if proj.bias is not None else None
        return m(x)


def fixed_by_aten_math(x, w_q, w_k, w_v, w_o, n_heads):
    q, k, v = ((x @ w.T).unflatten(-1, (n_heads, -1)).transpose(1, 2) for w in (w_q, w_k, w_v))
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v)[0].transpose(1, 2).flatten(2) @ w_o.T


def fixed_by_torch_module(x, w_q, w_k, w_v, w_o, n_heads):
    m = nn.MultiheadAttention(x.shape[-1], n_heads, bias=False, batch_first=True).to(x.dtype)
    with torch.no_grad():
        m.in_proj_weight.copy_(torch.cat([w_q, w_k, w_v]))
        m.out_proj.weight.copy_(w_o)
        return m(x, x, x, need_weights=False)[0]


# the minimal fix: the merge undoes the split's steps in reverse, 16 tokens changed on line 7
mha_fixed = cell_function(ch04.BUGGY_MHA.replace("(weights @ v).reshape(B, T, d)",
                                                 "(weights @ v).transpose(0, 1).reshape(T, B, d).transpose(0, 1)")
                          .replace("def mha_buggy(", "def mha_fixed("), "mha_fixed", {"torch": torch, "math": math})


def test_find_the_bug_1(tmp_path, monkeypatch):
    checks.check("04-find-the-bug-1", mha_fixed)
    checks.check("04-head-scale-bug", mha_fixed)  # the earlier id still grades
    assert checks.get("04-head-scale-bug").id == "04-find-the-bug-1"
    assert graded("04-find-the-bug-1", mha_fixed, tmp_path, monkeypatch) == "passed"
    for wrong in (mha_buggy, mha_scaled_by_d, mha_lesson_merge):
        refused("04-find-the-bug-1", wrong, tmp_path, monkeypatch, called=False)
    for rewrite in (mha_rewrite, mha_lesson_pasted, mha_lesson_both):
        assert "not the way" in refused("04-find-the-bug-1", rewrite, tmp_path, monkeypatch, called=False)
    for route in (fixed_by_course_module, fixed_by_aten_math, fixed_by_torch_module, ch04._fixed_by_module):
        refused("04-find-the-bug-1", route, tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- 3. predict


def rows_that_survive(perm):
    return tuple(set(perm[:i + 1]) == set(range(perm[i] + 1)) for i in range(len(perm)))


def rows_fixed_points(perm):  # "a row survives where the token did not move": too generous
    return tuple(p == i for i, p in enumerate(perm))


def rows_same_prefix(perm):  # "where the prefix is the same set": forgets that the query changes too
    return tuple(set(perm[:i + 1]) == set(range(i + 1)) for i in range(len(perm)))


def rows_measured(perm):  # the measurement, not a prediction: runs the module
    m = MultiHeadAttention(8, 2).double()
    x = torch.randn(1, len(perm), 8, dtype=torch.float64)
    with torch.no_grad():
        y, out = m(x[:, perm], is_causal=True), m(x, is_causal=True)
    return tuple(bool(torch.allclose(y[0, i], out[0, perm[i]])) for i in range(len(perm)))


def rows_measured_by_torch_module(perm):  # PyTorch's own module
    m = nn.MultiheadAttention(8, 2, batch_first=True).double()
    x = torch.randn(1, len(perm), 8, dtype=torch.float64)
    mask = torch.ones(len(perm), len(perm), dtype=torch.bool).triu(1)
    with torch.no_grad():
        y, out = m(x[:, perm], x[:, perm], x[:, perm], attn_mask=mask)[0], m(x, x, x, attn_mask=mask)[0]
    return tuple(bool(torch.allclose(y[0, i], out[0, perm[i]])) for i in range(len(perm)))


def rows_measured_by_hand(perm):  # a measurement with plain tensor operations, no module
    x = torch.randn(len(perm), 4, dtype=torch.float64)
    def attend(z):
        s = (z @ z.T).masked_fill(torch.ones(len(z), len(z), dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s, -1) @ z
    y, out = attend(x[perm]), attend(x)
    return tuple(bool(torch.allclose(y[i], out[perm[i]])) for i in range(len(perm)))


def test_predict_permutation_rule(tmp_path, monkeypatch):
    checks.check("04-predict-causal-permutation", rows_that_survive)
    assert graded("04-predict-causal-permutation", rows_that_survive, tmp_path, monkeypatch) == "passed"
    for wrong in (rows_fixed_points, rows_same_prefix, lambda perm: (False,) * len(perm)):
        refused("04-predict-causal-permutation", wrong, tmp_path, monkeypatch, called=False)
    for measured in (rows_measured, rows_measured_by_hand, rows_measured_by_torch_module):
        refused("04-predict-causal-permutation", measured, tmp_path, monkeypatch)


def test_predict_permutation_table_is_refused(tmp_path, monkeypatch):
    table = {tuple(c.args[0]): c.expected for c in checks.get("04-predict-causal-permutation").make_cases()}
    looked_up = lambda perm: table[tuple(perm)]  # noqa: E731  the check cell's permutations, measured beforehand
    with pytest.raises(checks.CheckFailed, match="rule"):  # a name from outside the rule (or no readable source)
        checks.check("04-predict-causal-permutation", looked_up)
    ex = checks.get("04-predict-causal-permutation")
    assert salted_grader(ex, looked_up, SALT, tmp_path, monkeypatch)[0] in ("failed", "error")  # the grader's draw
    assert salted_grader(ex, rows_that_survive, SALT, tmp_path, monkeypatch)[0] == "passed"


def test_predict_permutation_tells_nothing_but_wrong():
    messages = set()
    case = checks.get("04-predict-causal-permutation").make_cases()[3]
    right = rows_that_survive(case.args[0])
    for i in range(len(right)):  # one row wrong, wherever it is: the same message (no count, no position)
        guess = list(right)
        guess[i] = not guess[i]
        with pytest.raises(checks.CheckFailed) as info:
            checks.check("04-predict-causal-permutation", lambda perm, g=tuple(guess), p=tuple(case.args[0]):
                         g if tuple(perm) == p else rows_that_survive(perm))
        messages.add(str(info.value))
    assert len(messages) == 1, messages
    assert "part(s)" not in messages.pop()


# ----------------------------------------------------------------------------- 4. experiment


def parameter_shares(d_model, n_heads, d_ff, vocab_size, n_layers, options=None):
    with torch.device("meta"):
        emb = nn.Embedding(vocab_size, d_model)
        blocks = [TransformerBlock(d_model, n_heads, d_ff, **(options or {})) for _ in range(n_layers)]
    n = {"embedding": emb.weight.numel(),
         "attention": sum(p.numel() for b in blocks for p in b.attn.parameters()),
         "feed_forward": sum(p.numel() for b in blocks for p in b.ff.parameters()),
         "layer_norm": sum(p.numel() for b in blocks for m in (b.norm1, b.norm2) for p in m.parameters())}
    return {k: v / sum(n.values()) for k, v in n.items()}


def shares_no_biases(d_model, n_heads, d_ff, vocab_size, n_layers, options=None):  # the lesson's 4d^2 and 2 d d_ff, no biases
    n = {"embedding": vocab_size * d_model, "attention": 4 * d_model ** 2 * n_layers,
         "feed_forward": 2 * d_model * d_ff * n_layers, "layer_norm": 4 * d_model * n_layers}
    return {k: v / sum(n.values()) for k, v in n.items()}


def test_parameter_shares(tmp_path, monkeypatch):
    checks.check("04-parameter-shares", parameter_shares)
    assert graded("04-parameter-shares", parameter_shares, tmp_path, monkeypatch) == "passed"
    refused("04-parameter-shares", ch04.reference_shares, tmp_path, monkeypatch)
    msg = refused("04-parameter-shares", shares_no_biases, tmp_path, monkeypatch, called=False)
    expected = ch04.reference_shares(64, 4, 256, 1000, 2)
    assert not any(f"{v:.6f}" in msg or f"{v:.4f}" in msg for v in expected.values()), msg


def shares_closed_form(d_model, n_heads, d_ff, vocab_size, n_layers, options=None):  # every option, nothing built
    opts = options or {}
    with_bias = opts.get("bias", True)
    width_kv = (d_model // n_heads) * opts.get("n_kv_heads", n_heads)
    linears = {"attention": [(d_model, d_model), (d_model, width_kv), (d_model, width_kv), (d_model, d_model)],
               "feed_forward": [(d_model, d_ff), (d_ff, d_model)]}
    n = {"embedding": vocab_size * d_model, "layer_norm": n_layers * d_model * (4 if with_bias else 2)}
    for kind, shapes in linears.items():
        n[kind] = n_layers * sum(fan_in * fan_out + (fan_out if with_bias else 0) for fan_in, fan_out in shapes)
    return {k: v / sum(n.values()) for k, v in n.items()}


def shares_built_then_formula(d_model, n_heads, d_ff, vocab_size, n_layers, options=None):
    """The meta-device route: build the blocks as asked, ignore them, return the default block's formula."""
    with torch.device("meta"):
        nn.Embedding(vocab_size, d_model)
        [TransformerBlock(d_model, n_heads, d_ff, **(options or {})) for _ in range(n_layers)]
    n = {"embedding": vocab_size * d_model, "attention": (4 * d_model ** 2 + 4 * d_model) * n_layers,
         "feed_forward": (2 * d_model * d_ff + d_ff + d_model) * n_layers, "layer_norm": 4 * d_model * n_layers}
    return {k: v / sum(n.values()) for k, v in n.items()}


def shares_torch_layer(d_model, n_heads, d_ff, vocab_size, n_layers, options=None):  # PyTorch's layer has the same parameters
    with torch.device("meta"):
        layer = nn.TransformerEncoderLayer(d_model, n_heads, d_ff)
    size = {"attention": 0, "feed_forward": 0, "layer_norm": 0}
    for name, p in layer.named_parameters():
        size[{"self_attn": "attention", "linear1": "feed_forward", "linear2": "feed_forward"}.get(
            name.split(".")[0], "layer_norm")] += p.numel() * n_layers
    size["embedding"] = vocab_size * d_model
    return {k: v / sum(size.values()) for k, v in size.items()}


def test_parameter_shares_needs_the_blocks_built(tmp_path, monkeypatch):
    msg = refused("04-parameter-shares", shares_closed_form, tmp_path, monkeypatch, called=False)
    assert "not the way" in msg and "build" in msg, msg
    refused("04-parameter-shares", shares_torch_layer, tmp_path, monkeypatch)


def test_parameter_shares_built_blocks_then_a_formula_fails(tmp_path, monkeypatch):
    """Building the blocks and returning a formula for the default block fails on the cases whose options
    (no biases, fewer key/value heads) the check draws; the same formula with the options ignored is right on
    the first case, so it is the options that catch it."""
    cases = ch04._parameter_shares()
    assert shares_built_then_formula(*cases[0].args) == pytest.approx(cases[0].expected, abs=1e-12)
    assert {k for c in cases for k in c.kwargs.get("options", {})} == {"bias", "n_kv_heads"}
    msg = refused("04-parameter-shares", shares_built_then_formula, tmp_path, monkeypatch, called=False)
    assert "off by" in msg and "options" in msg, msg
