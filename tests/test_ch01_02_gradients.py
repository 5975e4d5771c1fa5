"""The "one batched expression" exercises of chapters 01 and 02 ask for the gradients too (checks/graphs.py): numbers
read out of the tensors as text and combined in plain Python (the cold review 13's route) fail, and so do the detours
that would glue such numbers back to the inputs."""

import math
import re

import torch

from test_ch01_checks import _verdicts, accepted, refused


def refused_either(exercise_id, answer, tmp_path, monkeypatch, whys):
    """Refused in the check cell and the grader for one of `whys`: the guard's read-out budget refuses the numbers
    read out as text on a case large enough, the gradient cases refuse a result with no graph on the others."""
    cell, (status, message) = _verdicts(exercise_id, answer, tmp_path, monkeypatch)
    assert cell is not None and any(w in cell for w in whys), cell
    assert status in ("failed", "error") and any(w in message for w in whys), (status, message)


def _read_out(x):
    """Every entry of `x` as a Python float, through repr at 17 digits (no tolist, no item)."""
    torch.set_printoptions(precision=17, threshold=10**9, sci_mode=True)
    try:
        text = repr(x.detach().flatten())
    finally:
        torch.set_printoptions(profile="default")
    return [float(t) for t in re.findall(r"-?\d+\.\d+(?:e[-+]\d+)?", text)]


def _additive_in_python(query, keys, W_q, W_k, v):
    (b_, t_, dk), (a_, dq) = keys.shape, W_q.shape
    q, k, wq, wk, vv = map(_read_out, (query, keys, W_q, W_k, v))
    out = [sum(vv[a] * math.tanh(sum(wq[a * dq + d] * q[b * dq + d] for d in range(dq))
                                 + sum(wk[a * dk + d] * k[(b * t_ + j) * dk + d] for d in range(dk)))
               for a in range(a_)) for b in range(b_) for j in range(t_)]
    return torch.tensor(out, dtype=torch.float64).reshape(b_, t_)


def _lesson_loop(query, keys, W_q, W_k, v):
    return torch.stack([torch.stack([v @ torch.tanh(W_q @ query[b] + W_k @ keys[b, j]) for j in range(keys.shape[1])])
                        for b in range(keys.shape[0])])


def test_additive_score_needs_a_graph(tmp_path, monkeypatch):
    def glued(query, keys, W_q, W_k, v):  # the Python numbers tied to the inputs by a term that is zero
        return _additive_in_python(query, keys, W_q, W_k, v) + 0 * sum(x.sum() for x in (query, keys, W_q, W_k, v))

    def loop_when_watched(query, keys, W_q, W_k, v):  # Python unless gradients are asked for, then the lesson's loop
        return (_lesson_loop if query.requires_grad else _additive_in_python)(query, keys, W_q, W_k, v)

    class Handed(torch.autograd.Function):  # the Python numbers handed to autograd
        @staticmethod
        def forward(ctx, *args):
            return _additive_in_python(*args)

        @staticmethod
        def backward(ctx, grad):
            return (None,) * 5

    read_out = "more numbers read out of tensors"  # this exercise's largest case is over the guard's budget
    refused_either("01-additive-score", _additive_in_python, tmp_path, monkeypatch, ("carries no gradient", read_out))
    refused_either("01-additive-score", glued, tmp_path, monkeypatch, ("the backward pass", read_out))
    refused_either("01-additive-score", loop_when_watched, tmp_path, monkeypatch, ("not the way", read_out))
    refused("01-additive-score", lambda *args: Handed.apply(*args), tmp_path, monkeypatch)
    accepted("01-additive-score", lambda q, k, w_q, w_k, v: torch.einsum("bta,a->bt", torch.tanh(
        torch.einsum("ad,bd->ba", w_q, q)[:, None] + torch.einsum("ad,btd->bta", w_k, k)), v), tmp_path, monkeypatch)


def test_general_score_needs_a_graph(tmp_path, monkeypatch):
    def in_python(query, keys, W):
        (b_, t_, dk), dq = keys.shape, W.shape[0]
        q, k, w = map(_read_out, (query, keys, W))
        out = [sum(q[b * dq + i] * w[i * dk + d] * k[(b * t_ + j) * dk + d] for i in range(dq) for d in range(dk))
               for b in range(b_) for j in range(t_)]
        return torch.tensor(out, dtype=torch.float64).reshape(b_, t_)

    refused("02-general-score", in_python, tmp_path, monkeypatch, why="carries no gradient")


def test_padding_mask_needs_a_graph(tmp_path, monkeypatch):
    def in_python(scores, lengths):  # the review's route: one softmax per row over its real scores, in Python
        b_, t_ = scores.shape
        s, n = _read_out(scores.double()), [int(x) for x in re.findall(r"-?\d+", repr(lengths))]
        out = []
        for b in range(b_):
            row = s[b * t_:b * t_ + n[b]]
            top = max(row, default=0.0)
            e = [math.exp(x - top) for x in row]
            out += [x / sum(e) for x in e] + [0.0] * (t_ - n[b])
        return torch.tensor(out, dtype=torch.float64).reshape(b_, t_)

    def additive_mask(scores, lengths):  # a right answer by another spelling: the gradient is zero at the padding
        pad = torch.arange(scores.shape[1]) >= lengths[:, None]
        return torch.softmax(scores + torch.zeros_like(scores).masked_fill(pad, -math.inf), -1).nan_to_num(0.0)

    refused("01-padding-mask", in_python, tmp_path, monkeypatch, why="carries no gradient")
    accepted("01-padding-mask", additive_mask, tmp_path, monkeypatch)
