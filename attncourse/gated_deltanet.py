r"""The whole Gated DeltaNet layer (Yang, Kautz and Hatamizadeh 2024, arXiv:2412.06464) around the gated delta rule
of :mod:`attncourse.linear_attention`, with the state cache that decodes it one token at a time.

The layer follows flash-linear-attention's ``fla/layers/gated_deltanet.py`` (the layout Qwen3-Next uses), written
afresh in plain PyTorch. For an input :math:`x_t \in \mathbb{R}^{d}`:

1. q, k, v = short causal depthwise convolutions (kernel 4) of :math:`W_q x, W_k x, W_v x`, each followed by SiLU;
2. q and k divided by their L2 norm per head; the scale :math:`D_k^{-1/2}` on q;
3. :math:`\beta_t = \sigma(W_b x_t)`, one per head; the log-decay
   :math:`g_t = -e^{A_\log}\,\mathrm{softplus}(W_a x_t + \delta)`, one per head (Mamba-2's parametrisation);
4. the gated delta rule (:func:`attncourse.linear_attention.chunked`, or the recurrence at decode);
5. per head, RMSNorm of the output times :math:`\mathrm{SiLU}(W_g x_t)` (the output gate), then :math:`W_o`.

What a sequence keeps between decode steps (:class:`GDNCache`): the last ``conv_size - 1`` projected inputs of each
convolution and the (H, Dk, Dv) state, whatever the length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _validate
from . import linear_attention as la


@dataclass
class GDNCache:
    """What one layer keeps per sequence at decode: ``conv`` (B, conv_size - 1, channels), the last projected q, k, v
    inputs of the short convolutions, and ``state`` (B, H, Dk, Dv), the gated delta rule's state."""

    conv: torch.Tensor
    state: torch.Tensor

    def nbytes(self) -> int:
        """Bytes held, independent of the number of tokens seen."""
        return self.conv.numel() * self.conv.element_size() + self.state.numel() * self.state.element_size()


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet token mixer: (B, T, d_model) -> (B, T, d_model), with an optional :class:`GDNCache`.

    Args: d_model; n_heads; head_dim (Dk, the key and query size per head); expand_v (Dv = expand_v * head_dim);
    conv_size (the short convolution's kernel, 4 in fla and Qwen3-Next); chunk_size (of the chunkwise form);
    eps (of the output RMSNorm). Raises ValueError/TypeError for sizes that are not positive ints.
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, expand_v: int = 1, conv_size: int = 4,
                 chunk_size: int = 64, eps: float = 1e-5) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("head_dim", head_dim),
                            ("expand_v", expand_v), ("conv_size", conv_size), ("chunk_size", chunk_size)):
            _validate.positive_int(name, value)
        self.n_heads, self.dk, self.dv = n_heads, head_dim, head_dim * expand_v
        self.conv_size, self.chunk_size, self.eps = conv_size, chunk_size, eps
        key_dim, value_dim = n_heads * self.dk, n_heads * self.dv
        self.channels = (key_dim, key_dim, value_dim)
        self.q_proj, self.k_proj = nn.Linear(d_model, key_dim, bias=False), nn.Linear(d_model, key_dim, bias=False)
        self.v_proj = nn.Linear(d_model, value_dim, bias=False)
        self.a_proj, self.b_proj = nn.Linear(d_model, n_heads, bias=False), nn.Linear(d_model, n_heads, bias=False)
        self.g_proj = nn.Linear(d_model, value_dim, bias=False)
        self.o_proj = nn.Linear(value_dim, d_model, bias=False)
        # one depthwise causal filter per channel of q, k and v together: (channels, conv_size)
        self.conv_weight = nn.Parameter(torch.randn(sum(self.channels), conv_size) / math.sqrt(conv_size))
        self.A_log = nn.Parameter(torch.log(torch.empty(n_heads).uniform_(1, 16)))  # decay rates, as fla
        dt = torch.exp(torch.empty(n_heads).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt at start
        self.o_norm_weight = nn.Parameter(torch.ones(self.dv))

    def empty_cache(self, batch: int, dtype: torch.dtype = torch.float32) -> GDNCache:
        """A cache for a sequence that has seen no token yet."""
        _validate.positive_int("batch", batch)
        return GDNCache(torch.zeros(batch, self.conv_size - 1, sum(self.channels), dtype=dtype),
                        torch.zeros(batch, self.n_heads, self.dk, self.dv, dtype=dtype))

    def _conv(self, x: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise convolution over (B, T, C) with the previous `tail` (B, conv_size - 1, C) in front."""
        full = torch.cat([tail, x], dim=1)  # (B, K-1+T, C)
        windows = full.unfold(1, self.conv_size, 1)  # (B, T, C, K): the K inputs ending at each token
        return F.silu((windows * self.conv_weight).sum(-1)), full[:, -(self.conv_size - 1):]

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta), each (B, H, T): g = -exp(A_log) softplus(W_a x + dt_bias) <= 0, beta = sigmoid(W_b x)."""
        g = -self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)  # (B,T,H)
        return g.transpose(1, 2), torch.sigmoid(self.b_proj(x)).transpose(1, 2)

    def forward(self, x: torch.Tensor, cache: GDNCache | None = None,
                recurrent: bool = False) -> tuple[torch.Tensor, GDNCache]:
        """x (B, T, d_model) -> (y (B, T, d_model), the cache after the last token). With `cache` the sequence goes
        on from it (decode); `recurrent=True` steps token by token instead of the chunkwise form."""
        _validate.tensor("x", x, min_rank=3, floating=True)
        if x.dim() != 3 or x.shape[-1] != self.q_proj.in_features:
            raise ValueError(f"x must be (B, T, d_model = {self.q_proj.in_features}), got {tuple(x.shape)}")
        B, T, _ = x.shape
        if cache is None:
            cache = self.empty_cache(B, x.dtype)
        qkv, tail = self._conv(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1), cache.conv)
        q, k, v = qkv.split(self.channels, dim=-1)  # (B,T,H*Dk) twice, (B,T,H*Dv)
        heads = (lambda t, d: t.reshape(B, T, self.n_heads, d).transpose(1, 2))  # (B,T,H*d) -> (B,H,T,d)
        q, k, v = F.normalize(heads(q, self.dk), dim=-1), F.normalize(heads(k, self.dk), dim=-1), heads(v, self.dv)
        g, beta = self.gates(x)
        form = la.recurrent if recurrent else (lambda *a, **kw: la.chunked(*a, chunk_size=self.chunk_size, **kw))
        o, state = form(q, k, v, g, beta, initial_state=cache.state)  # (B,H,T,Dv), (B,H,Dk,Dv)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm_weight  # RMSNorm per head
        o = o * F.silu(heads(self.g_proj(x), self.dv))  # the output gate
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1)), GDNCache(tail, state)


