"""Chapter 12's checks refuse the routes of issue 23 (review ch10-12, section 4, and routes of the same kinds).

Each route is learner code (this file), tried through the check cell and the grader; a right answer passes.
"""

from __future__ import annotations

import math

import pytest
import torch

from attncourse.classroom import checks
from test_exercise_standard import Grader, as_learner


def refused(exercise_id, answer, tmp_path, monkeypatch, *, because):
    """`answer` is refused by the check cell and by the grader, with `because` in both messages."""
    ex = checks.get(exercise_id)
    with pytest.raises(checks.CheckFailed) as info:
        checks.check(exercise_id, answer)
    status, message = Grader(tmp_path, monkeypatch)(ex, answer, ex.make_cases())
    assert status == "failed", message
    assert because in str(info.value) and because in message, (str(info.value), message)


def test_diff_attention_one_value_product(tmp_path, monkeypatch):
    def right(q, k, v, lam, is_causal=False):
        d = q.shape[-1] // 2
        maps = []
        for half in (slice(0, d), slice(d, 2 * d)):
            s = q[..., half] @ k[..., half].transpose(-2, -1) / math.sqrt(d)
            if is_causal:
                s = s.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
            maps.append(s.softmax(-1))
        return (maps[0] - lam * maps[1]) @ v

    checks.check("12-diff-attention", right)
    for breaker in checks.get("12-diff-attention").breakers:
        refused("12-diff-attention", as_learner(breaker), tmp_path, monkeypatch, because="multiply by v once")

    def fused(q, k, v, lam, is_causal=False):  # PyTorch's kernel through torch.ops
        d = q.shape[-1] // 2
        a = torch.ops.aten.scaled_dot_product_attention(q[..., :d], k[..., :d], v, is_causal=is_causal)
        return a - lam * torch.ops.aten.scaled_dot_product_attention(q[..., d:], k[..., d:], v, is_causal=is_causal)

    refused("12-diff-attention", fused, tmp_path, monkeypatch, because="called")

    def maps_of(q, k, is_causal):
        d = q.shape[-1] // 2
        out = []
        for half in (slice(0, d), slice(d, 2 * d)):
            s = q[..., half] @ k[..., half].transpose(-2, -1) / math.sqrt(d)
            if is_causal:
                s = s.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
            out.append(s.softmax(-1))
        return out

    def copy_of_v(q, k, v, lam, is_causal=False):  # the cold review's route: v enters one op (the copy), two products
        a1, a2 = maps_of(q, k, is_causal)
        vv = v * 1.0
        return a1 @ vv - lam * (a2 @ vv)

    def side_by_side(q, k, v, lam, is_causal=False):  # one matmul over the maps laid side by side: twice the work
        a1, a2 = maps_of(q, k, is_causal)
        return torch.cat([a1, -lam * a2], -1) @ torch.cat([v, v], -2)

    def broadcast_twice(q, k, v, lam, is_causal=False):  # multiply-then-sum, once per map
        a1, a2 = maps_of(q, k, is_causal)
        vv = v[..., None, :, :] * 1.0
        return (a1[..., None] * vv).sum(-2) - lam * (a2[..., None] * vv).sum(-2)

    for route in (copy_of_v, side_by_side, broadcast_twice):
        refused("12-diff-attention", route, tmp_path, monkeypatch, because="multiply by v once")

    def one_einsum(q, k, v, lam, is_causal=False):  # subtract first, then one product, spelled as an einsum
        a1, a2 = maps_of(q, k, is_causal)
        return torch.einsum("...qk,...kd->...qd", a1 - lam * a2, v)

    checks.check("12-diff-attention", one_einsum)


