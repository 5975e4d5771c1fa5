"""Checks for chapter 03, scaled dot-product attention (solutions/03_scaled_dot_product_attention.ipynb)."""

from __future__ import annotations

import torch

from attncourse.sdpa import scaled_dot_product_attention
from . import Case, exercise

# Implement-it-yourself exercises may not call an attention that is already written: PyTorch's fused kernel or
# the course's oracle (under either name).
_FORBID = ("torch.nn.functional.scaled_dot_product_attention", "attncourse.scaled_dot_product_attention",
           "attncourse.sdpa.scaled_dot_product_attention")


def _qkv(gen: torch.Generator, q_shape, k_len: int, dv: int | None = None, dtype=torch.float64):
    *lead, _, d = q_shape
    dv = d if dv is None else dv
    q = torch.randn(*q_shape, generator=gen, dtype=dtype)
    k = torch.randn(*lead, k_len, d, generator=gen, dtype=dtype)
    v = torch.randn(*lead, k_len, dv, generator=gen, dtype=dtype)
    return q, k, v


@exercise("03-sdpa-numpy", "attention_numpy", points=2, numpy=True,
          hint="scores = Q @ K.T / sqrt(d_k); subtract each row's max before exp; normalise over "
               "the last axis (the keys); return (output, weights)")
def _sdpa_numpy():
    """Scaled dot-product attention in NumPy alone, on 2-D (T, d) inputs."""
    gen = torch.Generator().manual_seed(3)
    cases = []
    for name, (tq, tk, d, dv) in {
        "the notes' (4, 8) inputs": (4, 4, 8, 8),
        "more keys than queries (3 x 5)": (3, 5, 8, 8),
        "value dim differs from key dim": (4, 6, 8, 3),
        "large scores (d_k = 64, entries x 10)": (2, 7, 64, 4),
    }.items():
        q, k, v = _qkv(gen, (tq, d), tk, dv)
        if "large" in name:
            q, k = q * 10, k * 10
        out, w = scaled_dot_product_attention(q, k, v, return_weights=True)
        cases.append(Case(name, (q, k, v), expected=(out, w), rtol=1e-6, atol=1e-9))
    return cases


@exercise("03-softmax-axis-bug", "attention_fixed", points=2,
          forbid=_FORBID,
          hint="each query's weights must sum to 1 over the keys: which axis of (..., Tq, Tk) is that?")
def _softmax_axis():
    """Find and fix the bug in an attention that normalises over the wrong axis."""
    gen = torch.Generator().manual_seed(4)
    cases = []
    for name, (shape, tk) in {
        "square (1, 2, 4, 8)": ((1, 2, 4, 8), 4),
        "Tq != Tk (2, 3, 5, 16) over 9 keys": ((2, 3, 5, 16), 9),
        "a single query (1, 1, 1, 4) over 6 keys": ((1, 1, 1, 4), 6),
    }.items():
        q, k, v = _qkv(gen, shape, tk)
        cases.append(Case(name, (q, k, v), expected=scaled_dot_product_attention(q, k, v)))
    return cases


@exercise("03-predict-shapes", "predicted_shapes", kind="value", points=1,
          hint="scores pair every query with every key; the output has one row per query and the "
               "value's width")
def _predict_shapes():
    """Predict the shapes of scores, weights and output for q (2, 4, 5, 16), k (2, 4, 7, 16), v (2, 4, 7, 32)."""
    return [Case("shapes of (scores, weights, output)", expected=((2, 4, 5, 7), (2, 4, 5, 7), (2, 4, 5, 32)),
                 compare="equal")]


@exercise("03-masked-attention", "masked_attention", points=3,
          forbid=_FORBID + ("attncourse.safe_softmax", "attncourse.sdpa.safe_softmax"),
          hint="fill blocked scores with -inf, subtract the row max where it is finite, and divide by "
               "the row sum only where it is positive, so an all-blocked row gives zeros, not NaN")
def _masked():
    """Attention under a boolean keep-mask that returns zeros for fully masked query rows."""
    gen = torch.Generator().manual_seed(5)
    cases = []
    q, k, v = _qkv(gen, (2, 2, 4, 8), 6)
    lengths = torch.tensor([6, 3])
    keep = (torch.arange(6) < lengths[:, None])[:, None, None, :]  # (B, 1, 1, Tk) padding mask
    cases.append(Case("padding mask, lengths [6, 3]", (q, k, v, keep),
                      expected=scaled_dot_product_attention(q, k, v, keep)))
    keep = torch.ones(4, 6, dtype=torch.bool).tril(diagonal=2)
    cases.append(Case("causal-like (4, 6) mask", (q, k, v, keep),
                      expected=scaled_dot_product_attention(q, k, v, keep)))
    keep = torch.ones(2, 2, 4, 6, dtype=torch.bool)
    keep[0, 1, 2] = False
    keep[1, :, 0] = False
    cases.append(Case("fully masked rows give zeros, not NaN", (q, k, v, keep),
                      expected=scaled_dot_product_attention(q, k, v, keep)))
    q16, k16, v16 = (x.to(torch.float16) for x in (q, k, v))
    cases.append(Case("float16 with a fully masked row", (q16, k16, v16, keep),
                      expected=scaled_dot_product_attention(q16, k16, v16, keep), rtol=2e-3, atol=2e-3))
    return cases


def _variances_ok(got) -> str | None:
    dims = (16, 64, 256)
    if not isinstance(got, (list, tuple)) or len(got) != len(dims):
        return f"expected a list of {len(dims)} variances (one per d_k in {dims}), got {got!r}"
    for d, var in zip(dims, got):
        if not isinstance(var, (int, float)):
            return f"variance for d_k={d} should be a float, got {type(var).__name__}"
        if not 0.85 * d <= var <= 1.15 * d:
            return (f"for d_k={d} the variance of q.k should be close to {d} (within 15%), got {var:.4g}; "
                    "did you use standard-normal entries and enough samples?")
    return None


@exercise("03-variance-experiment", "variances", kind="value", points=1,
          hint="draw q and k with torch.randn(n, d_k), take (q * k).sum(-1) and its .var() for "
               "each d_k in (16, 64, 256)")
def _variance():
    """Measure Var(q . k) for d_k in (16, 64, 256) with standard-normal entries."""
    return [Case("Var(q . k) is about d_k", compare=_variances_ok)]
