r"""Multi-head attention in one module: MHA, grouped-query (GQA) and multi-query (MQA) attention.

.. math:: \mathrm{MHA}(X, C) = \mathrm{Concat}(\mathrm{head}_1, \dots, \mathrm{head}_H)\, W^O, \quad
   \mathrm{head}_h = \mathrm{Attention}(X W^Q_h,\; C W^K_{g(h)},\; C W^V_{g(h)})

with ``g(h) = h // (H / H_kv)``: query head h reads key/value head g(h). ``n_kv_heads = n_heads`` is
MHA (Vaswani et al.), ``n_kv_heads = 1`` MQA (Shazeer), anything in between GQA (Ainslie et al.).
Attention itself is :func:`attncourse.scaled_dot_product_attention`, never PyTorch's fused kernel.

KV-cache protocol (the cache class lives in chapter 07): when ``kv_cache`` is given, the module calls
``k, v = kv_cache.update(k, v)`` with the new keys and values (B, Hkv, T_new, D) and attends over
everything returned (B, Hkv, S_total, D); ``is_causal`` then aligns the mask bottom-right, so query i
sits at absolute position ``i + S_total - T_new`` and token-by-token decoding equals a full forward.

GQA/MQA attend through :func:`grouped_attention`, which never copies K/V per query head (the cache is
read as is; :func:`repeat_kv` is kept to show the copy it makes). With ``rope_base`` set, q and k are
rotated (RoPE, halves layout) at their absolute positions; with a cache, new tokens continue from the
cache's length (its ``seen`` count), so keys are stored rotated and cached decoding equals a full forward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from . import _validate
from .positions import apply_rope, check_rope_scaling, rope_attention_factor, rope_inv_freq
from .sdpa import compute_dtype, safe_softmax, scaled_dot_product_attention


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, H*D) -> (B, H, T, D): the last dim is cut into `n_heads` consecutive chunks."""
    _validate.tensor("x", x, min_rank=3)
    _validate.positive_int("n_heads", n_heads)
    if x.dim() != 3 or x.shape[-1] % n_heads:
        raise ValueError(f"x must be (B, T, H*D) with last dim divisible by n_heads={n_heads}, "
                         f"got shape {tuple(x.shape)}")
    b, t, hd = x.shape
    return x.view(b, t, n_heads, hd // n_heads).transpose(1, 2)  # (B, T, H, D) -> (B, H, T, D)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H*D): the inverse of :func:`split_heads`."""
    _validate.tensor("x", x, min_rank=4)
    if x.dim() != 4:
        raise ValueError(f"x must be (B, H, T, D), got shape {tuple(x.shape)}")
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)  # (B, H, T, D) -> (B, T, H, D) -> (B, T, H*D)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, T, D) -> (B, Hkv*n_rep, T, D); KV head h serves query heads h*n_rep .. h*n_rep+n_rep-1.

    Same order as ``x.repeat_interleave(n_rep, dim=1)``. ``expand`` is free (a stride-0 view), but the
    final ``reshape`` cannot be a view of an expanded tensor, so it copies: n_rep times the memory.
    """
    _validate.tensor("x", x, min_rank=4)
    _validate.positive_int("n_rep", n_rep)
    if x.dim() != 4:
        raise ValueError(f"x must be (B, Hkv, T, D), got shape {tuple(x.shape)}")
    if n_rep == 1:
        return x
    b, h_kv, t, d = x.shape
    x = x[:, :, None].expand(b, h_kv, n_rep, t, d)  # (B, Hkv, 1, T, D) -> (B, Hkv, n_rep, T, D)
    return x.reshape(b, h_kv * n_rep, t, d)  # (B, Hkv*n_rep, T, D)


def _grouped_mask(attn_mask: torch.Tensor, b: int, h: int, h_kv: int, t: int, s: int) -> torch.Tensor:
    """A mask broadcastable to (B, H, T, S), reshaped to broadcast to (B, Hkv, G, T, S)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    _validate.broadcastable("attn_mask", tuple(attn_mask.shape), (b, h, t, s), "scores (B, H, T, S)")
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))  # (b', h', T', S')
    if m.shape[1] == 1:
        return m[:, :, None]  # (b', 1, 1, T', S')
    return m.reshape(m.shape[0], h_kv, h // h_kv, m.shape[2], m.shape[3])  # head h -> (h // G, h % G)


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, *, is_causal: bool = False,
                      scale: float | None = None, return_weights: bool = False
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """GQA without repeating K/V: query (B, H, T, D), key/value (B, Hkv, S, D) -> (B, H, T, D).

    The G = H / Hkv query heads of a group are stacked along the time axis, so one matmul per KV head
    serves the whole group; scores have shape (B, Hkv, G, T, S). Masks as in
    :func:`~attncourse.scaled_dot_product_attention` (broadcastable to (B, H, T, S); `is_causal` top-left).
    ``query.reshape`` is a free view only when query is contiguous in (H, T, D) order (always when T = 1);
    otherwise it copies the queries, never the keys and values.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        _validate.tensor(name, x, min_rank=1, floating=True)
        if x.dim() != 4:
            raise ValueError(f"{name} must be (B, heads, T, D), got shape {tuple(x.shape)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    (b, h, t, d), (bk, h_kv, s, dk) = query.shape, key.shape
    if b != bk or value.shape[:3] != key.shape[:3] or h % h_kv or d != dk:
        raise ValueError(f"need query (B, H, T, D) and key/value (B, Hkv, S, D) with H divisible by Hkv, got "
                         f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    g = h // h_kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    # Half precision: scores, softmax and the weighted sum in float32, rounded once (a no-op, no copy, otherwise).
    work = compute_dtype(query.dtype)
    q = query.reshape(b, h_kv, g * t, d).to(work)  # (B, H, T, D) -> (B, Hkv, G*T, D): a view when contiguous
    scores = (q @ key.to(work).transpose(-2, -1)) * scale  # (B, Hkv, G*T, D) @ (B, Hkv, D, S) -> (B, Hkv, G*T, S)
    scores = scores.view(b, h_kv, g, t, s)  # (B, Hkv, G, T, S)
    if attn_mask is not None:
        m = _grouped_mask(attn_mask, b, h, h_kv, t, s)
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.to(scores.dtype)
    if is_causal:
        scores = scores.masked_fill(~torch.ones(t, s, dtype=torch.bool, device=scores.device).tril(), float("-inf"))
    weights = safe_softmax(scores)  # (B, Hkv, G, T, S)
    out = weights.reshape(b, h_kv, g * t, s) @ value.to(work)  # (B, Hkv, G*T, S) @ (B, Hkv, S, Dv) -> (B, Hkv, G*T, Dv)
    out = out.view(b, h, t, value.shape[-1]).to(value.dtype)  # (B, H, T, Dv)
    return (out, weights.reshape(b, h, t, s).to(value.dtype)) if return_weights else out


def causal_mask_bottom_right(q_len: int, k_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean (Tq, Tk) mask where query i (absolute position i + Tk - Tq) sees keys 0 .. i + Tk - Tq."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


def _combine_masks(attn_mask: torch.Tensor | None, allowed: torch.Tensor) -> torch.Tensor:
    """Merge a user mask (bool or float) with a boolean keep-mask `allowed` (Tq, Tk)."""
    if attn_mask is None:
        return allowed
    if attn_mask.dtype == torch.bool:
        return attn_mask & allowed
    return attn_mask.masked_fill(~allowed, float("-inf"))


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with `n_heads` query heads sharing `n_kv_heads` key/value heads.

    Args:
        d_model: model width; must be divisible by `n_heads` (head_dim = d_model // n_heads).
        n_heads: query heads H.
        n_kv_heads: key/value heads Hkv (None means H: MHA; 1 is MQA); H must be divisible by it.
        bias: whether the four projections have a bias.
        rope_base: None (no RoPE) or the RoPE base (10000 in most models): q and k rotated, halves layout.
        rope_scaling: None or a scaling dict of :func:`~attncourse.positions.rope_inv_freq` (needs
            rope_base); YaRN's attention factor multiplies q and k.

    Parameters: ``2 d^2 + 2 d Hkv D`` weights, i.e. ``4 d^2`` for MHA without bias.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *, bias: bool = False,
                 rope_base: float | None = None, rope_scaling: dict | None = None):
        super().__init__()
        _validate.positive_int("d_model", d_model)
        _validate.positive_int("n_heads", n_heads)
        n_kv_heads = n_heads if n_kv_heads is None else _validate.positive_int("n_kv_heads", n_kv_heads)
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be divisible by n_kv_heads={n_kv_heads}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.n_rep = n_heads // n_kv_heads  # query heads per KV head (the group size)
        kv_dim = n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, kv_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, kv_dim, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)
        self.set_rope(rope_base, rope_scaling)

    def set_rope(self, rope_base: float | None, rope_scaling: dict | None = None) -> None:
        """Turn RoPE on (base, optional scaling), change its scaling (context extension), or off (None)."""
        if rope_base is None:
            if rope_scaling is not None:
                raise ValueError(f"rope_scaling={rope_scaling!r} needs a rope_base, got rope_base=None")
            self.rope_base, self.rope_scaling, self.rope_factor = None, None, 1.0
            self.register_buffer("inv_freq", None, persistent=False)
            return
        self.rope_scaling = check_rope_scaling(rope_scaling)
        inv_freq = rope_inv_freq(self.head_dim, rope_base, scaling=self.rope_scaling)  # (D/2,), validates base
        self.rope_base, self.rope_factor = float(rope_base), rope_attention_factor(self.rope_scaling)
        self.register_buffer("inv_freq", inv_freq.to(self.q_proj.weight.device), persistent=False)

    def extra_repr(self) -> str:
        rope = "" if self.rope_base is None else f", rope_base={self.rope_base:g}, rope_scaling={self.rope_scaling}"
        return f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}{rope}"

    def rotate(self, q: torch.Tensor, k: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q (B, H, T, D) and k (B, Hkv, T, D) at positions offset .. offset + T - 1."""
        pos = torch.arange(offset, offset + q.shape[-2], device=q.device)  # (T,)
        q, k = (apply_rope(t, pos, inv_freq=self.inv_freq) for t in (q, k))
        if self.rope_factor != 1.0:  # YaRN: scale cos and sin, i.e. q and k, as Hugging Face does
            q, k = q * self.rope_factor, k * self.rope_factor
        return q, k

    def _check_inputs(self, x: torch.Tensor, context: torch.Tensor | None) -> None:
        for name, t in (("x", x), ("context", context)):
            if t is None:
                continue
            _validate.tensor(name, t, min_rank=1, floating=True)
            if t.dim() != 3 or t.shape[-1] != self.d_model:
                raise ValueError(f"{name} must be (B, T, d_model={self.d_model}), got shape {tuple(t.shape)}")
        if context is not None and context.shape[0] != x.shape[0]:
            raise ValueError(f"x and context must share the batch dim, got x {tuple(x.shape)} "
                             f"and context {tuple(context.shape)}")

    def project_qkv(self, x: torch.Tensor, context: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, H, T, D) from x; keys and values (B, Hkv, S, D) from context (default x)."""
        self._check_inputs(x, context)
        src = x if context is None else context
        q = split_heads(self.q_proj(x), self.n_heads)  # (B, T, d) -> (B, H, T, D)
        k = split_heads(self.k_proj(src), self.n_kv_heads)  # (B, S, Hkv*D) -> (B, Hkv, S, D)
        v = split_heads(self.v_proj(src), self.n_kv_heads)  # (B, S, Hkv*D) -> (B, Hkv, S, D)
        return q, k, v

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *,
                attn_mask: torch.Tensor | None = None, is_causal: bool = False, kv_cache: Any = None,
                return_weights: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d_model), context (B, S, d_model) or None -> (B, T, d_model).

        attn_mask: bool (True = may attend) or float (added), broadcastable to (B, H, T, S_total).
        return_weights: also return the attention weights (B, H, T, S_total).
        """
        q, k, v = self.project_qkv(x, context)
        if self.rope_base is not None:
            if context is not None:
                raise ValueError("RoPE rotates self-attention by position; got a context (cross-attention) "
                                 f"of shape {tuple(context.shape)} with rope_base={self.rope_base}")
            offset = 0 if kv_cache is None else int(getattr(kv_cache, "seen", len(kv_cache)))
            q, k = self.rotate(q, k, offset)  # keys enter the cache rotated at their absolute positions
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # (B, Hkv, S_total, D) each: everything cached so far
        if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if is_causal and kv_cache is not None:  # queries are the last T_new positions
            attn_mask = _combine_masks(attn_mask, causal_mask_bottom_right(q.shape[-2], k.shape[-2], q.device))
            is_causal = False
        attend = scaled_dot_product_attention if self.n_rep == 1 else grouped_attention  # no K/V copy
        out, weights = attend(q, k, v, attn_mask, is_causal=is_causal,
                              return_weights=True)  # (B, H, T, D), (B, H, T, S)
        out = self.o_proj(merge_heads(out))  # (B, H, T, D) -> (B, T, d_model)
        return (out, weights) if return_weights else out