def test_find_head_refuses_heuristics(tmp_path, monkeypatch):
    def scored(maps, seg_len):
        t = torch.arange(seg_len, 2 * seg_len)
        return divmod(int(maps[..., t, t - seg_len + 1].mean(-1).argmax()), maps.shape[1])

    checks.check("12-find-head", scored)

    def last_layer_sink(maps, seg_len):  # the cold review's route: last layer, most weight on key 0
        last = maps.shape[0] - 1
        return last, int(maps[last, :, :, 0].sum(-1).argmax())

    def sink_then_letting_go(maps, seg_len):  # key 0 over the first copy, not over the second
        s = maps[..., :seg_len, 0].mean(-1) - maps[..., seg_len:, 0].mean(-1)
        return divmod(int(s.argmax()), maps.shape[1])

    def off_by_one(maps, seg_len):  # the token's own earlier occurrence (t - L): a duplicate-token head
        t = torch.arange(seg_len, 2 * seg_len)
        return divmod(int(maps[..., t, t - seg_len].mean(-1).argmax()), maps.shape[1])

    for route in (last_layer_sink, sink_then_letting_go, off_by_one):
        refused("12-find-head", route, tmp_path, monkeypatch, because="what you returned")


def test_prediction_refuses_the_package(tmp_path, monkeypatch):
    def worked(n, m, x, s):
        return math.exp(s) / (math.exp(s) + n * math.exp(x)), s + math.log(m / n), n * math.exp(x) / (math.exp(x) + n)

    checks.check("12-predict", worked)

    def package(n, m, x, s):  # the route a learner who wants the point takes: run the package's rows
        from attncourse.classroom.checks.ch12_sinks import _sink_row
        share, total = _sink_row(n, x, s)
        return share, s + math.log(m / n), total

    refused("12-predict", package, tmp_path, monkeypatch, because="called attncourse")

    from attncourse.classroom.checks.ch12_sinks import _predict
    typed = tuple(float(v) for v in _predict()[0].expected)  # the first configuration's numbers, typed in

    def printed(n, m, x, s):
        return typed

    with pytest.raises(checks.CheckFailed, match="prediction is not right"):
        checks.check("12-predict", printed)

    def fixed_sink(n, m, x, s):  # "the sink logit does not need to change with the context"
        return worked(n, m, x, s)[0], s, worked(n, m, x, s)[2]

    with pytest.raises(checks.CheckFailed, match="prediction is not right"):
        checks.check("12-predict", fixed_sink)

    def softmax_row(n, m, x, s):  # a sigmoid row read as a budget that sums to 1
        return worked(n, m, x, s)[:2] + (1.0,)

    with pytest.raises(checks.CheckFailed, match="prediction is not right"):
        checks.check("12-predict", softmax_row)


def test_prediction_second_part_is_the_package_row():
    """The check's second part (s + log(m / n)) is a formula: the package's sink row at m keys with that logit
    takes the same share as at n keys with s."""
    from attncourse.classroom.checks.ch12_sinks import _sink_row
    for n, m, x, s in ((7, 300, 0.4, 2.0), (5000, 12, -1.5, 6.0)):
        share_n, _ = _sink_row(n, x, s)
        share_m, _ = _sink_row(m, x, s + math.log(m / n))
        assert abs(share_n - share_m) < 1e-12


def test_prediction_needs_closed_forms():
    """Half the configurations hold 10^9 to 10^15 keys (no row can be built or looped over, the review's plain-Python
    simulation and bisection route); their expected values come from closed forms that equal the package's rows."""
    from attncourse.classroom.checks.ch12_sinks import _predict, _sink_row, sink_row_closed_form
    for n, x, s in ((3, 0.5, 2.0), (777, -2.0, 7.5), (40000, 2.9, -1.0)):
        torch.testing.assert_close(torch.tensor(sink_row_closed_form(n, x, s), dtype=torch.float64),
                                   torch.tensor(_sink_row(n, x, s), dtype=torch.float64), rtol=1e-12, atol=1e-15)
    sizes = [case.args[:2] for case in _predict()]
    assert sum(min(n, m) >= 10**9 for n, m in sizes) >= 3 and sum(max(n, m) <= 50000 for n, m in sizes) >= 3


def test_prediction_refuses_a_simulated_row():
    """The cold review's route: build the row in plain Python and sum it (no closed form). It passed when every
    context held at most 50,000 keys; a row of 10^9 or more cannot be built."""
    def simulated(n, m, x, s):
        row = [math.exp(x)] * n  # every real term of the denominator, one by one
        share = math.exp(s) / (sum(row) + math.exp(s))
        total = sum(1 / (1 + math.exp(math.log(n) - x)) for _ in row)
        return share, s + math.log(m / n), total

    with pytest.raises(checks.CheckFailed):
        checks.check("12-predict", simulated)


