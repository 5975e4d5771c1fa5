r"""Two replacements for softmax attention: sigmoid attention and differential attention.

**Sigmoid attention** (Ramapuram et al., 2024) scores every key on its own, with no normalisation over the row:

.. math:: \mathrm{SigmoidAttn}(Q, K, V) = \sigma\!\left(\frac{QK^\top}{\sqrt{d}} + b\right) V, \qquad b = -\log n

where n is the sequence length (here the number of keys, :math:`T_k`). A row's weights no longer sum to 1;
the bias :math:`-\log n` keeps their sum near 1 at initialisation, which the authors found necessary for
stable training.

**Differential attention** (Ye et al., 2024) splits each head's queries and keys in two halves, computes
two softmax maps and subtracts them, so that attention both maps give to irrelevant keys (common-mode
noise) cancels:

.. math:: \mathrm{DiffAttn}(X) = \left(\mathrm{softmax}\!\left(\frac{Q_1 K_1^\top}{\sqrt d}\right)
   - \lambda\, \mathrm{softmax}\!\left(\frac{Q_2 K_2^\top}{\sqrt d}\right)\right) V

with the learnable scalar :math:`\lambda = e^{\lambda_{q1}\cdot\lambda_{k1}} - e^{\lambda_{q2}\cdot\lambda_{k2}}
+ \lambda_{init}` (one per layer, shared by its heads), :math:`\lambda_{init} = 0.8 - 0.6\, e^{-0.3 (l - 1)}`
for layer l = 1, 2, ..., and each head's output normalised by RMSNorm and scaled by :math:`1 - \lambda_{init}`.
Queries and keys have head dim d = d_model / (2H); values 2d, so H differential heads cost what 2H
standard heads of dim d cost.

Both compute attention themselves (with :func:`attncourse.sdpa.apply_mask` and
:func:`attncourse.sdpa.safe_softmax` for the masks and the softmax maps), never PyTorch's fused kernel, in float32
for half-precision inputs (:func:`attncourse.sdpa.compute_dtype`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import _validate
from .mha import MultiHeadAttention, merge_heads, repeat_kv, split_heads
from .sdpa import _check_qkv, apply_mask, compute_dtype, safe_softmax


def sigmoid_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    bias: float | None = None,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Sigmoid attention of `query` (..., Tq, D) over `key` (..., Tk, D) and `value` (..., Tk, Dv).

    weights = sigmoid(q k^T * scale + bias + mask), each entry on its own (rows do not sum to 1).

    Args:
        attn_mask: boolean (True = may attend) or float (added to the scores), broadcastable to
            (..., Tq, Tk). A blocked key gets weight exactly 0 (sigmoid(-inf) = 0).
        is_causal: top-left aligned causal mask, as in :func:`attncourse.scaled_dot_product_attention`.
        scale: defaults to 1/sqrt(D).
        bias: the scalar b; defaults to -log(Tk) (Ramapuram et al.'s -log n).
        return_weights: also return the weights (..., Tq, Tk).

    Returns:
        out (..., Tq, Dv), and the weights if asked, in the input dtype. Half-precision inputs are computed in
        float32 (:func:`attncourse.sdpa.compute_dtype`) and rounded once at the end.
    """
    _check_qkv(query, key, value)
    k_len = key.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if bias is None:
        bias = -math.log(k_len)
    if isinstance(bias, bool) or not isinstance(bias, (int, float)):
        raise TypeError(f"bias must be a float or None, got {type(bias).__name__}")

    # Scores and sigmoid in float32 at least (sdpa.compute_dtype), as the softmax path does: in half precision
    # the rounding of q k^T (scores of size ~10 keep 3 decimal digits) and of the sigmoid would dominate.
    work = compute_dtype(query.dtype)
    scores = (query.to(work) @ key.to(work).transpose(-2, -1)) * scale + bias  # (..., Tq, D) @ (..., D, Tk)
    # -> (..., Tq, Tk)
    scores = apply_mask(scores, attn_mask, is_causal=is_causal)

    weights = torch.sigmoid(scores)  # (..., Tq, Tk), each entry in [0, 1]; no sum over the row
    out = weights @ value.to(work)  # (..., Tq, Tk) @ (..., Tk, Dv) -> (..., Tq, Dv), accumulated in `work`
    out, weights = out.to(value.dtype), weights.to(value.dtype)
    return (out, weights) if return_weights else out


