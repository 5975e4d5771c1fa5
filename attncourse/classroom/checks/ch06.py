"""Checks for chapter 06, positions and ALiBi (solutions/06_positions_alibi.ipynb)."""

from __future__ import annotations

import torch

from attncourse.masks import causal_bottom_right, materialize
from attncourse.positions import alibi_bias, alibi_slopes, grouped_alibi_bias
from . import Case, exercise


@exercise("06-slopes-bug", "alibi_slopes_fixed", points=2,
          forbid=("attncourse.positions.alibi_slopes", "attncourse.alibi_slopes"),
          hint="when H is not a power of two, take the slopes of the closest smaller power of two p, "
               "then every other slope of 2p (2^(-4/p), 2^(-12/p), ...) until there are H")
def _slopes():
    """Fix a slope function that builds too few slopes when the head count is not a power of two."""
    return [Case(f"{h} heads", (h,), expected=alibi_slopes(h), rtol=1e-6, atol=1e-8)
            for h in (1, 4, 6, 8, 12, 20, 33)]


@exercise("06-decode-bias", "decode_alibi_bias", points=2,
          forbid=("attncourse.positions.alibi_bias", "attncourse.alibi_bias"),
          hint="queries are the last q_len of k_len positions: query i sits at i + k_len - q_len; the "
               "bias is slope_h * (j - position of i), and -inf where the key is in the query's future")
def _decode_bias():
    """ALiBi bias plus causal mask for Tq queries at the end of Tk cached positions, as (H, Tq, Tk)."""
    cases = []
    for h, tq, tk in ((4, 1, 6), (8, 3, 7), (6, 5, 5), (12, 2, 9)):
        keep = materialize(causal_bottom_right(tq, tk), tq, tk)
        expected = alibi_bias(h, tq, tk).masked_fill(~keep, float("-inf"))
        cases.append(Case(f"H={h}, Tq={tq}, Tk={tk}", (h, tq, tk), expected=expected, rtol=1e-6, atol=1e-7))
    return cases


@exercise("06-grouped-alibi", "add_grouped_alibi", points=2,
          hint="query head h = g * G + r belongs to KV head g (repeat_kv's order): view the (H, Tq, Tk) "
               "bias as (Hkv, G, Tq, Tk) and add it to the scores (B, Hkv, G, Tq, Tk)")
def _grouped():
    """Add ALiBi to grouped GQA scores (B, Hkv, G, Tq, Tk) so each query head keeps its own slope."""
    gen = torch.Generator().manual_seed(60)
    cases = []
    for b, h, hkv, tq, tk in ((2, 8, 2, 5, 5), (1, 12, 4, 1, 7), (2, 6, 1, 3, 6)):
        scores = torch.randn(b, hkv, h // hkv, tq, tk, generator=gen, dtype=torch.float64)
        expected = scores + grouped_alibi_bias(h, hkv, tq, tk).double()
        cases.append(Case(f"H={h}, Hkv={hkv}, Tq={tq}, Tk={tk}", (scores, h), expected=expected))
    return cases


@exercise("06-predict-bias", "predicted_biases", kind="value", points=1,
          hint="slopes for 8 heads are 1/2, 1/4, ..., 1/256; for 12 heads, heads 8..11 take 2^-0.5, "
               "2^-1.5, ...; the bias is slope * (j - i)")
def _predict():
    """Predict three ALiBi bias entries before computing them."""
    b8, b12 = alibi_bias(8, 6), alibi_bias(12, 6)
    expected = (b8[0, 5, 2].item(), b8[7, 5, 2].item(), b12[8, 4, 0].item())
    return [Case("(8 heads: head 0 at (5, 2), head 7 at (5, 2); 12 heads: head 8 at (4, 0))",
                 expected=expected, rtol=1e-4, atol=1e-6)]
