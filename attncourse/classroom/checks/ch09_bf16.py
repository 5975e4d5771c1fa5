"""Chapter 9, exercise 4's references: attention on bfloat16 inputs, written out so that every operation's result
rounds to bfloat16 (in the orders of operations a learner may choose), at the tiled kernel's precision, and the band
of errors the legitimate orders span. Split from :mod:`.ch09` at the module-size limit."""

from __future__ import annotations

import math

import torch

from attncourse.flash import flash_attention
from attncourse.sdpa import scaled_dot_product_attention


def _causal_scores(q: torch.Tensor, k: torch.Tensor, scale_first: bool) -> torch.Tensor:
    """q k^T / sqrt(d) with the future masked to -inf, in the inputs' dtype; the scale on q first or on the product."""
    t, d = q.shape[-2], q.shape[-1]
    scores = (q / math.sqrt(d)) @ k.transpose(-2, -1) if scale_first else q @ k.transpose(-2, -1) / math.sqrt(d)
    return scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))  # (..., T, T)


def _bf16_formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale_first: bool = False,
                  normalise: str = "before") -> torch.Tensor:
    """softmax(q k^T / sqrt(d), causal) v written out on bfloat16 tensors, every operation's result rounded to
    bfloat16: scores, their row max, exp, row sum, the division and both products (each operation accumulates inside
    as PyTorch does, then rounds its result). `normalise`: "before" divides P = e / l before P V, "after" divides
    (e V) / l, "torch" uses torch.softmax on the bfloat16 scores (which on CPU computes in float32 and rounds P
    once: the mildest spelling)."""
    scores = _causal_scores(q, k, scale_first)
    if normalise == "torch":
        return torch.softmax(scores, dim=-1) @ v
    e = torch.exp(scores - scores.amax(-1, keepdim=True))  # (..., T, T): rounded to bfloat16
    total = e.sum(-1, keepdim=True)  # (..., T, 1): rounded to bfloat16
    return (e / total) @ v if normalise == "before" else (e @ v) / total


def _fp32_formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same formula untiled, computed in float32 from the bfloat16 inputs and rounded to bfloat16 once at the end:
    the tiled kernel's precision without its tiles."""
    q, k, v = (x.float() for x in (q, k, v))
    return (torch.softmax(_causal_scores(q, k, False), dim=-1) @ v).to(torch.bfloat16)


# "every intermediate in bfloat16" leaves the order of operations to the learner, and the largest error moves with it
# (up to 1.8x between these spellings in the check's draws): the check accepts the band they span, widened by BAND
BF16_SPELLINGS = tuple((first, how) for first in (False, True) for how in ("before", "after", "torch"))
BAND = (0.75, 1.3)


def bf16_error_band(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
    """(min, max) over BF16_SPELLINGS of the all-bfloat16 formula's largest error against float64 attention."""
    exact = scaled_dot_product_attention(*(x.double() for x in (q, k, v)), is_causal=True)
    errs = [float((_bf16_formula(q, k, v, scale_first=f, normalise=n).double() - exact).abs().max())
            for f, n in BF16_SPELLINGS]
    return min(errs), max(errs)


def bf16_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float, float]:
    """Reference: the largest absolute error, against float64 attention of the same bfloat16 inputs (causal), of
    (flash_attention, the untiled formula at the tiled kernel's precision, the formula written out in bfloat16 with
    the scale on the product and P normalised before P V)."""
    exact = scaled_dot_product_attention(*(x.double() for x in (q, k, v)), is_causal=True)
    outs = (flash_attention(q, k, v, is_causal=True), _fp32_formula(q, k, v), _bf16_formula(q, k, v))
    return tuple(float((o.double() - exact).abs().max()) for o in outs)


def all_bf16_refusal(got: float, band: tuple[float, float]) -> str | None:
    """None when an all-bfloat16 error lies in the band the legitimate spellings span (widened by BAND)."""
    lo, hi = band[0] * BAND[0], band[1] * BAND[1]
    if lo <= got <= hi:
        return None
    return (f"the all-bfloat16 error is {got:.3g}; written in bfloat16 every operation's result rounds to bfloat16, and "
            f"the orders of operations that do so give {lo:.3g} to {hi:.3g} here (scale on q or on the product, "
            "P normalised before or after P V): check that no step computes in float32 or float64 and the mask")
