r"""The block today's decoder LLMs use: RMSNorm, SwiGLU, no biases, QK-norm, RoPE and grouped KV heads.

Against the 2017 block of :mod:`attncourse.transformer` it changes four things, each small:

* **RMSNorm** (Zhang and Sennrich 2019) instead of LayerNorm: no mean subtraction and no shift,
  ``y = x / sqrt(mean(x^2) + eps) * g``; normalised in float32 whatever the input's dtype (LLaMA, Qwen, Gemma).
* **SwiGLU** (Shazeer 2020) instead of ReLU: ``W_down (silu(W_gate x) * (W_up x))``. Three matrices instead of
  two, so the hidden width is about ``8/3 d`` (LLaMA) to keep the FFN at about ``8 d^2`` weights.
* **No biases** in any linear layer (PaLM, LLaMA).
* **QK-norm**: an RMSNorm over each head's query and key (``head_dim`` wide) before RoPE (Qwen3, Gemma 3;
  OLMo 2 normalises the whole projections), which bounds the logits and steadies training.

Pre-norm, as in GPT-2: ``h = x + Attn(norm1(x))``, ``y = h + FFN(norm2(h))``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate
from .mha import grouped_attention
from .positions import apply_rope, rope_inv_freq


class RMSNorm(nn.Module):
    """``x (..., d) -> x / sqrt(mean(x^2, -1) + eps) * weight``, computed in float32, returned in x's dtype.

    Equal to ``torch.nn.RMSNorm(d, eps)``. Raises ValueError for a non-positive ``d`` or ``eps``, or an input
    whose last dimension is not ``d``.
    """

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        _validate.positive_int("d", d)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
            raise ValueError(f"eps must be a positive number, got {eps!r}")
        self.d, self.eps = d, float(eps)
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _validate.tensor("x", x, floating=True)
        if x.shape[-1] != self.d:
            raise ValueError(f"x must end in d={self.d}, got shape {tuple(x.shape)}")
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., d)
        return (y * self.weight.to(y.dtype)).to(x.dtype)


def swiglu_hidden(d_model: int, multiple_of: int = 8) -> int:
    """LLaMA's hidden width: ``8/3 d_model`` rounded up to a multiple of ``multiple_of`` (256 in LLaMA-1/2)."""
    _validate.positive_int("d_model", d_model)
    _validate.positive_int("multiple_of", multiple_of)
    hidden = int(8 * d_model / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


class SwiGLU(nn.Module):
    """``x (..., d) -> w_down(silu(w_gate(x)) * w_up(x))``, no biases; hidden width ``d_ff`` (default
    :func:`swiglu_hidden`). Raises ValueError for a non-positive width."""

    def __init__(self, d_model: int, d_ff: int | None = None):
        super().__init__()
        _validate.positive_int("d_model", d_model)
        d_ff = swiglu_hidden(d_model) if d_ff is None else _validate.positive_int("d_ff", d_ff)
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))  # (..., d) -> (..., d_ff) -> (..., d)


class ModernBlock(nn.Module):
    """A pre-norm decoder block of a 2025 LLM: RMSNorm, causal GQA with RoPE and optional QK-norm, SwiGLU.

    Args:
        d_model: width d; n_heads: query heads H (d divisible by H); n_kv_heads: KV heads (default H; H divisible
            by it); d_ff: SwiGLU hidden width (default :func:`swiglu_hidden`); qk_norm: RMSNorm on each head's q and
            k before RoPE; rope_base: RoPE base (halves layout); eps: RMSNorm epsilon.
    ``forward(x (B, T, d)) -> (B, T, d)``, causal. Raises ValueError for widths that do not divide.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *, d_ff: int | None = None,
                 qk_norm: bool = True, rope_base: float = 10000.0, eps: float = 1e-6):
        super().__init__()
        _validate.positive_int("d_model", d_model)
        _validate.positive_int("n_heads", n_heads)
        n_kv_heads = n_heads if n_kv_heads is None else _validate.positive_int("n_kv_heads", n_kv_heads)
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be divisible by n_kv_heads={n_kv_heads}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = hd = d_model // n_heads
        self.norm1, self.norm2 = RMSNorm(d_model, eps), RMSNorm(d_model, eps)
        self.q_proj = nn.Linear(d_model, n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(n_heads * hd, d_model, bias=False)
        self.q_norm = RMSNorm(hd, eps) if qk_norm else None
        self.k_norm = RMSNorm(hd, eps) if qk_norm else None
        self.ffn = SwiGLU(d_model, d_ff)
        self.register_buffer("inv_freq", rope_inv_freq(hd, rope_base), persistent=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """The attention sublayer alone: x (B, T, d) -> (B, T, d), causal."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)     # (B, H, T, hd)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        if self.q_norm is not None:  # per head, over head_dim, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        pos = torch.arange(t, device=x.device)
        q, k = (apply_rope(z, pos, inv_freq=self.inv_freq) for z in (q, k))
        out = grouped_attention(q, k, v, is_causal=True)                                # (B, H, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _validate.tensor("x", x, floating=True)
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, T, d_model={self.d_model}), got shape {tuple(x.shape)}")
        h = x + self.attention(self.norm1(x))   # (B, T, d)
        return h + self.ffn(self.norm2(h))      # (B, T, d)