def test_induction_score_and_patchify_refuse_loops(tmp_path, monkeypatch):
    checks.check("12-induction-score",
                 lambda w, L: w[..., torch.arange(L, 2 * L), torch.arange(1, L + 1)].mean(-1))
    refused("12-induction-score", as_learner(checks.get("12-induction-score").breakers[0]), tmp_path, monkeypatch,
            because="loops over them")

    def package(w, L):
        from attncourse.heads import induction_scores
        return induction_scores(w, L)

    refused("12-induction-score", package, tmp_path, monkeypatch, because="called attncourse")

    def right_patchify(images, p):
        b, c, h, w = images.shape
        return images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)

    checks.check("12-patchify", right_patchify)
    refused("12-patchify", as_learner(checks.get("12-patchify").breakers[0]), tmp_path, monkeypatch,
            because="loops over them")

    def im2col(images, p):  # F.unfold's operator under another spelling
        return torch.ops.aten.im2col(images, [p, p], [1, 1], [0, 0], [p, p]).transpose(1, 2)

    refused("12-patchify", im2col, tmp_path, monkeypatch, because="im2col")


def test_bugs_keep_their_old_ids_and_refuse_the_package(tmp_path, monkeypatch):
    def fixed(x, context, w_q, w_k, w_v, n_heads):
        b, tq, d_model = x.shape
        tk, d = context.shape[1], d_model // n_heads
        q = (x @ w_q).view(b, tq, n_heads, d).transpose(1, 2)
        k, v = ((context @ w).view(b, tk, n_heads, d).transpose(1, 2) for w in (w_k, w_v))
        return (torch.sigmoid(q @ k.transpose(-2, -1) / math.sqrt(d) - math.log(tk)) @ v).transpose(1, 2).reshape(
            b, tq, d_model)

    from attncourse.classroom.checks.ch12_given import BUGGY_LAMBDA, BUGGY_SIGMOID
    from test_edits import cell_function

    with pytest.raises(checks.CheckFailed, match="not the way"):  # right values, written afresh
        checks.check("12-find-the-bug-1", fixed)
    edited = cell_function(BUGGY_SIGMOID.replace("math.log(tq)", "math.log(tk)").replace("attention(", "attention_fixed("),
                           "sigmoid_cross_attention_fixed", {"torch": torch, "math": math})
    checks.check("12-find-the-bug-1", edited)
    checks.check("12-sigmoid-bug", edited)

    def package(x, context, w_q, w_k, w_v, n_heads):
        from attncourse.classroom.checks.ch12 import sigmoid_cross_attention_reference
        return sigmoid_cross_attention_reference(x, context, w_q, w_k, w_v, n_heads)

    refused("12-find-the-bug-1", package, tmp_path, monkeypatch, because="called attncourse")

    def schedule(n):
        return torch.tensor([0.8 - 0.6 * math.exp(-0.3 * i) for i in range(n)], dtype=torch.float64)

    with pytest.raises(checks.CheckFailed, match="not the way"):  # right values, written afresh
        checks.check("12-find-the-bug-2", schedule)
    for old, new in (("(layer - 1)", "layer"), ("range(n_layers)", "range(1, n_layers + 1)")):
        edited = cell_function(BUGGY_LAMBDA.replace(old, new).replace("schedule(", "schedule_fixed("),
                               "lambda_init_schedule_fixed", {"torch": torch, "math": math})
        checks.check("12-find-the-bug-2", edited)
    checks.check("12-lambda-bug", edited)

    def library(n):
        from attncourse.variants import diff_lambda_init
        return torch.tensor([diff_lambda_init(i + 1) for i in range(n)], dtype=torch.float64)

    refused("12-find-the-bug-2", library, tmp_path, monkeypatch, because="called attncourse")


