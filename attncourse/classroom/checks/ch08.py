"""Checks for chapter 08, online softmax (solutions/08_online_softmax.ipynb)."""

from __future__ import annotations

import torch

from attncourse.online_softmax import (AttentionState, SoftmaxState, merge_softmax_states, one_pass_softmax,
                              online_attention_update, online_softmax_trace, softmax_state)
from . import Case, exercise

NEG_INF = float("-inf")
PREDICT_ROW = (2.0, 1.0, 4.0, 4.0, 3.0)  # the row of exercise 4, one entry per step


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0, dtype=torch.float64) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


@exercise("08-merge", "merge_states", points=2,
          hint="m = max(m_a, m_b); rescale each sum to the new max: l = l_a*exp(m_a - m) + l_b*exp(m_b - m); "
               "where m is -inf (both sides empty) subtract 0 instead, so exp(-inf) = 0 and no NaN appears")
def _merge():
    """Merge two (max, sum) states into the state of both chunks together."""
    gen = torch.Generator().manual_seed(8)
    cases = []

    def add(name, a, b, **tol):
        m, l = merge_softmax_states(a, b)
        cases.append(Case(name, (a.m, a.l, b.m, b.l), expected=(m, l), **tol))

    add("two chunks of 5 rows", softmax_state(_randn(gen, 5, 7, scale=3)), softmax_state(_randn(gen, 5, 4, scale=3)))
    a = softmax_state(_randn(gen, 4, 6))
    add("b's max is larger in every row", a, softmax_state(_randn(gen, 4, 3) + 10))
    empty = SoftmaxState(torch.full((4,), NEG_INF, dtype=torch.float64), torch.zeros(4, dtype=torch.float64))
    add("b is empty (-inf, 0): the result is a", a, empty)
    add("a is empty (-inf, 0): the result is b", empty, a)
    add("both empty: expect (-inf, 0), not NaN", empty, empty)
    big = softmax_state(_randn(gen, 3, 5, dtype=torch.float32) * 100 + 1e4)
    add("maxima near 1e4 in float32 (exp(m) would overflow)", big,
        softmax_state(_randn(gen, 3, 5, dtype=torch.float32) * 100 + 1e4), rtol=1e-5, atol=1e-5)
    return cases


@exercise("08-one-pass-softmax", "softmax_one_pass", points=3,
          forbid=("torch.softmax", "torch.nn.functional.softmax", "torch.special.softmax", "torch.logsumexp"),
          hint="keep m (running max) and l (running sum) per row; for each chunk: m_new = max(m, chunk max), "
               "alpha = exp(m - m_new) rescales l AND the outputs already written, write exp(chunk - m_new), "
               "and divide everything by l at the end (0 where l == 0)")
def _one_pass():
    """Softmax over the last dim that reads the input once, chunk by chunk."""
    gen = torch.Generator().manual_seed(9)
    cases = []

    def add(name, x, chunk_size, **tol):
        cases.append(Case(name, (x, chunk_size), expected=one_pass_softmax(x, chunk_size=chunk_size), **tol))

    add("(3, 10) in chunks of 4 (4 does not divide 10)", _randn(gen, 3, 10, scale=2), 4)
    add("an increasing row in chunks of 1: the max grows at every step",
        torch.linspace(-3, 6, 10, dtype=torch.float64), 1)
    add("a decreasing row in chunks of 3", torch.linspace(6, -3, 10, dtype=torch.float64), 3)
    add("large entries (around 300) in float32: naive exp overflows",
        _randn(gen, 2, 9, scale=50, dtype=torch.float32) + 300, 3, rtol=1e-5, atol=1e-6)
    x = _randn(gen, 4, 8)
    x[0, :5] = NEG_INF
    x[1, ::2] = NEG_INF
    x[2] = NEG_INF
    add("-inf entries, a first chunk fully masked, and a fully masked row (zeros, not NaN)", x, 2)
    add("one chunk bigger than the row", _randn(gen, 2, 5), 50)
    return cases


@exercise("08-rescale-bug", "online_update_fixed", points=2,
          forbid=("torch.nn.functional.scaled_dot_product_attention",),
          hint="when the running max grows from m to m_new, everything accumulated relative to m must be "
               "multiplied by alpha = exp(m - m_new): the sum l and the accumulator acc alike; "
               "use 0 instead of m_new where m_new is -inf")
def _rescale_bug():
    """Fix an online attention update that forgets to rescale the accumulator."""
    gen = torch.Generator().manual_seed(10)
    cases = []

    def add(name, m, l, acc, scores, value):
        expected = tuple(online_attention_update(AttentionState(m, l, acc), scores, value))
        cases.append(Case(name, (m, l, acc, scores, value), expected=expected))

    tq, c, dv = 3, 4, 5
    add("first chunk, from the empty state (-inf, 0, 0)", torch.full((tq,), NEG_INF, dtype=torch.float64),
        torch.zeros(tq, dtype=torch.float64), torch.zeros(tq, dv, dtype=torch.float64),
        _randn(gen, tq, c), _randn(gen, c, dv))
    m, l, acc = torch.zeros(tq, dtype=torch.float64), torch.full((tq,), 2.0, dtype=torch.float64), _randn(gen, tq, dv)
    add("the new chunk raises the max (scores around 4 > m = 0)", m, l, acc, _randn(gen, tq, c) + 4, _randn(gen, c, dv))
    add("the new chunk stays below the max (alpha = 1)", m + 10, l, acc, _randn(gen, tq, c), _randn(gen, c, dv))
    m, l, acc = _randn(gen, 2, tq), torch.rand(2, tq, generator=gen, dtype=torch.float64) + 1, _randn(gen, 2, tq, dv)
    add("batched (2, 3) rows, scores mixed around the max", m, l, acc,
        _randn(gen, 2, tq, c, scale=2), _randn(gen, 2, c, dv))
    m = torch.tensor([NEG_INF, 0.5, NEG_INF], dtype=torch.float64)
    l, acc = torch.tensor([0.0, 1.5, 0.0], dtype=torch.float64), torch.zeros(tq, dv, dtype=torch.float64)
    acc[1] = 1.0
    scores = _randn(gen, tq, c)
    scores[0] = NEG_INF  # an empty row gets a fully masked chunk: it must stay (-inf, 0, 0)
    add("a fully masked chunk on a row with nothing yet (no NaN)", m, l, acc, scores, _randn(gen, c, dv))
    return cases


@exercise("08-predict-rescale", "predicted", kind="value", points=1,
          hint="go one entry at a time: m_j = max(m_{j-1}, x_j), the factor is exp(m_{j-1} - m_j) (0 at the first "
               "step, 1 whenever the max does not change), and l_j = l_{j-1} * factor + exp(x_j - m_j)")
def _predict():
    """Predict the running max, the rescale factors and the running sum over the row (2, 1, 4, 4, 3)."""
    t = online_softmax_trace(torch.tensor(PREDICT_ROW, dtype=torch.float64), chunk_size=1)
    expected = (t["running_max"].tolist(), t["rescale"].tolist(), t["running_sum"].tolist())
    return [Case("(running_max, rescale, running_sum) over (2, 1, 4, 4, 3)", expected=expected, rtol=1e-3, atol=1e-3)]
