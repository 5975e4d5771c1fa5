r"""Multi-head latent attention (MLA, DeepSeek-V2): cache a small latent instead of keys and values.

Keys and values are compressed jointly into a latent ``c_kv = x W_DKV`` of ``kv_rank`` numbers per token,
and expanded per head by up-projections (``k_h = c_kv W_UK_h``, ``v_h = c_kv W_UV_h``). RoPE does not
commute with the up-projection, so position is carried by a separate, decoupled key of ``rope_dim`` numbers,
shared by all heads (``k_rope = RoPE(x W_KR)``), concatenated to each head's key. The cache holds only
``c_kv`` and ``k_rope``: ``kv_rank + rope_dim`` numbers per token and layer, whatever the number of heads.

.. math:: \text{bytes} = L \cdot (r_{kv} + d_{rope}) \cdot T \cdot B \cdot \text{bytes per element}
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import _validate
from .positions import apply_rope, rope_inv_freq
from .sdpa import safe_softmax


def mla_cache_bytes(n_layers: int, kv_rank: int, rope_dim: int, seq_len: int, batch_size: int = 1,
                    bytes_per_element: int = 2) -> int:
    """Bytes of an MLA cache: the latent (kv_rank) and the RoPE key (rope_dim) per token and layer."""
    for name, v in (("n_layers", n_layers), ("kv_rank", kv_rank), ("rope_dim", rope_dim), ("seq_len", seq_len),
                    ("batch_size", batch_size), ("bytes_per_element", bytes_per_element)):
        _validate.positive_int(name, v)
    return n_layers * (kv_rank + rope_dim) * seq_len * batch_size * bytes_per_element


def mla_as_mha_cache_bytes(n_layers: int, n_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                           v_head_dim: int, seq_len: int, batch_size: int = 1, bytes_per_element: int = 2) -> int:
    """Bytes the same layers would cache as multi-head attention: per head a key of ``qk_nope_head_dim +
    qk_rope_head_dim`` numbers and a value of ``v_head_dim`` (DeepSeek-V2's comparison, its Table 1).

    Raises ValueError when an argument is not a positive int."""
    for name, v in (("n_layers", n_layers), ("n_heads", n_heads), ("qk_nope_head_dim", qk_nope_head_dim),
                    ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim), ("seq_len", seq_len),
                    ("batch_size", batch_size), ("bytes_per_element", bytes_per_element)):
        _validate.positive_int(name, v)
    per_head = qk_nope_head_dim + qk_rope_head_dim + v_head_dim
    return n_layers * n_heads * per_head * seq_len * batch_size * bytes_per_element


class MLACache:
    """What MLA caches per layer: the latent c_kv (B, S, kv_rank) and the shared RoPE key (B, S, rope_dim)."""

    def __init__(self) -> None:
        self.c_kv: torch.Tensor | None = None
        self.k_rope: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.c_kv is None else self.c_kv.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.c_kv, self.k_rope) if t is not None)

    def update(self, c_kv: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.c_kv is not None:
            c_kv, k_rope = torch.cat([self.c_kv, c_kv], 1), torch.cat([self.k_rope, k_rope], 1)  # (B, S, .)
        self.c_kv, self.k_rope = c_kv, k_rope
        return c_kv, k_rope


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V2's MLA (causal self-attention), naive or with the up-projections absorbed.

    Per token: ``c_kv = x W_DKV`` (kv_rank), per head ``k_h = [c_kv W_UK_h, k_rope]`` and ``v_h = c_kv W_UV_h``
    (head_dim each; k_rope = RoPE(x W_KR) of rope_dim, shared by the heads), ``q_h = [q_nope_h, RoPE(q_rope_h)]``
    from x (or from a latent ``c_q = x W_DQ`` of q_rank). Scores scale by 1/sqrt(head_dim + rope_dim).

    ``absorbed=True`` never expands keys or values: ``q_nope_h . (c_kv W_UK_h) = (q_nope_h W_UK_h^T) . c_kv``, so
    queries are mapped into the latent space and attend over c_kv directly; the weighted sum of c_kv is expanded by
    W_UV_h afterwards (it could be folded into W_O). The heads are folded into the query axis, so the H*T query rows
    of a sequence read its one latent (and one RoPE key), never a per-head copy of them, at any batch size (the
    grouped trick of lesson 05 with one KV head). Equal to the naive form up to rounding.
    """

    def __init__(self, d_model: int, n_heads: int, *, kv_rank: int, head_dim: int, rope_dim: int,
                 q_rank: int | None = None, rope_base: float = 10000.0):
        super().__init__()
        for name, v in (("d_model", d_model), ("n_heads", n_heads), ("kv_rank", kv_rank), ("head_dim", head_dim),
                        ("rope_dim", rope_dim)):
            _validate.positive_int(name, v)
        if rope_dim % 2:
            raise ValueError(f"rope_dim must be even (RoPE rotates pairs), got {rope_dim}")
        if q_rank is not None:
            _validate.positive_int("q_rank", q_rank)
        self.d_model, self.n_heads, self.kv_rank = d_model, n_heads, kv_rank
        self.head_dim, self.rope_dim, self.q_rank = head_dim, rope_dim, q_rank
        q_out = n_heads * (head_dim + rope_dim)
        if q_rank is None:
            self.q_proj = nn.Linear(d_model, q_out, bias=False)
        else:
            self.q_proj = nn.Sequential(nn.Linear(d_model, q_rank, bias=False), nn.Linear(q_rank, q_out, bias=False))
        self.kv_down = nn.Linear(d_model, kv_rank, bias=False)  # W_DKV
        self.k_up = nn.Linear(kv_rank, n_heads * head_dim, bias=False)  # W_UK
        self.v_up = nn.Linear(kv_rank, n_heads * head_dim, bias=False)  # W_UV
        self.k_rope_proj = nn.Linear(d_model, rope_dim, bias=False)  # W_KR, one key for all heads
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(rope_dim, rope_base), persistent=False)

    def forward(self, x: torch.Tensor, *, is_causal: bool = False, kv_cache: MLACache | None = None,
                absorbed: bool = False) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model); with `kv_cache`, x continues the cached tokens."""
        _validate.tensor("x", x, min_rank=1, floating=True)
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, T, d_model={self.d_model}), got shape {tuple(x.shape)}")
        if kv_cache is not None and not isinstance(kv_cache, MLACache):
            raise TypeError(f"kv_cache must be an MLACache or None, got {type(kv_cache).__name__}")
        b, t, _ = x.shape
        h, dn, dr = self.n_heads, self.head_dim, self.rope_dim
        offset = 0 if kv_cache is None else len(kv_cache)
        pos = torch.arange(offset, offset + t, device=x.device)  # (T,) absolute positions
        q = self.q_proj(x).view(b, t, h, dn + dr).transpose(1, 2)  # (B, H, T, dn + dr)
        q_nope, q_rope = q[..., :dn], apply_rope(q[..., dn:], pos, inv_freq=self.inv_freq)  # (B, H, T, dn), (.., dr)
        c_kv = self.kv_down(x)  # (B, T, r)
        k_rope = apply_rope(self.k_rope_proj(x), pos, inv_freq=self.inv_freq)  # (B, T, dr)
        if kv_cache is not None:
            c_kv, k_rope = kv_cache.update(c_kv, k_rope)  # (B, S, r), (B, S, dr)
        s = c_kv.shape[1]
        # Heads folded into the query axis: the H*T query rows of a batch element meet its one k_rope (no per-head
        # copy of the cache, which a broadcasting (B, H, T, .) @ (B, 1, ., S) matmul makes when B > 1).
        rope_scores = (q_rope.reshape(b, h * t, dr) @ k_rope.transpose(1, 2)).view(b, h, t, s)  # (B, H, T, S)
        w_uk = self.k_up.weight.view(h, dn, self.kv_rank)  # (H, dn, r)
        w_uv = self.v_up.weight.view(h, dn, self.kv_rank)  # (H, dn, r)
        if absorbed:  # per head (H, B*T, .) @ (H, ., .) for the weights, heads folded into queries for the cache
            q_lat = q_nope.transpose(0, 1).reshape(h, b * t, dn) @ w_uk  # (H, B*T, r): W_UK folded into the query
            q_lat = q_lat.view(h, b, t, self.kv_rank).transpose(0, 1).reshape(b, h * t, self.kv_rank)  # (B, H*T, r)
            nope_scores = (q_lat @ c_kv.transpose(1, 2)).view(b, h, t, s)  # (B, H*T, r) @ (B, r, S) -> (B, H, T, S)
        else:
            k_nope = (c_kv @ self.k_up.weight.T).view(b, s, h, dn).transpose(1, 2)  # (B, S, H*dn) -> (B, H, S, dn)
            nope_scores = q_nope @ k_nope.transpose(-2, -1)  # (B, H, T, S)
        scores = (nope_scores + rope_scores) / math.sqrt(dn + dr)
        if is_causal:  # queries are the last T of S positions
            keep = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(diagonal=s - t)
            scores = scores.masked_fill(~keep, float("-inf"))
        weights = safe_softmax(scores.float()).to(x.dtype)  # (B, H, T, S)
        if absorbed:
            ctx = weights.reshape(b, h * t, s) @ c_kv  # (B, H*T, S) @ (B, S, r) -> (B, H*T, r): mix latents first
            ctx = ctx.view(b, h, t, self.kv_rank).transpose(0, 1).reshape(h, b * t, self.kv_rank)  # (H, B*T, r)
            out = (ctx @ w_uv.transpose(-2, -1)).view(h, b, t, dn).transpose(0, 1)  # (B, H, T, dn): W_UV after
        else:
            v = (c_kv @ self.v_up.weight.T).view(b, s, h, dn).transpose(1, 2)  # (B, H, S, dn)
            out = weights @ v  # (B, H, T, dn)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, h * dn))  # (B, T, H*dn) -> (B, T, d_model)


# Published MLA shapes (config.json of deepseek-ai/DeepSeek-V2 and DeepSeek-V3; DeepSeek-V2 paper, sec. 2.1).
MLA_CONFIGS = {
    "DeepSeek-V2": dict(n_layers=60, d_model=5120, n_heads=128, kv_rank=512, q_rank=1536, head_dim=128, rope_dim=64),
    "DeepSeek-V3": dict(n_layers=61, d_model=7168, n_heads=128, kv_rank=512, q_rank=1536, head_dim=128, rope_dim=64),
}


def mla_config_cache_bytes(name: str, seq_len: int, batch_size: int = 1, bytes_per_element: int = 2) -> int:
    """:func:`mla_cache_bytes` of a published config in :data:`MLA_CONFIGS`."""
    if name not in MLA_CONFIGS:
        raise ValueError(f"no MLA config named {name!r}; known: {sorted(MLA_CONFIGS)}")
    c = MLA_CONFIGS[name]
    return mla_cache_bytes(c["n_layers"], c["kv_rank"], c["rope_dim"], seq_len, batch_size, bytes_per_element)


def mla_decode_attention_cost(n_heads: int, kv_rank: int, rope_dim: int, context_len: int,
                              bytes_per_element: int = 2) -> dict[str, float]:
    """One layer, one sequence, one generated token of absorbed MLA: attention FLOPs, cache bytes read, ratio.

    Absorbed MLA is MQA over one shared key ``[c_kv, k_rope]`` of ``kv_rank + rope_dim`` numbers and one shared
    value ``c_kv`` of ``kv_rank`` numbers, read by all ``n_heads`` query heads. FLOPs:
    ``2 H S (r + d_rope)`` for the scores and ``2 H S r`` for the weighted sum of latents (the up-projections,
    applied once per head and token, are not counted, as :func:`attncourse.gqa.decode_attention_cost` counts no
    projection). Bytes: the cache, ``S (r + d_rope)`` elements (the value is the key's first r numbers).
    Raises ValueError for a non-positive argument.
    """
    for name, v in (("n_heads", n_heads), ("kv_rank", kv_rank), ("rope_dim", rope_dim),
                    ("context_len", context_len), ("bytes_per_element", bytes_per_element)):
        _validate.positive_int(name, v)
    flops = 2 * n_heads * context_len * (kv_rank + rope_dim) + 2 * n_heads * context_len * kv_rank
    cache_bytes = context_len * (kv_rank + rope_dim) * bytes_per_element
    return {"flops": flops, "kv_bytes": cache_bytes, "flops_per_byte": flops / cache_bytes}


def mla_attention_flops(n_heads: int, kv_rank: int, rope_dim: int, head_dim: int, n_new: int, context_len: int,
                        v_head_dim: int | None = None) -> dict[str, int]:
    """Attention FLOPs of one MLA layer and sequence, `n_new` new queries over `context_len` tokens (the new ones
    included), in the two forms of :class:`MultiHeadLatentAttention`; projections from x (shared) not counted.

    * ``expanded``: every cached latent is expanded to per-head keys and values, ``2 S r H (d_h + d_v)``, then
      ordinary MHA over a key of ``d_h + d_rope`` and a value of ``d_v``: ``2 H T S (d_h + d_rope + d_v)``;
    * ``absorbed``: each query is mapped into the latent, ``2 H T d_h r``, attends over the ``r + d_rope`` wide
      cache and mixes ``r``-wide latents, ``2 H T S (2 r + d_rope)``, and the result is expanded, ``2 H T r d_v``.

    Scores are counted dense (all T x S, as the module computes them before masking). The expansion is paid once
    per step whatever T is, the absorbed form's wider dot products once per query: absorbing wins for few queries
    (decode), expanding for many (prefill). Raises ValueError for a non-positive argument or n_new > context_len.
    """
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    for name, v in (("n_heads", n_heads), ("kv_rank", kv_rank), ("rope_dim", rope_dim), ("head_dim", head_dim),
                    ("v_head_dim", v_head_dim), ("n_new", n_new), ("context_len", context_len)):
        _validate.positive_int(name, v)
    if n_new > context_len:
        raise ValueError(f"n_new must be <= context_len (the new tokens are part of it), got {n_new} > {context_len}")
    h, r, dr, dn, dv, t, s = n_heads, kv_rank, rope_dim, head_dim, v_head_dim, n_new, context_len
    expanded = 2 * s * r * h * (dn + dv) + 2 * h * t * s * (dn + dr + dv)
    absorbed = 2 * h * t * dn * r + 2 * h * t * s * (2 * r + dr) + 2 * h * t * r * dv
    return {"expanded": expanded, "absorbed": absorbed}


def matmul_flops(fn) -> int:
    """FLOPs of the matrix products ``fn()`` runs: ``2 m k n`` for every ATen ``mm``/``addmm`` and ``b`` times that
    for ``bmm``/``baddbmm`` (what ``@``, ``nn.Linear`` and batched matmuls dispatch to), counted by intercepting ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    total = 0
    products = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}  # op -> argument indices of A, B

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal total
            name = func.overloadpacket.__name__
            if name in products:
                a, b = (args[i] for i in products[name])
                total += 2 * a.numel() * b.shape[-1]  # (.., m, k) @ (.., k, n): 2 m k n per batch entry
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return total
