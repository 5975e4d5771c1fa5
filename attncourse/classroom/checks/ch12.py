"""Checks for chapter 12, attention variants and what heads learn (solutions/12_attention_variants.ipynb)."""

from __future__ import annotations

import torch

from attncourse.heads import induction_scores
from attncourse.variants import DifferentialAttention, diff_lambda_init, differential_attention, sigmoid_attention
from attncourse.vit import patchify
from . import Case, exercise


def _qkv(gen: torch.Generator, lead: tuple, tq: int, tk: int, d: int, dv: int, n: int = 1) -> list[torch.Tensor]:
    qs = [torch.randn(*lead, tq, d, generator=gen, dtype=torch.float64) for _ in range(n)]
    ks = [torch.randn(*lead, tk, d, generator=gen, dtype=torch.float64) for _ in range(n)]
    return [*qs, *ks, torch.randn(*lead, tk, dv, generator=gen, dtype=torch.float64)]


@exercise("12-sigmoid", "sigmoid_attn", points=2,
          forbid=("attncourse.sigmoid_attention", "attncourse.variants.sigmoid_attention"),
          hint="weights = torch.sigmoid(q @ k^T / sqrt(D) - log(Tk)), no normalisation over the row; with "
               "is_causal, query i sees keys 0..i only: give the other keys weight exactly 0 (a score of -inf)")
def _sigmoid():
    """Sigmoid attention with the bias b = -log(Tk), optionally causal."""
    gen = torch.Generator().manual_seed(120)
    cases = []
    for lead, tq, tk, d, dv, causal in (((2, 3), 5, 5, 8, 8, False), ((1, 2), 4, 9, 4, 6, False),
                                        ((2,), 6, 6, 8, 3, True), ((3, 1), 1, 7, 5, 5, False), ((2, 2), 7, 7, 4, 4, True)):
        q, k, v = _qkv(gen, lead, tq, tk, d, dv)
        cases.append(Case(f"q {tuple(q.shape)}, k {tuple(k.shape)}, is_causal={causal}", (q, k, v),
                          {"is_causal": causal}, expected=sigmoid_attention(q, k, v, is_causal=causal),
                          rtol=1e-7, atol=1e-9))
    return cases


@exercise("12-diff-attention", "diff_attn", points=3,
          forbid=("attncourse.differential_attention", "attncourse.variants.differential_attention"),
          hint="two maps A1 = softmax(q1 k1^T / sqrt(d)) and A2 = softmax(q2 k2^T / sqrt(d)) over the keys "
               "(last dim); the output is (A1 - lam * A2) @ v, with d the last dim of q1")
def _diff():
    """Differential attention (A1 - lambda A2) V from two softmax maps."""
    gen = torch.Generator().manual_seed(121)
    cases = []
    for lead, tq, tk, d, dv, lam in (((2, 2), 5, 5, 4, 8, 0.2), ((1, 3), 3, 7, 8, 16, 0.8), ((2,), 6, 4, 4, 8, 0.0),
                                     ((1, 1), 1, 9, 2, 4, 0.5), ((2, 2), 8, 8, 8, 16, -0.3)):
        q1, q2, k1, k2, v = _qkv(gen, lead, tq, tk, d, dv, n=2)
        cases.append(Case(f"q1 {tuple(q1.shape)}, k1 {tuple(k1.shape)}, v {tuple(v.shape)}, lam={lam}",
                          (q1, k1, q2, k2, v, lam), expected=differential_attention(q1, k1, q2, k2, v, lam),
                          rtol=1e-7, atol=1e-9))
    return cases


@exercise("12-predict", "predicted", kind="value", points=1,
          hint="lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1)); the projections of DifferentialAttention(d_model, H) "
               "are four d_model x d_model matrices (no bias), plus four lambda vectors of d = d_model / (2H) and an "
               "RMSNorm gain of 2d")
def _predict():
    """Predict lambda_init for layers 1 and 12, and the parameter count of DifferentialAttention(128, 4)."""
    count = sum(p.numel() for p in DifferentialAttention(128, 4).parameters())
    return [Case("(lambda_init at layer 1, lambda_init at layer 12, parameters of DifferentialAttention(128, 4))",
                 expected=(diff_lambda_init(1), diff_lambda_init(12), count), rtol=1e-4, atol=1e-6)]


