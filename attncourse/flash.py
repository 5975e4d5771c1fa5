r"""FlashAttention by tiling, in plain PyTorch: a tiled forward with an online softmax, and a backward
by recomputation (FlashAttention-2 style), so neither pass ever holds a :math:`T_q \times T_k` matrix.

Forward (Dao et al. 2022, Algorithm 1, loops ordered as in FlashAttention-2): for each block of
queries, walk over the blocks of keys keeping, per query row, a running max :math:`m`, a running sum
:math:`\ell` and an unnormalised output :math:`\tilde O`; a new block with scores :math:`S` updates

.. math:: m' = \max(m, \mathrm{rowmax}\,S),\quad P = e^{S - m'},\quad
          \ell' = e^{m - m'}\ell + \mathrm{rowsum}\,P,\quad \tilde O' = e^{m - m'}\tilde O + P V.

At the end :math:`O = \tilde O / \ell` and :math:`\mathrm{lse} = m + \log \ell`.

Backward: with :math:`D_i = \sum_c dO_{ic} O_{ic}`, each block of :math:`P = e^{S - \mathrm{lse}}` is rebuilt
from the saved lse, then :math:`dV \mathrel{+}= P^\top dO`, :math:`dP = dO\,V^\top`,
:math:`dS = P \circ (dP - D)`, :math:`dQ \mathrel{+}= dS\,K \cdot s`, :math:`dK \mathrel{+}= dS^\top Q \cdot s`.

The signature is chapter 10's Triton kernel's: grouped KV heads (query head h reads KV head h // (H / Hkv), with
no copy of K and V: the G query heads of a group are stacked as rows of one tile, so each tile of K is one matrix
product for the whole group), ``causal_align`` top-left or bottom-right, and a causal ``window``; key tiles
outside the band are never visited (:class:`attncourse.flash_io.Band`). ``q_offset`` / ``k_offset`` place the
query and key blocks in a longer sequence, so a ring or block-sparse loop can call
:func:`flash_attention_forward` and :func:`flash_attention_backward` once per key block and merge by lse.

The tiles are large and each step runs on all batch and head rows at once (CPU-friendly: a few big
matrix products per tile, no Python loop over rows).
"""

from __future__ import annotations

import math

import torch

from . import _validate
from .flash_io import ALIGNS, check_causal_options  # noqa: F401  (ALIGNS re-exported)
from .flash_io import (Band, HBMTraffic, TrafficCounter, causal_block_counts, causal_tile_map,  # noqa: F401
                       check_int, check_qkv, flash_block_sizes, hbm_traffic_fa2,
                       hbm_traffic_flash, hbm_traffic_standard_backward,
                       hbm_traffic_standard, theorem2_bound, tile_map)
from .sdpa import compute_dtype as _compute_dtype  # half precision tiles accumulate in float32

__all__ = ["ALIGNS", "FlashAttentionFunction", "default_block_sizes", "flash_attention", "flash_attention_backward",
           "flash_attention_forward", "causal_tile_map", "causal_block_counts", "hbm_traffic_standard",
           "hbm_traffic_flash", "hbm_traffic_fa2",
           "hbm_traffic_standard_backward", "flash_block_sizes", "theorem2_bound", "HBMTraffic", "Band",
           "TrafficCounter", "tile_map"]

_NEG_INF = float("-inf")
_LOG2E = 1.0 / math.log(2.0)  # scores are kept in base 2 inside the tiles: exp2 is cheaper than exp on CPU (lesson 09 times both)


def default_block_sizes(device: torch.device | str = "cpu", *, backward: bool = False) -> tuple[int, int]:
    """The (block_q, block_k) that `flash_attention` uses when none are given.

    On a CPU, big tiles pay: each tile is a few large matrix products plus a few elementwise passes,
    and Python's per-tile overhead vanishes behind them; the backward does five products per tile
    and prefers taller tiles. (Tuned on 2 CPU cores with ``python -m attncourse.bench flash``.) A GPU
    would want tiles sized to its shared memory instead, which is what chapter 10's Triton kernel does.
    """
    if torch.device(device).type == "cpu":
        return (256, 512) if backward else (128, 512)
    return (128, 128)


# ----------------------------------------------------------------------------- validation


