"""Chapter 03's checks refuse the routes a learner could take without the skill (issue 23), by the check cell and
the grader alike, and accept independent right answers."""

import math

import pytest

import numpy as np
import torch

from attncourse.classroom import checks
from attncourse.classroom.checks.ch03 import BUGGY_ATTENTION
from test_edits import cell_function
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


def _attention(q, k, v):
    w = (q @ k.mT / math.sqrt(q.shape[-1])).softmax(-1)
    return w @ v


def test_sdpa_numpy_routes(tmp_path, monkeypatch):
    def aten_math(Q, K, V):
        out, w = torch.ops.aten._scaled_dot_product_attention_math(*(torch.from_numpy(x) for x in (Q, K, V)))
        return out.numpy(), w.numpy()

    def log_softmax(Q, K, V):
        w = torch.log_softmax(torch.from_numpy(Q @ K.T / np.sqrt(Q.shape[1])), -1).exp().numpy()
        return w @ V, w

    def numpy_alone(Q, K, V):
        s = Q @ K.T / np.sqrt(Q.shape[1])
        e = np.exp(s - s.max(-1, keepdims=True))
        w = e / e.sum(-1, keepdims=True)
        return w @ V, w

    def unshifted(Q, K, V):  # right on moderate scores, overflows on the large-score case
        e = np.exp(Q @ K.T / np.sqrt(Q.shape[1]))
        w = e / e.sum(-1, keepdims=True)
        return w @ V, w

    def long_double(Q, K, V):  # no shift: exponentials in long double, whose range covers scores in the thousands
        e = np.exp((Q @ K.T / np.sqrt(Q.shape[1])).astype(np.longdouble))
        w = (e / e.sum(-1, keepdims=True)).astype(np.float64)
        return w @ V, w

    with np.errstate(all="ignore"):
        refused("03-sdpa-numpy", long_double, tmp_path, monkeypatch, why="huge scores")
    refused("03-sdpa-numpy", aten_math, tmp_path, monkeypatch)
    refused("03-sdpa-numpy", log_softmax, tmp_path, monkeypatch)
    refused("03-sdpa-numpy", unshifted, tmp_path, monkeypatch, why="large scores")
    accepted("03-sdpa-numpy", numpy_alone, tmp_path, monkeypatch)

    def stable_log_sum_exp(Q, K, V):  # np.logaddexp shifts inside: passes the huge case too (as prop_doc says)
        s = Q @ K.T / np.sqrt(Q.shape[1])
        w = np.exp(s - np.logaddexp.reduce(s, axis=-1, keepdims=True))
        return w @ V, w

    accepted("03-sdpa-numpy", stable_log_sum_exp, tmp_path, monkeypatch)


def test_find_the_bug_routes(tmp_path, monkeypatch):
    def aten_kernel(q, k, v):
        return torch.ops.aten.scaled_dot_product_attention(q, k, v)

    def math_kernel(q, k, v):
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v)[0]

    def buggy(q, k, v):  # the colleague's code
        return (q.shape[-1] ** -0.5 * q @ k.T).softmax(dim=-1) @ v

    refused("03-find-the-bug-1", aten_kernel, tmp_path, monkeypatch)
    refused("03-find-the-bug-1", math_kernel, tmp_path, monkeypatch)
    refused("03-find-the-bug-1", buggy, tmp_path, monkeypatch, why="")
    refused("03-find-the-bug-1", _attention, tmp_path, monkeypatch, why="not the way")  # right, but not the given code
    fixed = cell_function(BUGGY_ATTENTION.replace("k.T", "k.transpose(-2, -1)").replace("_buggy(", "_fixed("),
                          "attention_fixed", {"torch": torch})
    accepted("03-find-the-bug-1", fixed, tmp_path, monkeypatch)
    assert checks.get("03-batched-attention-bug").id == "03-find-the-bug-1"  # old submissions still grade