# ----------------------------------------------------------------------------- a hybrid stack with its caches


class CachedAttention(nn.Module):
    """Causal multi-head softmax attention with a KV cache: (B, T, d_model) -> (B, T, d_model). The cache is a pair
    (K, V) of (B, H, T_seen, head_dim) that grows by one key and one value per head and token."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("head_dim", head_dim)):
            _validate.positive_int(name, value)
        self.n_heads, self.head_dim = n_heads, head_dim
        self.qkv = nn.Linear(d_model, 3 * n_heads * head_dim, bias=False)
        self.out = nn.Linear(n_heads * head_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x (B, T, d_model), cache (K, V) or None -> (y (B, T, d_model), the cache with T more tokens)."""
        from .sdpa import scaled_dot_product_attention

        B, T, _ = x.shape
        q, k, v = (t.reshape(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)  # (B,H,T_seen+T,hd)
        seen = k.shape[2] - T
        mask = torch.arange(k.shape[2], device=x.device) <= seen + torch.arange(T, device=x.device)[:, None]  # (T,Tk)
        o = scaled_dot_product_attention(q, k, v, mask)  # (B,H,T,hd), the course's own attention
        return self.out(o.transpose(1, 2).reshape(B, T, -1)), (k, v)


class HybridStack(nn.Module):
    """Pre-norm residual blocks (RMSNorm, token mixer, RMSNorm, SiLU MLP) whose mixers follow `pattern`: ``"G"`` a
    :class:`GatedDeltaNet`, ``"A"`` a :class:`CachedAttention`; ``"GGGA" * 2`` is Qwen3-Next's 3:1 schedule.
    ``forward(x, caches)`` -> (y, caches), one cache per layer (a :class:`GDNCache` or a (K, V) pair).
    Raises ValueError for a pattern with other letters."""

    def __init__(self, pattern: str, d_model: int, n_heads: int, head_dim: int, chunk_size: int = 64) -> None:
        super().__init__()
        if not pattern or set(pattern) - {"G", "A"}:
            raise ValueError(f"pattern must be a non-empty string of 'G' and 'A', got {pattern!r}")
        self.pattern = pattern
        self.mixers = nn.ModuleList(
            GatedDeltaNet(d_model, n_heads, head_dim, chunk_size=chunk_size) if c == "G"
            else CachedAttention(d_model, n_heads, head_dim) for c in pattern)
        self.norms = nn.ModuleList(nn.RMSNorm(d_model) for _ in range(2 * len(pattern)))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.SiLU(),
                                                nn.Linear(4 * d_model, d_model)) for _ in pattern)

    def forward(self, x: torch.Tensor, caches: list | None = None, recurrent: bool = False) -> tuple[torch.Tensor, list]:
        """x (B, T, d_model) -> (y (B, T, d_model), the caches after the last token). `recurrent` steps the Gated
        DeltaNet layers token by token (decode) instead of chunk by chunk (prefill, training)."""
        caches = caches if caches is not None else [None] * len(self.pattern)
        new = []
        for i, (kind, mixer, mlp) in enumerate(zip(self.pattern, self.mixers, self.mlps)):
            h = self.norms[2 * i](x)
            out, cache = mixer(h, caches[i], recurrent=recurrent) if kind == "G" else mixer(h, caches[i])
            x = x + out
            x = x + mlp(self.norms[2 * i + 1](x))
            new.append(cache)
        return x, new


def cache_bytes(caches: list) -> tuple[int, int]:
    """(bytes in the Gated DeltaNet caches, bytes in the KV caches) of a :class:`HybridStack`'s caches."""
    fixed = sum(c.nbytes() for c in caches if isinstance(c, GDNCache))
    growing = sum(t.numel() * t.element_size() for c in caches if isinstance(c, tuple) for t in c)
    return fixed, growing