def _check_options(query, key, is_causal, causal_align, window, scale, block_q, block_k, q_offset, k_offset):
    """Validate the options shared with chapter 10's kernel; return (Band, scale, block_q, block_k)."""
    window = check_causal_options(is_causal, causal_align, window)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    block_q = None if block_q is None else _validate.positive_int("block_q", block_q)
    block_k = None if block_k is None else _validate.positive_int("block_k", block_k)
    q_offset, k_offset = check_int("q_offset", q_offset), check_int("k_offset", k_offset)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    t_q, t_k = query.shape[-2], key.shape[-2]
    shift = t_k - t_q if causal_align == "bottom_right" else 0
    band = Band(causal=True, offset=shift + q_offset - k_offset, window=window) if is_causal else Band()
    return band, scale, block_q, block_k


# ----------------------------------------------------------------------------- layout: grouped heads, no copy


def _grouped(query, key, value):
    """Views (M, G, Tq, D), (M, Tk, D), (M, Tk, Dv) with M = batch x KV heads and G query heads per KV head, in the
    working dtype, plus what is needed to undo it. Query head h = g_kv * G + r sits at [.., g_kv, r]."""
    if query.dim() == 2:  # (T, D): one head
        query, key, value = query[None], key[None], value[None]
    lead = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    heads, kv_heads = query.shape[-3], key.shape[-3]
    group = heads // kv_heads
    work = _compute_dtype(query.dtype)
    m = math.prod(lead) * kv_heads
    q = query.expand(*lead, *query.shape[-3:]).reshape(m, group, *query.shape[-2:]).to(work)
    k, v = (x.expand(*lead, *x.shape[-3:]).reshape(m, *x.shape[-2:]).to(work) for x in (key, value))
    return q, k, v, lead, heads