def test_ablation_routes(tmp_path, monkeypatch):
    def helpers(seed):  # the review's X1: the package's ablation helper, wrapped in @torch.no_grad()
        from attncourse.heads import ablation_effects, planted_induction_model, repeated_tokens
        model = planted_induction_model(32, 8, generator=torch.Generator().manual_seed(seed))
        tokens = repeated_tokens(64, 8, 32, generator=torch.Generator().manual_seed(1000 + seed))
        return ablation_effects(model, tokens)

    refused("12-ablation", helpers, tmp_path, monkeypatch, because="ablation_effects")

    def reference(seed):  # the review's X4: the checker's own reference
        from attncourse.classroom.checks.ch12_ablation import ablation_reference
        return ablation_reference(seed)

    refused("12-ablation", reference, tmp_path, monkeypatch, because="called attncourse.classroom")

    def known_answer(seed):  # "the answer is known in advance": the circuit heads matter, the others do not
        return torch.tensor([[2.6, 0.0], [3.0, 0.0]])

    with pytest.raises(checks.CheckFailed):
        checks.check("12-ablation", known_answer)

    from attncourse.classroom.checks.ch12_ablation import ablation_reference
    pasted = {seed: ablation_reference(seed).tolist() for seed in (0, 1, 2)}  # review 15, E1: a table computed once

    def table(seed):
        return torch.tensor(pasted.get(seed, pasted[0]))

    with pytest.raises(checks.CheckFailed):  # the check draws seeds the table does not hold
        checks.check("12-ablation", table)

    def zero_ablation(seed):  # review 12: zero-ablation (an exec'd copy of ablate_heads, the old exercise) fails
        from attncourse.heads import planted_induction_model, repeated_tokens, token_losses
        model = planted_induction_model(32, 8, generator=torch.Generator().manual_seed(seed))
        tokens = repeated_tokens(64, 8, 32, generator=torch.Generator().manual_seed(1000 + seed))
        width = model.config.d_model // model.config.n_heads
        table = torch.zeros(2, 2)
        with torch.no_grad():
            base = token_losses(model, tokens)[:, 8:].mean()
            for layer in range(2):
                for head in range(2):
                    def zero_head(module, args, h=head):
                        x = args[0].clone()
                        x[..., h * width:(h + 1) * width] = 0
                        return (x,)
                    handle = model.attns[layer].o_proj.register_forward_pre_hook(zero_head)
                    table[layer, head] = token_losses(model, tokens)[:, 8:].mean() - base
                    handle.remove()
        return table

    with pytest.raises(checks.CheckFailed, match="seed 0"):
        checks.check("12-ablation", zero_ablation)


def test_prediction_verify_cell_is_gated():
    import nbformat

    from attncourse.classroom.nbtools import ROOT

    nb = nbformat.read(ROOT / "exercises" / "12_attention_variants.ipynb", as_version=4)
    verify = [c.source for c in nb.cells if c.cell_type == "code" and "sink_softmax_attention(" in c.source
              and "sigmoid_attention(" in c.source]  # the cell that prints the package's rows of exercise 3
    assert verify and all('if passed("12-predict")' in src for src in verify)


def test_cold_review_5_routes(tmp_path, monkeypatch):
    """Review 5: F.pixel_unshuffle answers 12-patchify in one call (refused); a sigmoid attention whose bias is a
    float32 log of Tk is right and must pass (it was refused at rtol 1e-7 with two equal printed numbers)."""
    def unshuffle(images, p):
        import torch.nn.functional as F
        return F.pixel_unshuffle(images, p).flatten(2).transpose(1, 2)

    refused("12-patchify", unshuffle, tmp_path, monkeypatch, because="pixel_unshuffle")

    def op_unshuffle(images, p):  # the operator under another spelling
        return torch.ops.aten.pixel_unshuffle(images, p).flatten(2).transpose(1, 2)

    refused("12-patchify", op_unshuffle, tmp_path, monkeypatch, because="pixel_unshuffle")

    def float32_bias(q, k, v, is_causal=False):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) - torch.log(torch.tensor(float(k.shape[-2])))
        if is_causal:
            s = s.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
        return torch.sigmoid(s) @ v

    checks.check("12-sigmoid", float32_bias)

    def wrong_bias(q, k, v, is_causal=False):  # log of the query length: still refused
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) - math.log(q.shape[-2])
        if is_causal:
            s = s.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
        return torch.sigmoid(s) @ v

    with pytest.raises(checks.CheckFailed):
        checks.check("12-sigmoid", wrong_bias)

    def bottom_right(q, k, v, is_causal=False):  # the causal mask aligned to the last key: refused (Tq != Tk case)
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) - math.log(k.shape[-2])
        if is_causal:
            tq, tk = q.shape[-2], k.shape[-2]
            s = s.masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq), float("-inf"))
        return torch.sigmoid(s) @ v

    with pytest.raises(checks.CheckFailed):
        checks.check("12-sigmoid", bottom_right)