class SigmoidAttention(MultiHeadAttention):
    """:class:`~attncourse.MultiHeadAttention` (same projections, MHA/GQA/MQA) with sigmoid weights.

    Args:
        d_model, n_heads, n_kv_heads, bias: as :class:`~attncourse.MultiHeadAttention`.
        score_bias: the scalar b added to every score; None means -log(Tk) at each call.

    No KV cache: ``forward`` takes the same arguments as the parent's except ``kv_cache``.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *, bias: bool = False,
                 score_bias: float | None = None):
        super().__init__(d_model, n_heads, n_kv_heads, bias=bias)
        if score_bias is not None and (isinstance(score_bias, bool) or not isinstance(score_bias, (int, float))):
            raise TypeError(f"score_bias must be a float or None, got {type(score_bias).__name__}")
        self.score_bias = score_bias

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *,
                attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                return_weights: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d_model), context (B, S, d_model) or None -> (B, T, d_model) [, weights (B, H, T, S)]."""
        q, k, v = self.project_qkv(x, context)  # (B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, D)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)  # (B, Hkv, S, D) -> (B, H, S, D)
        out, weights = sigmoid_attention(q, k, v, attn_mask, is_causal=is_causal, bias=self.score_bias,
                                         return_weights=True)  # (B, H, T, D), (B, H, T, S)
        out = self.o_proj(merge_heads(out))  # (B, H, T, D) -> (B, T, d_model)
        return (out, weights) if return_weights else out


def diff_lambda_init(layer: int) -> float:
    r"""Ye et al.'s :math:`\lambda_{init} = 0.8 - 0.6\, e^{-0.3 (l - 1)}` for layer l = 1, 2, ... (0.2 at l = 1)."""
    _validate.positive_int("layer", layer)
    return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))


