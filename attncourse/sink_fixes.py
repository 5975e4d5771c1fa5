r"""Four more 2024-2025 answers to attention sinks and to the logit growth behind massive activations (chapter 12).

Each changes one step of softmax attention and leaves the rest alone:

- :func:`softpick` / :func:`softpick_attention` (Zuhri et al. 2025, "Softpick: No Attention Sink, No Massive
  Activations with Rectified Softmax"): :math:`\mathrm{ReLU}(e^{x_i} - 1) / \sum_j |e^{x_j} - 1|`. A score
  :math:`\le 0` gets weight exactly 0 and a row whose scores are all :math:`\le 0` is all zeros, so a head with
  nothing to read needs no sink; the row sums to at most 1.
- :func:`qk_norm_attention` (Dehghani et al. 2023, ViT-22B; OLMo 2, Qwen3): RMS-normalise each head's queries and
  keys (with a learned gain) before the dot product, so a score is bounded by :math:`\sqrt{D}\,|g_q|\,|g_k|` and
  cannot grow with the activations' norm.
- :func:`softcap_attention` (Gemma 2, Gemma Team 2024): :math:`c \tanh(x / c)` on the scaled scores
  (``attn_logit_softcapping = 50.0`` in Gemma 2's config), a smooth bound on every logit.
- :func:`ssmax_attention` (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention"): multiply the scores of a
  query that sees :math:`n` keys by :math:`s \log n` (one learned :math:`s` per head), so the weight a key with a
  fixed lead over the others gets does not fade as :math:`n` grows.

All take (B, H, Tq, D) queries and (B, H, Tk, D) keys and values, compute scores and weights in float32 for
half-precision inputs, and take ``is_causal`` (top-left, as ``F.scaled_dot_product_attention``).
"""

from __future__ import annotations

import torch

from . import _validate
from .mha import MultiHeadAttention, merge_heads, repeat_kv
from .sdpa import causal_mask, compute_dtype
from .sink_variants import SinkLogitAttention

__all__ = ["softpick", "softpick_attention", "qk_norm_attention", "softcap_attention", "ssmax_attention",
           "SoftpickAttention", "SoftmaxOneAttention"]


def _check(query, key, value) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        _validate.tensor(name, t, floating=True)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or key.shape[:2] != query.shape[:2] or \
            key.shape[-1] != query.shape[-1] or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"query (B, H, Tq, D), key (B, H, Tk, D) and value (B, H, Tk, Dv) needed, got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")


def _scores(query, key, scale, is_causal):
    work = compute_dtype(query.dtype)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    scores = (query.to(work) @ key.to(work).transpose(-2, -1)) * scale  # (B,H,Tq,D) @ (B,H,D,Tk) -> (B,H,Tq,Tk)
    keep = causal_mask(*scores.shape[-2:], device=scores.device) if is_causal else None  # (Tq, Tk)
    return scores, keep


def _finish(weights, value, return_weights):
    out = (weights @ value.to(weights.dtype)).to(value.dtype)  # (B,H,Tq,Tk) @ (B,H,Tk,Dv) -> (B,H,Tq,Dv)
    return (out, weights) if return_weights else out


def softpick(x: torch.Tensor, dim: int = -1, *, eps: float = 1e-6) -> torch.Tensor:
    r""":math:`\mathrm{ReLU}(e^{x_i} - 1) / (\sum_j |e^{x_j} - 1| + \epsilon)` along `dim`, computed with the row's
    maximum :math:`m` factored out (numerator and denominator times :math:`e^{-m}`, as the paper's stable form), so
    large scores do not overflow. ``-inf`` entries (masked) count as 0 in both. Rows sum to at most 1."""
    _validate.tensor("x", x, min_rank=1, floating=True)
    m = x.amax(dim=dim, keepdim=True).clamp_min(0.0)  # >= 0: e^{-m} <= 1 keeps the "-1" representable
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a fully masked row
    shifted = torch.exp(x - m) - torch.exp(-m)  # e^{-m} (e^x - 1); -inf entries give -e^{-m}
    shifted = torch.where(torch.isneginf(x), torch.zeros_like(shifted), shifted)  # masked: no term at all
    return torch.relu(shifted) / (shifted.abs().sum(dim=dim, keepdim=True) + eps * torch.exp(-m))


def softpick_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attn_mask: torch.Tensor | None = None, *, is_causal: bool = False,
                       scale: float | None = None, eps: float = 1e-6, return_weights: bool = False):
    """Attention with :func:`softpick` in place of softmax. `attn_mask`: bool, True = may attend, broadcastable to
    (B, H, Tq, Tk). Returns (B, H, Tq, Dv) (and the weights)."""
    _check(query, key, value)
    scores, keep = _scores(query, key, scale, is_causal)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        _validate.tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool:
            raise TypeError(f"attn_mask must be bool (True = may attend), got {attn_mask.dtype}")
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return _finish(softpick(scores, -1, eps=eps), value, return_weights)