def test_masked_attention_routes(tmp_path, monkeypatch):
    def scores(q, k, keep):
        return (q.float() @ k.float().mT / math.sqrt(q.shape[-1])).masked_fill(~keep, float("-inf"))

    def aten_sdpa(q, k, v, keep):
        return torch.ops.aten.scaled_dot_product_attention(q, k, v, keep)

    def aten_safe(q, k, v, keep):
        return torch.ops.aten._safe_softmax(scores(q, k, keep), -1).to(v.dtype) @ v

    def private_safe(q, k, v, keep):
        return torch._safe_softmax(scores(q, k, keep), -1).to(v.dtype) @ v

    def one_pass(q, k, v, keep):
        from attncourse.online_softmax import one_pass_softmax
        return one_pass_softmax(scores(q, k, keep)).nan_to_num(0.0).to(v.dtype) @ v

    def mine(q, k, v, keep):
        s = scores(q, k, keep).double()
        top = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
        e = (s - top).exp()
        z = e.sum(-1, keepdim=True)
        return (e / torch.where(z > 0, z, 1.0)).to(v.dtype) @ v

    for route in (aten_sdpa, aten_safe, private_safe, one_pass):
        refused("03-masked-attention", route, tmp_path, monkeypatch)
    accepted("03-masked-attention", mine, tmp_path, monkeypatch)


def test_masked_attention_refuses_magic_fills(tmp_path, monkeypatch):
    """The review's plausible wrong answers: a finite "very negative" fill (-1e4 in float16 without upcasting, the
    lesson's anti-pattern; -1e9 in float32) with the empty rows zeroed passed every case; a case whose allowed scores
    lie below the fill now refuses each, while the lowest finite value of the dtype in float32 still passes."""
    def fill(value, upcast):
        def masked_attention(q, k, v, keep):
            qq, kk = (q.float(), k.float()) if upcast else (q, k)
            s = (qq @ kk.mT / math.sqrt(q.shape[-1])).masked_fill(~keep, value(qq.dtype))
            e = (s - s.amax(-1, keepdim=True)).exp() * keep  # the empty rows become zeros
            z = e.sum(-1, keepdim=True)
            return (e / torch.where(z > 0, z, 1.0)).to(v.dtype) @ v
        return masked_attention

    for value, upcast, case in ((lambda dt: -1e4, False, "float16"), (lambda dt: -1e4, True, "float16"),
                                (lambda dt: -1e9, True, "float32")):
        msg, _ = _verdicts("03-masked-attention", fill(value, upcast), tmp_path, monkeypatch)
        assert msg is not None and f"{case}: one head's allowed scores all below" in msg, msg
    accepted("03-masked-attention", fill(lambda dt: torch.finfo(dt).min, True), tmp_path, monkeypatch)


def test_masked_attention_refuses_a_float16_softmax(tmp_path, monkeypatch):
    """Review 13: a softmax computed wholly in float16 (a safe max, no upcast) passed every case; scores past 65,504
    now give it NaN, whether it scales before or after the product, while float32 scores scaled first still pass."""
    def softmax_in(dtype, scale_first=False):
        def masked_attention(q, k, v, keep):
            qq, kk = q.to(dtype), k.to(dtype)
            s = (qq * q.shape[-1] ** -0.5) @ kk.mT if scale_first else qq @ kk.mT / math.sqrt(q.shape[-1])
            s = s.masked_fill(~keep, float("-inf"))
            top = s.amax(-1, keepdim=True)
            e = (s - torch.where(torch.isfinite(top), top, 0.0)).exp()
            z = e.sum(-1, keepdim=True)
            return (e / torch.where(z > 0, z, 1.0)).to(v.dtype) @ v
        return masked_attention

    half = lambda q: q.dtype if q.dtype == torch.float16 else torch.float64  # noqa: E731
    for scale_first in (False, True):
        def no_upcast(q, k, v, keep, scale_first=scale_first):
            return softmax_in(half(q), scale_first)(q, k, v, keep)
        msg, _ = _verdicts("03-masked-attention", no_upcast, tmp_path, monkeypatch)
        assert msg is not None and "above float16's largest finite number (65,504)" in msg, msg

    def upcast_scale_first(q, k, v, keep):
        return softmax_in(torch.float64 if q.dtype == torch.float64 else torch.float32, True)(q, k, v, keep)
    accepted("03-masked-attention", upcast_scale_first, tmp_path, monkeypatch)