def _random_maps(gen: torch.Generator, lead: tuple, t: int) -> torch.Tensor:
    s = torch.randn(*lead, t, t, generator=gen, dtype=torch.float64) * 2
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))  # causal
    return torch.softmax(s, -1)


@exercise("12-induction-score", "induction_score", points=2,
          forbid=("attncourse.induction_scores", "attncourse.heads.induction_scores"),
          hint="for queries t = L .. 2L-1 take the weight on key t - L + 1 and average them: "
               "weights.diagonal(offset=-(L - 1), dim1=-2, dim2=-1) holds A[t, t-L+1] for t = L-1 .. 2L-1")
def _induction_score():
    """Score every head's map for the induction pattern on a repeated sequence."""
    gen = torch.Generator().manual_seed(122)
    cases = []
    for lead, seg_len in (((3,), 4), ((2, 4), 6), ((1, 2, 3), 5), ((2,), 1)):
        w = _random_maps(gen, lead, 2 * seg_len)
        cases.append(Case(f"weights {tuple(w.shape)}, seg_len={seg_len}", (w, seg_len),
                          expected=induction_scores(w, seg_len), rtol=1e-7, atol=1e-9))
    return cases


def planted_induction_maps(gen: torch.Generator, n_layers: int, n_heads: int, seg_len: int, layer: int, head: int,
             strength: float) -> torch.Tensor:
    """Random causal maps (layers, H, 2L, 2L) with an induction stripe mixed into one head."""
    t = 2 * seg_len
    maps = _random_maps(gen, (n_layers, n_heads), t)
    stripe = torch.zeros(t, t, dtype=torch.float64)
    stripe[torch.arange(seg_len, t), torch.arange(1, seg_len + 1)] = 1.0
    stripe[:seg_len, 0] = 1.0  # first copy: nothing to copy, weight on the first token
    maps[layer, head] = (1 - strength) * maps[layer, head] + strength * stripe
    prev = torch.zeros(t, t, dtype=torch.float64)  # a previous-token head as a distractor
    prev[0, 0] = 1.0
    prev[torch.arange(1, t), torch.arange(t - 1)] = 1.0
    maps[0, (head + 1) % n_heads] = prev
    return maps


@exercise("12-find-head", "find_induction_head", points=1,
          hint="score every (layer, head) with your induction_score and return the position of the largest as a "
               "tuple of two Python ints: divmod(int(scores.argmax()), n_heads) on the (layers, H) scores")
def _find_head():
    """Return (layer, head) of the induction head in maps of shape (layers, H, 2L, 2L)."""
    gen = torch.Generator().manual_seed(123)
    cases = []
    for n_layers, n_heads, seg_len, layer, head, strength in ((2, 2, 6, 1, 0, 0.7), (2, 4, 8, 1, 3, 0.6),
                                                              (3, 4, 5, 2, 1, 0.5), (2, 3, 7, 1, 2, 0.4)):
        maps = planted_induction_maps(gen, n_layers, n_heads, seg_len, layer, head, strength)
        scores = induction_scores(maps, seg_len)  # (layers, H)
        expected = divmod(int(scores.argmax()), n_heads)
        assert expected == (layer, head)
        cases.append(Case(f"maps {tuple(maps.shape)}, seg_len={seg_len}", (maps, seg_len), expected=expected,
                          compare="equal"))
    return cases


@exercise("12-patchify", "my_patchify", points=2,
          forbid=("attncourse.patchify", "attncourse.vit.patchify", "torch.nn.functional.unfold"),
          hint="reshape (B, C, H, W) to (B, C, H/p, p, W/p, p), permute to (B, H/p, W/p, C, p, p), "
               "then reshape to (B, N, C*p*p): patches in row-major order, each flattened as (C, p, p)")
def _patchify():
    """Cut images (B, C, H, W) into flattened p x p patches (B, N, C p^2)."""
    gen = torch.Generator().manual_seed(124)
    cases = []
    for b, c, h, w, p in ((2, 1, 16, 16, 4), (1, 3, 8, 12, 4), (2, 2, 6, 6, 3), (1, 1, 5, 5, 5), (3, 2, 4, 6, 2)):
        x = torch.randn(b, c, h, w, generator=gen)
        cases.append(Case(f"images {tuple(x.shape)}, patch_size={p}", (x, p), expected=patchify(x, p),
                          compare="equal"))
    return cases