def differential_attention(
    q1: torch.Tensor,
    k1: torch.Tensor,
    q2: torch.Tensor,
    k2: torch.Tensor,
    value: torch.Tensor,
    lam: float | torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""(softmax(q1 k1^T s) - lam softmax(q2 k2^T s)) value, before the per-head norm of the full layer.

    Args:
        q1, q2: (..., Tq, d); k1, k2: (..., Tk, d); value: (..., Tk, Dv) (2d in Ye et al.).
        lam: the scalar lambda (a float, or a tensor with one element, which may require grad).
        attn_mask, is_causal: as :func:`attncourse.scaled_dot_product_attention`, applied to both maps.
        scale: defaults to 1/sqrt(d).
        return_weights: also return the differential map (..., Tq, Tk) (entries may be negative).

    Returns:
        out (..., Tq, Dv), and the map if asked. With lam = 0 this is softmax attention of (q1, k1).

    The two maps are subtracted first and multiply the values once, ``(A1 - lam A2) @ value`` (one value matmul
    of Dv = 2d per head); ``A1 @ value - lam * (A2 @ value)``, two attention calls, gives the same result with
    twice the value FLOPs. Scores, softmax and the value matmul run in float32 for half precision
    (:func:`attncourse.sdpa.compute_dtype`), rounded once at the end.
    """
    _check_qkv(q2, k2, value)
    if q1.shape != q2.shape or k1.shape != k2.shape:
        raise ValueError(f"q1/q2 and k1/k2 must have equal shapes, got q1 {tuple(q1.shape)}, q2 {tuple(q2.shape)}, "
                         f"k1 {tuple(k1.shape)}, k2 {tuple(k2.shape)}")
    if q1.dtype != q2.dtype or k1.dtype != k2.dtype:
        raise TypeError(f"q1, k1, q2, k2 and value must share a dtype, got q1 {q1.dtype}, k1 {k1.dtype}, "
                        f"q2 {q2.dtype}, k2 {k2.dtype}")
    if isinstance(lam, torch.Tensor):
        if lam.numel() != 1:
            raise ValueError(f"lam must be a scalar (one element), got shape {tuple(lam.shape)}")
        lam = lam.reshape(())
    elif isinstance(lam, bool) or not isinstance(lam, (int, float)):
        raise TypeError(f"lam must be a float or a one-element tensor, got {type(lam).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(q1.shape[-1])
    work = compute_dtype(value.dtype)  # float32 for half precision: the difference of two maps cancels digits

    def softmax_map(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = (q.to(work) @ k.to(work).transpose(-2, -1)) * scale  # (..., Tq, d) @ (..., d, Tk) -> (..., Tq, Tk)
        return safe_softmax(apply_mask(scores, attn_mask, is_causal=is_causal))  # fully masked rows give zeros

    if isinstance(lam, torch.Tensor):
        lam = lam.to(work)
    weights = softmax_map(q1, k1) - lam * softmax_map(q2, k2)  # (..., Tq, Tk): A1 - lam A2, entries may be < 0
    out = weights @ value.to(work)  # ONE value matmul: (..., Tq, Tk) @ (..., Tk, Dv) -> (..., Tq, Dv)
    out, weights = out.to(value.dtype), weights.to(value.dtype)
    return (out, weights) if return_weights else out


class DifferentialAttention(nn.Module):
    """Multi-head differential attention (Ye et al., 2024), as in the authors' reference code.

    Args:
        d_model: model width; divisible by 2 * n_heads. Each head: q1, q2, k1, k2 of dim
            d = d_model / (2 n_heads), values of dim 2d.
        n_heads: differential heads H (Ye et al. use half the heads of the Transformer they compare with).
        layer: 1-based layer index l, giving lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1)).
        lambda_init: overrides the value from `layer` (e.g. 0 to study the limit).
        bias: whether the four projections have a bias (the paper's have none).
        eps: RMSNorm epsilon.

    Parameters: ``4 d_model^2`` (projections) + ``4 d`` (the lambda vectors) + ``2 d`` (RMSNorm gain).
    """

    def __init__(self, d_model: int, n_heads: int, *, layer: int = 1, lambda_init: float | None = None,
                 bias: bool = False, eps: float = 1e-5):
        super().__init__()
        _validate.positive_int("d_model", d_model)
        _validate.positive_int("n_heads", n_heads)
        _validate.positive_int("layer", layer)
        if d_model % (2 * n_heads):
            raise ValueError(f"d_model={d_model} must be divisible by 2 * n_heads={2 * n_heads}")
        self.d_model, self.n_heads = d_model, n_heads
        self.head_dim = d = d_model // (2 * n_heads)  # dim of q1, q2, k1, k2; values have 2d
        self.lambda_init = diff_lambda_init(layer) if lambda_init is None else float(lambda_init)
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)
        # lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init; N(0, 0.1) init as in the reference code.
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.randn(d) * 0.1) for _ in range(4))
        self.subln = nn.RMSNorm(2 * d, eps=eps)  # per-head norm over the head's 2d output features

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, lambda_init={self.lambda_init:.4f}"

    def lam(self) -> torch.Tensor:
        """The current lambda (a 0-dim tensor, differentiable in the four lambda vectors)."""
        return (torch.exp(self.lambda_q1 @ self.lambda_k1) - torch.exp(self.lambda_q2 @ self.lambda_k2)
                + self.lambda_init)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *,
                attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                return_weights: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d_model), context (B, S, d_model) or None -> (B, T, d_model) [, map (B, H, T, S)]."""
        for name, t in (("x", x), ("context", context)):
            if t is not None:
                _validate.tensor(name, t, floating=True)
                if t.dim() != 3 or t.shape[-1] != self.d_model:
                    raise ValueError(f"{name} must be (B, T, d_model={self.d_model}), got shape {tuple(t.shape)}")
        src = x if context is None else context
        h = self.n_heads
        q = split_heads(self.q_proj(x), 2 * h)  # (B, T, d_model) -> (B, 2H, T, d)
        k = split_heads(self.k_proj(src), 2 * h)  # (B, S, d_model) -> (B, 2H, S, d)
        v = split_heads(self.v_proj(src), h)  # (B, S, d_model) -> (B, H, S, 2d)
        # Adjacent pairs (2i, 2i+1) are head i's two halves, as the reference code's view(B, H, 2, T, S).
        out, weights = differential_attention(q[:, 0::2], k[:, 0::2], q[:, 1::2], k[:, 1::2], v, self.lam(),
                                              attn_mask, is_causal=is_causal, return_weights=True)
        out = self.subln(out) * (1.0 - self.lambda_init)  # (B, H, T, 2d), RMSNorm per head
        out = self.o_proj(merge_heads(out))  # (B, H, T, 2d) -> (B, T, d_model)
        return (out, weights) if return_weights else out