def test_sink_logit_exercise(tmp_path, monkeypatch):
    """12-sink-logit: the definition with a shared shift passes; the package's sink attention, PyTorch's kernel over
    one more zero-valued key, an unshifted normaliser (NaN in float32 at scores near 300) and plain softmax attention
    (the sink forgotten) are refused."""
    def right(q, k, v, sink, is_causal=False):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if is_causal:
            s = s.masked_fill(~torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril(), float("-inf"))
        sk = sink.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        m = torch.maximum(s.amax(-1, keepdim=True), sk)
        e = torch.exp(s - m)
        return (e / (e.sum(-1, keepdim=True) + torch.exp(sk - m))) @ v

    checks.check("12-sink-logit", right)

    def package(q, k, v, sink, is_causal=False):
        from attncourse.sink_variants import sink_softmax_attention
        return sink_softmax_attention(q, k, v, sink, is_causal=is_causal)

    refused("12-sink-logit", package, tmp_path, monkeypatch, because="called attncourse")

    def extra_key(q, k, v, sink, is_causal=False):  # the lesson's check, as an answer: fused attention
        import torch.nn.functional as F
        b, h, tq, d = q.shape
        k2 = torch.cat([k, torch.zeros(b, h, 1, d, dtype=k.dtype)], -2)
        v2 = torch.cat([v, torch.zeros(b, h, 1, v.shape[-1], dtype=v.dtype)], -2)
        bias = torch.zeros(b, h, tq, k.shape[-2] + 1, dtype=q.dtype)
        if is_causal:
            bias[..., :-1] = bias[..., :-1].masked_fill(~torch.ones(tq, k.shape[-2], dtype=torch.bool).tril(),
                                                        float("-inf"))
        bias[..., -1] = sink.view(1, h, 1)
        return F.scaled_dot_product_attention(q, k2, v2, attn_mask=bias)

    with pytest.raises(checks.CheckFailed):
        checks.check("12-sink-logit", extra_key)

    def no_shift(q, k, v, sink, is_causal=False):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if is_causal:
            s = s.masked_fill(~torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril(), float("-inf"))
        e = torch.exp(s)
        return (e / (e.sum(-1, keepdim=True) + torch.exp(sink).view(1, -1, 1, 1))) @ v

    with pytest.raises(checks.CheckFailed, match="NaN or inf"):
        checks.check("12-sink-logit", no_shift)

    def no_shift_float64(q, k, v, sink, is_causal=False):  # the review's route: no shift, upcast to float64
        s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if is_causal:
            s = s.masked_fill(~torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril(), float("-inf"))
        e = torch.exp(s)
        out = (e / (e.sum(-1, keepdim=True) + torch.exp(sink.double()).view(1, -1, 1, 1))) @ v.double()
        return out.to(q.dtype)

    with pytest.raises(checks.CheckFailed, match="NaN or inf"):
        checks.check("12-sink-logit", no_shift_float64)

    def no_sink(q, k, v, sink, is_causal=False):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if is_causal:
            s = s.masked_fill(~torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril(), float("-inf"))
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return (e / e.sum(-1, keepdim=True)) @ v

    with pytest.raises(checks.CheckFailed):
        checks.check("12-sink-logit", no_sink)

    def float64_out(q, k, v, sink, is_causal=False):  # review 12: right values, computed and returned in float64
        return right(q.double(), k.double(), v.double(), sink.double(), is_causal)

    with pytest.raises(checks.CheckFailed, match="inputs' dtype"):
        checks.check("12-sink-logit", float64_out)