def test_variance_experiment_routes(tmp_path, monkeypatch):
    def closed_form(d_k, std, n, seed):
        return float(d_k * std**4)

    def reference(d_k, std, n, seed):
        from attncourse.classroom.checks.ch03 import measure_dot_variance
        return measure_dot_variance(d_k, std, n, seed)

    def measured(d_k, std, n, seed):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(n, d_k, generator=gen, dtype=torch.float64) * std
        k = torch.randn(n, d_k, generator=gen, dtype=torch.float64) * std
        return float((q * k).sum(-1).var())

    refused("03-variance-experiment", closed_form, tmp_path, monkeypatch, why="small sample")
    refused("03-variance-experiment", reference, tmp_path, monkeypatch)
    accepted("03-variance-experiment", measured, tmp_path, monkeypatch)


def test_variance_fit_routes(tmp_path, monkeypatch):
    def typed(seed):
        return 4.0, 1.0

    def measured(seed):
        def var(d_k, std, n, s):
            gen = torch.Generator().manual_seed(s)
            q = torch.randn(n, d_k, generator=gen, dtype=torch.float64) * std
            k = torch.randn(n, d_k, generator=gen, dtype=torch.float64) * std
            return float((q * k).sum(-1).var())

        def slope(xs, ys):
            lx, ly = torch.tensor(xs, dtype=torch.float64).log(), torch.tensor(ys, dtype=torch.float64).log()
            return float(((lx - lx.mean()) * (ly - ly.mean())).sum() / ((lx - lx.mean()) ** 2).sum())
        stds, widths = [0.25, 0.5, 1.0, 2.0, 4.0], [16, 64, 256, 1024]
        return (slope(stds, [var(64, s, 4000, seed + i) for i, s in enumerate(stds)]),
                slope(widths, [var(w, 1.0, 4000, seed + 50 + i) for i, w in enumerate(widths)]))

    refused("03-variance-fit", typed, tmp_path, monkeypatch, why="seed=")
    accepted("03-variance-fit", measured, tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- the prediction is a rule

from test_ch01_checks import rule_prediction_routes  # noqa: E402


def _broadcast(*shapes):
    n = max(map(len, shapes))
    out = []
    for sizes in zip(*[(1,) * (n - len(s)) + tuple(s) for s in shapes]):
        big = {size for size in sizes if size != 1}
        assert len(big) <= 1, shapes
        out.append(big.pop() if big else 1)
    return tuple(out)


def _shapes_rule(q, k, v, mask):
    scores = _broadcast(q[:-2], k[:-2]) + (q[-2], k[-2])  # leading axes broadcast; one score per (query, key)
    weights = scores  # the mask only says which scores count: it must broadcast to them, it adds no axis
    return scores, weights, _broadcast(weights[:-2], v[:-2]) + (q[-2], v[-1])


def _shapes_by_running(q, k, v, mask):
    """The review's route: run the lesson's attention on the given shapes (zeros) and read the shapes."""
    from attncourse import scaled_dot_product_attention
    out, w = scaled_dot_product_attention(torch.zeros(q), torch.zeros(k), torch.zeros(v),
                                          torch.ones(mask, dtype=torch.bool), return_weights=True)
    return tuple((torch.zeros(q) @ torch.zeros(k).mT).shape), tuple(w.shape), tuple(out.shape)


def _shapes_by_meta(q, k, v, mask):
    qm, km, vm = (torch.empty(s, device="meta") for s in (q, k, v))
    s = qm @ km.mT
    w = torch.softmax(s.masked_fill(~torch.ones(mask, dtype=torch.bool, device="meta"), float("-inf")), -1)
    return tuple(s.shape), tuple(w.shape), tuple((w @ vm).shape)


def _shapes_by_broadcast_helper(q, k, v, mask):
    scores = tuple(torch.broadcast_shapes(q[:-2], k[:-2])) + (q[-2], k[-2])
    return scores, scores, scores[:-1] + (v[-1],)


def _shapes_by_checker(*args):
    from attncourse.classroom.checks.ch03 import measured_attention_shapes
    return measured_attention_shapes(*args)


def _shapes_queries_lead(q, k, v, mask):  # "the output has the query's shape with v's width": no broadcasting
    return q[:-1] + (k[-2],), q[:-1] + (k[-2],), q[:-1] + (v[-1],)


def test_predict_shapes_is_a_rule(tmp_path, monkeypatch):
    rule_prediction_routes("03-predict-shapes", _shapes_rule, tmp_path, monkeypatch,
                           measured=(_shapes_by_running, _shapes_by_meta, _shapes_by_broadcast_helper,
                                     _shapes_by_checker),
                           wrong=(_shapes_queries_lead,))


def _backward_cell():
    """The exercise notebook's cell after 03-masked-attention's check: the backward pass through a masked row."""
    import nbformat

    from attncourse.classroom.nbtools import ROOT

    cells = nbformat.read(ROOT / "exercises" / "03_scaled_dot_product_attention.ipynb", as_version=4).cells
    at = next(i for i, c in enumerate(cells) if c.source.startswith('check("03-masked-attention")'))
    assert ".backward()" in cells[at + 1].source
    return cells[at + 1].source


def test_masked_attention_backward_cell(tmp_path, monkeypatch):
    """The check runs the backward pass too (a case back-propagates through the answer inside the guard), and so
    does the notebook's next cell: an added -inf mask with its NaN weights zeroed afterwards (a NaN-free forward)
    fails both on the fully masked row, by the gradient of q, and selection plus a max shifted by 0 passes both."""
    from attncourse import scaled_dot_product_attention
    from attncourse.classroom.checks import uses

    def additive_then_nan_to_num(q, k, v, keep):  # the cold review's route (float32 at least, as the lesson does)
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        s = (q.to(work) @ k.to(work).mT) / math.sqrt(q.shape[-1]) + torch.where(keep, 0.0, float("-inf")).to(work)
        e = (s - s.amax(-1, keepdim=True)).exp()
        return (e / e.sum(-1, keepdim=True)).nan_to_num(0.0).to(v.dtype) @ v

    def selected(q, k, v, keep):  # float32 at least too: half-precision scores pass 65,504 in one case
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        s = (q.to(work) @ k.to(work).mT / math.sqrt(q.shape[-1])).masked_fill(~keep, float("-inf"))
        top = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
        e = (s - top).exp()
        z = e.sum(-1, keepdim=True)
        return (e / torch.where(z > 0, z, 1.0)).to(v.dtype) @ v

    with pytest.raises(checks.CheckFailed, match="the gradient of q: .* NaN"):  # the forward alone is right
        checks.check("03-masked-attention", additive_then_nan_to_num)
    checks.check("03-masked-attention", selected)
    cell, (status, message) = _verdicts("03-masked-attention", additive_then_nan_to_num, tmp_path, monkeypatch)
    assert status == "failed" and "the gradient of q" in message and "NaN" in message, (status, message)
    cell, (status, message) = _verdicts("03-masked-attention", selected, tmp_path, monkeypatch)
    assert cell is None and status == "passed", (cell, status, message)
    source = _backward_cell()
    base = {"torch": torch, "uses": uses, "scaled_dot_product_attention": scaled_dot_product_attention}
    with pytest.raises(AssertionError, match="gradient of q"):
        exec(source, dict(base, masked_attention=additive_then_nan_to_num))
    exec(source, dict(base, masked_attention=selected))
