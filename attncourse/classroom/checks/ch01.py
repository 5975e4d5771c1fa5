"""Checks for chapter 01, additive (Bahdanau) attention (solutions/01_additive_attention.ipynb)."""

from __future__ import annotations

import torch

from attncourse.rnn_attention import AdditiveAttention
from . import Case, exercise


def _additive(gen: torch.Generator, b: int, t: int, dq: int, dk: int, a: int):
    """Random query, keys and additive weights, plus the reference module holding those weights."""
    q = torch.randn(b, dq, generator=gen, dtype=torch.float64)
    k = torch.randn(b, t, dk, generator=gen, dtype=torch.float64)
    w_q = torch.randn(a, dq, generator=gen, dtype=torch.float64) / dq**0.5
    w_k = torch.randn(a, dk, generator=gen, dtype=torch.float64) / dk**0.5
    v = torch.randn(a, generator=gen, dtype=torch.float64)
    ref = AdditiveAttention(dq, dk, a).double()
    with torch.no_grad():
        ref.query_proj.weight.copy_(w_q)
        ref.key_proj.weight.copy_(w_k)
        ref.v.weight.copy_(v[None])
    return (q, k, w_q, w_k, v), ref


SIZES = {  # name: (B, T, Dq, Dk, A)
    "B=2, T=5, Dq=Dk=4, A=3": (2, 5, 4, 4, 3),
    "query and key sizes differ (Dq=6, Dk=10)": (3, 7, 6, 10, 8),
    "a single source position (T=1)": (2, 1, 5, 5, 4),
}


@exercise("01-additive-score", "additive_scores", points=2,
          hint="project the query to (B, 1, A) and the keys to (B, T, A), add (broadcasting over T), "
               "tanh, then a dot product with v over the last axis: (B, T, A) -> (B, T)")
def _additive_score():
    """The additive score e_j = v^T tanh(W_q s + W_k h_j) for every source position."""
    gen = torch.Generator().manual_seed(11)
    cases = []
    for name, size in SIZES.items():
        args, ref = _additive(gen, *size)
        with torch.no_grad():
            cases.append(Case(name, args, expected=ref.score(args[0], args[1]), rtol=1e-8, atol=1e-10))
    return cases


@exercise("01-softmax-axis-bug", "additive_attention_fixed", points=2,
          hint="the scores come out as (B, T, 1); a softmax over that last axis of size 1 makes every "
               "weight exp(x)/exp(x) = 1. Normalise over the T source positions instead")
def _softmax_axis():
    """Fix an additive attention whose softmax runs over a size-1 axis (as in note 004)."""
    gen = torch.Generator().manual_seed(12)
    cases = []
    for name, size in SIZES.items():
        args, ref = _additive(gen, *size)
        with torch.no_grad():
            context, weights = ref(args[0], args[1])
        cases.append(Case(name, args, expected=(context, weights), rtol=1e-8, atol=1e-10))
    return cases


@exercise("01-padding-mask", "masked_softmax", points=2,
          hint="fill the scores at positions j >= length with -inf; where a whole row is -inf (length 0) "
               "return zeros instead of the NaN that torch.softmax gives (attncourse.safe_softmax does this)")
def _masked_softmax():
    """Softmax over the first `lengths[b]` positions of each row; zeros elsewhere, zeros for length 0."""
    gen = torch.Generator().manual_seed(13)
    cases = []
    for name, (b, t, lengths) in {
        "lengths [5, 2, 3]": (3, 5, [5, 2, 3]),
        "length 1 keeps a single weight of 1": (2, 4, [1, 4]),
        "length 0 gives a row of zeros, not NaN": (3, 6, [6, 0, 2]),
    }.items():
        scores = torch.randn(b, t, generator=gen, dtype=torch.float64) * 3
        lengths_t = torch.tensor(lengths)
        mask = torch.arange(t) < lengths_t[:, None]  # (B, T)
        expected = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
        cases.append(Case(name, (scores, lengths_t), expected=expected, rtol=1e-8, atol=1e-10))
    return cases


@exercise("01-predict-shapes", "predicted_shapes", kind="value", points=1,
          hint="a bidirectional GRU concatenates both directions; the query is one decoder state per "
               "sequence; there is one weight per source position")
def _predict_shapes():
    """Shapes of the annotations, the weights and the context for batch 8, source length 13."""
    return [Case("shapes of (annotations, weights, context)", expected=((8, 13, 64), (8, 13), (8, 64)),
                 compare="equal")]