def _tile_rows(x: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
    """Rows q0:q1 of every head of the group, stacked: (M, G, T, C) -> (M, G * (q1 - q0), C)."""
    return x[:, :, q0:q1].reshape(x.shape[0], -1, x.shape[-1])


# ----------------------------------------------------------------------------- the tiled loops


def _tiled_forward(q, k, v, band: Band, scale: float, block_q: int, block_k: int, io: TrafficCounter | None = None):
    """q (M, G, Tq, D), k (M, Tk, D), v (M, Tk, Dv) -> out (M, G, Tq, Dv), lse (M, G, Tq) in natural log.

    Inside, scores are multiplied by log2(e) so that e^x becomes 2^(x log2 e): the same numbers, one
    cheaper instruction (FlashAttention-2 and Triton's tutorial do the same). Rows that see no key keep
    out = 0 and lse = -inf.
    """
    m, g, t_q, _ = q.shape
    t_k, d_v = k.shape[1], v.shape[-1]
    out = q.new_zeros(m, g, t_q, d_v)  # (M, G, Tq, Dv)
    lse = q.new_full((m, g, t_q), _NEG_INF)  # (M, G, Tq)
    k_t = k.transpose(1, 2).contiguous()  # (M, D, Tk): one O(T) copy, so every tile reads rows of K^T
    for q0 in range(0, t_q, block_q):
        q1 = min(q0 + block_q, t_q)
        lo, hi = band.key_range(q0, q1, t_k, block_k)
        if lo >= hi:
            continue  # no row of this block sees a key: zeros and -inf, nothing loaded
        q_blk = _tile_rows(q, q0, q1) * (scale * _LOG2E)  # (M, G*Bq, D): scaled once per query block
        if io is not None:
            io.read("Q", q_blk.numel())
        row_max = None
        for k0 in range(lo, hi, block_k):
            k1 = min(k0 + block_k, hi)
            if io is not None:
                io.read("K", m * (k1 - k0) * k.shape[-1])
                io.read("V", m * (k1 - k0) * d_v)
                io.tile(not band.full(q0, q1, k0, k1))
            s = torch.bmm(q_blk, k_t[:, :, k0:k1])  # (M, G*Bq, D) @ (M, D, Bk) -> (M, G*Bq, Bk)
            if not band.full(q0, q1, k0, k1):  # a tile that cuts the band: mask the pairs outside it
                s.view(m, g, q1 - q0, k1 - k0).masked_fill_(~band.allowed(q0, q1, k0, k1, s.device), _NEG_INF)
            tile_max = s.amax(dim=-1, keepdim=True)  # (M, G*Bq, 1)
            new_max = tile_max if row_max is None else torch.maximum(row_max, tile_max)
            ref = new_max.masked_fill(new_max == _NEG_INF, 0.0)  # a row with no key yet: keep l = acc = 0, no NaN
            p = s.sub_(ref).exp2_()  # (M, G*Bq, Bk), in place: the tile is the only big buffer
            if row_max is None:
                row_sum = p.sum(dim=-1, keepdim=True)  # (M, G*Bq, 1) running sum l
                acc = torch.bmm(p, v[:, k0:k1])  # (M, G*Bq, Bk) @ (M, Bk, Dv) -> (M, G*Bq, Dv), unnormalised
            else:
                rescale = torch.exp2(row_max - ref)  # (M, G*Bq, 1): 2^(m - m'), 0 where m was -inf
                row_sum.mul_(rescale).add_(p.sum(dim=-1, keepdim=True))
                acc.mul_(rescale).baddbmm_(p, v[:, k0:k1])  # (M, G*Bq, Bk) @ (M, Bk, Dv) -> (M, G*Bq, Dv)
            row_max = new_max
        safe_sum = row_sum.masked_fill(row_sum == 0, 1.0)  # rows that saw no key: acc = 0, so out = 0
        out[:, :, q0:q1] = (acc / safe_sum).view(m, g, q1 - q0, d_v)  # (M, G, Bq, Dv)
        lse[:, :, q0:q1] = ((row_max + torch.log2(row_sum)) / _LOG2E).view(m, g, q1 - q0)  # -inf where l = 0
        if io is not None:
            io.write("O", acc.numel())
            io.write("lse", row_sum.numel())
    return out, lse


def _tiled_backward(q, k, v, out, lse, d_out, d_lse, band: Band, scale: float, block_q: int, block_k: int,
                    io: TrafficCounter | None = None):
    """Gradients (dq (M, G, Tq, D), dk (M, Tk, D), dv (M, Tk, Dv)), each tile of P rebuilt from lse
    (FlashAttention-2's loop order for the backward: key blocks outside, dK and dV kept per key block)."""
    m, g, t_q, d = q.shape
    t_k = k.shape[1]
    # D_i = rowsum(dO * O); a gradient on lse adds P_ij * dlse_i to dS, i.e. shifts D by -dlse
    delta = (d_out * out).sum(dim=-1, keepdim=True)  # (M, G, Tq, 1)
    if d_lse is not None:
        delta = delta - d_lse.unsqueeze(-1)
    # base-2 lse; +inf on rows with no key so that P = 2^(s - inf) = 0 there
    lse2 = (lse * _LOG2E).masked_fill(lse == _NEG_INF, float("inf")).unsqueeze(-1)  # (M, G, Tq, 1)
    if io is not None:  # the preprocessing pass: reads O and dO, writes D
        io.read("O", out.numel())
        io.read("dO", d_out.numel())
        io.write("D", delta.numel())
    q2 = q * (scale * _LOG2E)  # (M, G, Tq, D): rebuilds the forward's base-2 scores
    dq = torch.zeros_like(q)  # (M, G, Tq, D), accumulated over key blocks
    dk = torch.zeros_like(k)  # (M, Tk, D)
    dv = torch.zeros_like(v)  # (M, Tk, Dv)
    for k0 in range(0, t_k, block_k):
        k1 = min(k0 + block_k, t_k)
        lo, hi = band.query_range(k0, k1, t_q, block_q)
        if lo >= hi:
            continue  # no query sees these keys: their gradients stay zero
        k_blk, v_blk = k[:, k0:k1], v[:, k0:k1]  # (M, Bk, D), (M, Bk, Dv)
        k_blk_t, v_blk_t = k_blk.transpose(1, 2).contiguous(), v_blk.transpose(1, 2).contiguous()
        dk_blk = dk[:, k0:k1]  # (M, Bk, D) views: accumulated in place
        dv_blk = dv[:, k0:k1]  # (M, Bk, Dv)
        if io is not None:
            io.read("K", k_blk.numel())
            io.read("V", v_blk.numel())
        for q0 in range(lo, hi, block_q):
            q1 = min(q0 + block_q, hi)
            rows = g * (q1 - q0)
            if io is not None:
                io.read("Q", m * rows * d)
                io.read("dO", m * rows * d_out.shape[-1])
                io.read("lse", m * rows)
                io.read("D", m * rows)
                io.tile(not band.full(q0, q1, k0, k1))
            s = torch.bmm(_tile_rows(q2, q0, q1), k_blk_t)  # (M, G*Bq, D) @ (M, D, Bk) -> (M, G*Bq, Bk)
            if not band.full(q0, q1, k0, k1):
                s.view(m, g, q1 - q0, k1 - k0).masked_fill_(~band.allowed(q0, q1, k0, k1, s.device), _NEG_INF)
            p = s.sub_(_tile_rows(lse2, q0, q1)).exp2_()  # (M, G*Bq, Bk): the forward's probabilities, recomputed
            do_blk = _tile_rows(d_out, q0, q1)  # (M, G*Bq, Dv)
            dv_blk.baddbmm_(p.transpose(1, 2), do_blk)  # (M, Bk, G*Bq) @ (M, G*Bq, Dv) -> (M, Bk, Dv)
            dp = torch.bmm(do_blk, v_blk_t)  # (M, G*Bq, Dv) @ (M, Dv, Bk) -> (M, G*Bq, Bk)
            ds = dp.sub_(_tile_rows(delta, q0, q1)).mul_(p)  # (M, G*Bq, Bk): dS = P * (dP - D)
            dk_blk.baddbmm_(ds.transpose(1, 2), _tile_rows(q, q0, q1), alpha=scale)  # (M, Bk, G*Bq) @ (M, G*Bq, D)
            if g == 1:
                dq[:, 0, q0:q1].baddbmm_(ds, k_blk, alpha=scale)  # (M, Bq, Bk) @ (M, Bk, D) -> (M, Bq, D)
            else:
                dq[:, :, q0:q1].add_(torch.bmm(ds, k_blk).view(m, g, q1 - q0, d), alpha=scale)  # (M, G, Bq, D)
            if io is not None:
                io.read("dQ", m * rows * d)
                io.write("dQ", m * rows * d)  # dQ_i goes back and forth once per tile
        if io is not None:
            io.write("dK", dk_blk.numel())
            io.write("dV", dv_blk.numel())
    return dq, dk, dv


# ----------------------------------------------------------------------------- autograd and the public functions


def _ungroup(x: torch.Tensor, lead, like: tuple) -> torch.Tensor:
    """(M, G, T, C) or (M, T, C) back to the caller's layout (..., H or Hkv, T, C), summed over broadcast dims;
    `like` is the input's (shape, dtype)."""
    shape, dtype = like
    heads = x.shape[0] * (x.shape[1] if x.dim() == 4 else 1) // max(1, math.prod(lead))
    x = x.reshape(*lead, heads, *x.shape[-2:])  # (..., H or Hkv, T, C)
    if len(shape) == 2:
        return x.reshape(shape).to(dtype)
    return x.sum_to_size(shape).to(dtype)


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd node of `flash_attention`: saves q, k, v, out and lse (all O(T)), never the weights.

    ``apply(query, key, value, band, scale, block_q, block_k)`` takes validated arguments (a
    :class:`~attncourse.flash_io.Band`, a float scale, int block sizes or None for each pass's default) and
    returns ``(out, lse)``.
    """

    @staticmethod
    def forward(ctx, query, key, value, band, scale, block_q, block_k):
        q, k, v, lead, heads = _grouped(query, key, value)
        default_q, default_k = default_block_sizes(q.device)
        out, lse = _tiled_forward(q, k, v, band, scale, block_q or default_q, block_k or default_k)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (band, scale, block_q, block_k, lead, [(x.shape, x.dtype) for x in (query, key, value)])
        ctx.set_materialize_grads(False)  # an unused output (often lse) arrives as None
        out_shape = (*query.shape[:-1], value.shape[-1]) if query.dim() == 2 else (*lead, heads, *out.shape[-2:])
        return out.to(query.dtype).reshape(out_shape), lse.reshape(out_shape[:-1])

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        band, scale, block_q, block_k, lead, inputs = ctx.config
        d_out = torch.zeros_like(out) if d_out is None else d_out.reshape(out.shape).to(out.dtype)
        if d_lse is not None:
            d_lse = d_lse.reshape(lse.shape).to(lse.dtype)  # (..., Tq) -> (M, G, Tq)
        default_q, default_k = default_block_sizes(q.device, backward=True)
        dq, dk, dv = _tiled_backward(q, k, v, out, lse, d_out, d_lse, band, scale, block_q or default_q,
                                     block_k or default_k)
        grads = [_ungroup(gr, lead, x) for gr, x in zip((dq, dk, dv), inputs)]
        return (*grads, None, None, None, None)


def flash_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    causal_align: str = "top_left",
    window: int | None = None,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
    traffic: TrafficCounter | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled attention returning ``(out, lse)``; both differentiable.

    Args:
        query: (..., H, Tq, D); key: (..., Hkv, Tk, D); value: (..., Hkv, Tk, Dv) with Hkv dividing H (grouped
            heads, read in place); dims before -3 broadcast. Rank-2 inputs (T, D) are one head.
        is_causal: causal mask; ``causal_align="top_left"`` (PyTorch's ``is_causal``: query i sees keys 0..i) or
            ``"bottom_right"`` (the queries are the last Tq positions). Ignored when not causal.
        window: None or W >= 1, needs ``is_causal``: the query at aligned position p sees keys p - W < j <= p.
        scale: defaults to 1/sqrt(D).
        block_q, block_k: tile sizes (positive ints) of both passes; None picks :func:`default_block_sizes`.
        q_offset, k_offset: positions of query row 0 and key 0 in a longer sequence (added to the alignment), so
            one key block of a ring or block-sparse loop is masked as it would be in the whole problem.
        traffic: a :class:`~attncourse.flash_io.TrafficCounter` the forward loop reports its loads and stores to.

    Returns:
        out (..., H, Tq, Dv) equal to :func:`attncourse.scaled_dot_product_attention` with the equivalent
        boolean mask, and lse (..., H, Tq) in the working dtype (float32 for half precision), the natural-log
        log-sum-exp of each scaled, masked score row: -inf with a zero output for a row that sees no key.
    """
    check_qkv(query, key, value)
    band, scale, block_q, block_k = _check_options(query, key, is_causal, causal_align, window, scale, block_q,
                                                   block_k, q_offset, k_offset)
    if traffic is not None:  # the instrumented run: no autograd, one pass through the loop that reports to it
        if not isinstance(traffic, TrafficCounter):
            raise TypeError(f"traffic must be a TrafficCounter or None, got {type(traffic).__name__}")
        q, k, v, lead, heads = _grouped(query, key, value)
        default_q, default_k = default_block_sizes(q.device)
        with torch.no_grad():
            out, lse = _tiled_forward(q, k, v, band, scale, block_q or default_q, block_k or default_k, traffic)
        out_shape = (*query.shape[:-1], value.shape[-1]) if query.dim() == 2 else (*lead, heads, *out.shape[-2:])
        return out.to(query.dtype).reshape(out_shape), lse.reshape(out_shape[:-1])
    return FlashAttentionFunction.apply(query, key, value, band, scale, block_q, block_k)


def flash_attention_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    grad_lse: torch.Tensor | None = None,
    is_causal: bool = False,
    causal_align: str = "top_left",
    window: int | None = None,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
    traffic: TrafficCounter | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of attention given the forward's `out` (..., H, Tq, Dv) and `lse` (..., H, Tq).

    Same options as :func:`flash_attention_forward`. Called on one key block with the *final* `out` and `lse` of
    the whole row (after every block was merged), it returns that block's dK, dV and its share of dQ: summing dQ
    over the blocks gives the full gradient (how a ring or block-sparse backward uses it). `grad_lse` adds a
    gradient flowing into lse. dk and dv have the key's shape: each sums over the query heads of its group.
    """
    check_qkv(query, key, value)
    band, scale, block_q, block_k = _check_options(query, key, is_causal, causal_align, window, scale, block_q,
                                                   block_k, q_offset, k_offset)
    out_shape = (*query.shape[:-1], value.shape[-1])
    for name, x, shape in (("out", out, out_shape), ("grad_out", grad_out, out_shape),
                           ("lse", lse, query.shape[:-1]), ("grad_lse", grad_lse, query.shape[:-1])):
        if x is None and name == "grad_lse":
            continue
        _validate.tensor(name, x, min_rank=1, floating=True)
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)} (from query {tuple(query.shape)} and value "
                             f"{tuple(value.shape)}), got {tuple(x.shape)}")
    q, k, v, lead, heads = _grouped(query, key, value)
    work = q.dtype
    as_q = (*q.shape[:-1], v.shape[-1])
    o, do = (x.reshape(as_q).to(work) for x in (out, grad_out))  # (M, G, Tq, Dv)
    lse3 = lse.reshape(q.shape[:-1]).to(work)  # (M, G, Tq)
    dl = None if grad_lse is None else grad_lse.reshape(q.shape[:-1]).to(work)
    default_q, default_k = default_block_sizes(q.device, backward=True)
    with torch.no_grad():
        dq, dk, dv = _tiled_backward(q, k, v, o, lse3, do, dl, band, scale, block_q or default_q,
                                     block_k or default_k, traffic)
    return tuple(_ungroup(gr, lead, (x.shape, x.dtype)) for gr, x in zip((dq, dk, dv), (query, key, value)))


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    causal_align: str = "top_left",
    window: int | None = None,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """FlashAttention: tiled, O(T) extra memory, differentiable through :class:`FlashAttentionFunction`.

    Same arguments as :func:`flash_attention_forward` (the signature of chapter 10's Triton kernel); returns only
    out (..., H, Tq, Dv).
    """
    return flash_attention_forward(query, key, value, is_causal=is_causal, causal_align=causal_align,
                                   window=window, scale=scale, block_q=block_q, block_k=block_k)[0]