def softcap_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cap: float = 50.0, *,
                      is_causal: bool = False, scale: float | None = None, return_weights: bool = False):
    r"""Softmax attention on soft-capped scores :math:`c \tanh(x / c)` (Gemma 2: ``cap = 50``). Every logit lies in
    :math:`(-c, c)`; for :math:`|x| \ll c` the cap changes nothing."""
    _check(query, key, value)
    if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not cap > 0:
        raise ValueError(f"cap must be a positive number, got {cap!r}")
    scores, keep = _scores(query, key, scale, is_causal)
    scores = cap * torch.tanh(scores / cap)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return _finish(torch.softmax(scores, -1), value, return_weights)


def ssmax_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, s: torch.Tensor | float, *,
                    is_causal: bool = False, scale: float | None = None, return_weights: bool = False):
    r"""Scalable-Softmax: :math:`\mathrm{softmax}(s \log n \cdot x)` where :math:`n` is the number of keys the
    query sees (Tk, or ``i + 1`` for query ``i`` when causal) and `s` one scalar per head, (H,), or a float."""
    _check(query, key, value)
    heads = query.shape[1]
    s = torch.as_tensor(s, dtype=compute_dtype(query.dtype), device=query.device)
    if s.dim() == 0:
        s = s.expand(heads)
    if s.shape != (heads,):
        raise ValueError(f"s must be a float or (H,) = ({heads},), got {tuple(s.shape)}")
    scores, keep = _scores(query, key, scale, is_causal)
    t_q, t_k = scores.shape[-2:]
    n = torch.arange(1, t_q + 1, device=scores.device).clamp_max(t_k) if is_causal else \
        torch.full((t_q,), t_k, device=scores.device)  # (Tq,) keys each query sees
    scores = scores * (s.to(scores.dtype).view(-1, 1, 1) * torch.log(n.to(scores.dtype)).view(1, -1, 1))
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return _finish(torch.softmax(scores, -1), value, return_weights)


def qk_norm_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor | None = None,
                      k_weight: torch.Tensor | None = None, *, eps: float = 1e-6, is_causal: bool = False,
                      scale: float | None = None, return_weights: bool = False):
    r"""Softmax attention on RMS-normalised queries and keys: :math:`\hat q = g_q \odot q / \mathrm{rms}(q)`,
    likewise :math:`\hat k`, per head over the last dim (gains (D,), default 1). With unit gains every scaled score
    lies in :math:`[-\sqrt{D}, \sqrt{D}]`."""
    _check(query, key, value)
    d = query.shape[-1]
    work = compute_dtype(query.dtype)
    normed = []
    for name, x, g in (("q_weight", query, q_weight), ("k_weight", key, k_weight)):
        if g is not None:
            _validate.tensor(name, g, floating=True)
            if g.shape != (d,):
                raise ValueError(f"{name} must be (D,) = ({d},), got {tuple(g.shape)}")
        x = x.to(work)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (B, H, T, D): unit RMS per vector
        normed.append(x if g is None else x * g.to(work))
    scores, keep = _scores(normed[0], normed[1], scale, is_causal)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return _finish(torch.softmax(scores, -1), value, return_weights)


class SoftpickAttention(MultiHeadAttention):
    """:class:`~attncourse.MultiHeadAttention` with :func:`softpick` in place of softmax (Zuhri et al. 2025), a
    drop-in layer of lesson 12's attention-only model (``AttnOnlyConfig(attention="softpick")``).
    ``forward(x, *, attn_mask=None, is_causal=False, return_weights=False)``: self-attention only."""

    def forward(self, x: torch.Tensor, *, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                return_weights: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d_model) -> (B, T, d_model) [, weights (B, H, T, T)]."""
        q, k, v = self.project_qkv(x)  # (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)  # (B, H, T, D)
        out, weights = softpick_attention(q, k, v, attn_mask, is_causal=is_causal, return_weights=True)
        out = self.o_proj(merge_heads(out))  # (B, H, T, D) -> (B, T, d_model)
        return (out, weights) if return_weights else out


class SoftmaxOneAttention(SinkLogitAttention):
    """Miller's (2023) softmax_1, :math:`e^{x_i} / (1 + \\sum_j e^{x_j})`: gpt-oss's sink logit frozen at 0 (the
    parameter ``sinks`` stays, all zeros, with ``requires_grad=False``, so an optimiser never moves it)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *, bias: bool = False):
        super().__init__(d_model, n_heads, n_kv_heads, bias=bias)
        self.sinks.requires_grad_(False)