def test_cold_review_9_patchify_routes(tmp_path, monkeypatch):
    """Review 9: im2col under two more names passed 12-patchify: a convolution whose one-hot kernels copy each
    patch's pixels into channels, and Tensor.unfold twice (sliding windows of stride p). Both refused."""
    def conv_one_hot(images, p):
        import torch.nn.functional as F
        c = images.shape[1]
        kernels = torch.eye(c * p * p).view(c * p * p, c, p, p)
        return F.conv2d(images, kernels, stride=p).flatten(2).transpose(1, 2)

    refused("12-patchify", conv_one_hot, tmp_path, monkeypatch, because="conv")

    def op_conv(images, p):  # the operator under another spelling
        c = images.shape[1]
        kernels = torch.eye(c * p * p).view(c * p * p, c, p, p)
        out = torch.ops.aten.convolution(images, kernels, None, [p, p], [0, 0], [1, 1], False, [0, 0], 1)
        return out.flatten(2).transpose(1, 2)

    refused("12-patchify", op_conv, tmp_path, monkeypatch, because="convolution")

    def tensor_unfold(images, p):
        b, c = images.shape[:2]
        return images.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * p * p)

    refused("12-patchify", tensor_unfold, tmp_path, monkeypatch, because="unfold")


# ----------------------------------------------------------------------------- gated attention (G1)


def _gated(x, w_q, w_k, w_v, w_g, b_g, w_o, n_heads, where="output"):
    b, t, d = x.shape
    split = lambda y: y.view(b, t, n_heads, d // n_heads).transpose(1, 2)  # noqa: E731
    q, k, v = split(x @ w_q), split(x @ w_k), split(x @ w_v)
    gate = torch.sigmoid(split(x @ w_g + b_g))  # (B, H, T, D)
    if where == "values":
        v = v * gate
    scores = (q @ k.transpose(-2, -1) / (d // n_heads) ** 0.5).masked_fill(
        ~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    heads = torch.softmax(scores, -1) @ v
    if where == "output":
        heads = heads * gate
    elif where == "headwise":
        heads = heads * gate.mean(-1, keepdim=True)
    out = heads.transpose(1, 2).reshape(b, t, d) @ w_o
    return out * torch.sigmoid(x @ w_g + b_g) if where == "after" else out


def test_gated_attention(tmp_path, monkeypatch):
    checks.check("12-gated-attention", _gated)
    for where in ("values", "headwise", "after"):
        with pytest.raises(checks.CheckFailed, match="values differ"):
            checks.check("12-gated-attention",
                         lambda x, w_q, w_k, w_v, w_g, b_g, w_o, n_heads, where=where:
                         _gated(x, w_q, w_k, w_v, w_g, b_g, w_o, n_heads, where))


def test_gated_attention_lazy_import_names_the_function(tmp_path, monkeypatch):
    """Review 14: a course module imported inside the answer ran its class bodies under the watch, and the refusal
    named one of them (SoftpickAttention) instead of the function called (softcap_attention)."""
    import sys

    monkeypatch.delitem(sys.modules, "attncourse.sink_fixes", raising=False)  # restored after the test

    def via_softcap(x, w_q, w_k, w_v, w_g, b_g, w_o, n_heads):
        from attncourse.sink_fixes import softcap_attention
        b, t, d = x.shape
        split = lambda y: y.view(b, t, n_heads, d // n_heads).transpose(1, 2)  # noqa: E731
        heads = softcap_attention(split(x @ w_q), split(x @ w_k), split(x @ w_v), cap=1e9, is_causal=True)
        return (heads * torch.sigmoid(split(x @ w_g + b_g))).transpose(1, 2).reshape(b, t, d) @ w_o

    with pytest.raises(checks.CheckFailed, match="sink_fixes.softcap_attention"):
        checks.check("12-gated-attention", as_learner(via_softcap))
