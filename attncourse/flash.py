r"""FlashAttention by tiling, in plain PyTorch: a tiled forward with an online softmax, and a backward
by recomputation (FlashAttention-2 style), so neither pass ever holds a :math:`T_q \times T_k` matrix.

Forward (Dao et al. 2022, Algorithm 1, loops ordered as in FlashAttention-2): for each block of
queries, walk over the blocks of keys keeping, per query row, a running max :math:`m`, a running sum
:math:`\ell` and an unnormalised output :math:`\tilde O`; a new block with scores :math:`S` updates

.. math:: m' = \max(m, \mathrm{rowmax}\,S),\quad P = e^{S - m'},\quad
          \ell' = e^{m - m'}\ell + \mathrm{rowsum}\,P,\quad \tilde O' = e^{m - m'}\tilde O + P V.

At the end :math:`O = \tilde O / \ell` and :math:`\mathrm{lse} = m + \log \ell`. Under a causal mask the
key blocks that lie entirely above the diagonal are never visited.

Backward: with :math:`D_i = \sum_c dO_{ic} O_{ic}`, each block of :math:`P = e^{S - \mathrm{lse}}` is rebuilt
from the saved lse, then :math:`dV \mathrel{+}= P^\top dO`, :math:`dP = dO\,V^\top`,
:math:`dS = P \circ (dP - D)`, :math:`dQ \mathrel{+}= dS\,K \cdot s`, :math:`dK \mathrel{+}= dS^\top Q \cdot s`.

The tiles are large and each step runs on all batch and head rows at once (CPU-friendly: a few big
matrix products per tile, no Python loop over rows). The module also holds the HBM-traffic model of
the paper's Theorem 2 and a count of the tiles causal masking skips.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _validate
from .sdpa import _check_qkv
from .sdpa import compute_dtype as _compute_dtype  # half precision tiles accumulate in float32

__all__ = ["FlashAttentionFunction", "flash_attention", "flash_attention_forward", "default_block_sizes",
           "causal_tile_map", "causal_block_counts", "hbm_traffic_standard", "hbm_traffic_flash",
           "flash_block_sizes", "theorem2_bound", "HBMTraffic"]

_NEG_INF = float("-inf")


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


def _check_args(query, key, value, is_causal, scale, block_q, block_k):
    _check_qkv(query, key, value)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    if block_q is not None:
        _validate.positive_int("block_q", block_q)
    if block_k is not None:
        _validate.positive_int("block_k", block_k)
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key and value must be on one device, got {query.device}, "
                         f"{key.device}, {value.device}")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return scale, block_q, block_k



_LOG2E = 1.0 / math.log(2.0)  # scores are kept in base 2 inside the tiles: exp2 is about twice as fast as exp on CPU


def _tiled_forward(q, k, v, causal: bool, scale: float, block_q: int, block_k: int):
    """q (N, Tq, D), k (N, Tk, D), v (N, Tk, Dv) -> out (N, Tq, Dv), lse (N, Tq) in natural log.

    Inside, scores are multiplied by log2(e) so that e^x becomes 2^(x log2 e): the same numbers, one
    cheaper instruction (FlashAttention-2 and Triton's tutorial do the same).
    """
    n, t_q, _ = q.shape
    t_k, d_v = k.shape[1], v.shape[-1]
    if t_k == 0:  # no keys: every row is fully masked, so zeros and lse = -inf (never NaN)
        return q.new_zeros(n, t_q, d_v), q.new_full((n, t_q), _NEG_INF)
    out = q.new_empty(n, t_q, d_v)  # (N, Tq, Dv)
    lse = q.new_empty(n, t_q)  # (N, Tq)
    k_t = k.transpose(1, 2).contiguous()  # (N, D, Tk): one O(T) copy, so every tile reads rows of K^T
    for q0 in range(0, t_q, block_q):
        q1 = min(q0 + block_q, t_q)
        q_blk = q[:, q0:q1] * (scale * _LOG2E)  # (N, Bq, D): scale once per query block, not per tile
        # query i sees keys j <= i (top-left aligned): the block's last row sees keys < q1, so key
        # blocks from q1 on are skipped entirely
        k_stop = min(t_k, q1) if causal else t_k
        for k0 in range(0, k_stop, block_k):
            k1 = min(k0 + block_k, k_stop)
            s = torch.bmm(q_blk, k_t[:, :, k0:k1])  # (N, Bq, D) @ (N, D, Bk) -> (N, Bq, Bk)
            if causal and k1 - 1 > q0:  # a tile that crosses the diagonal: mask its upper part
                s.masked_fill_(_above_diagonal(q0, q1, k0, k1, s.device), _NEG_INF)
            if k0 == 0:
                # first tile: every row sees key 0, so its max is finite and there is nothing to rescale
                row_max = s.amax(dim=-1, keepdim=True)  # (N, Bq, 1) running max m (base 2)
                p = s.sub_(row_max).exp2_()  # (N, Bq, Bk), in place: the tile is the only big buffer
                row_sum = p.sum(dim=-1, keepdim=True)  # (N, Bq, 1) running sum l
                acc = torch.bmm(p, v[:, k0:k1])  # (N, Bq, Bk) @ (N, Bk, Dv) -> (N, Bq, Dv), unnormalised
                continue
            new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))  # (N, Bq, 1)
            p = s.sub_(new_max).exp2_()  # (N, Bq, Bk)
            rescale = torch.exp2(row_max - new_max)  # (N, Bq, 1): 2^(m - m') = e^{(m - m') ln 2}
            row_sum.mul_(rescale).add_(p.sum(dim=-1, keepdim=True))
            acc.mul_(rescale).baddbmm_(p, v[:, k0:k1])  # (N, Bq, Bk) @ (N, Bk, Dv) -> (N, Bq, Dv)
            row_max = new_max
        out[:, q0:q1] = acc / row_sum  # (N, Bq, Dv)
        lse[:, q0:q1] = ((row_max + torch.log2(row_sum)) / _LOG2E).squeeze(-1)  # (N, Bq), natural log
    return out, lse


def _above_diagonal(q0: int, q1: int, k0: int, k1: int, device) -> torch.Tensor:
    """(Bq, Bk) boolean, True where key j > query i: the causally masked part of a tile."""
    rows = torch.arange(q0, q1, device=device)[:, None]  # (Bq, 1)
    cols = torch.arange(k0, k1, device=device)[None, :]  # (1, Bk)
    return cols > rows  # (Bq, Bk)


def _tiled_backward(q, k, v, out, lse, d_out, d_lse, causal: bool, scale: float, block_q: int,
                    block_k: int):
    """Gradients (dq, dk, dv) of the 3-D problem, each tile of P rebuilt from lse (FlashAttention-2)."""
    t_q, t_k = q.shape[1], k.shape[1]
    # D_i = rowsum(dO * O); a gradient on lse adds P_ij * dlse_i to dS, i.e. shifts D by -dlse
    delta = (d_out * out).sum(dim=-1, keepdim=True)  # (N, Tq, 1)
    if d_lse is not None:
        delta = delta - d_lse.unsqueeze(-1)
    # base-2 lse; +inf on rows with no key so that P = 2^(s - inf) = 0 there
    lse2 = (lse * _LOG2E).masked_fill(lse == _NEG_INF, float("inf")).unsqueeze(-1)  # (N, Tq, 1)
    q2 = q * (scale * _LOG2E)  # (N, Tq, D): rebuilds the forward's base-2 scores
    dq = torch.zeros_like(q)  # (N, Tq, D), accumulated over key blocks
    dk = torch.empty_like(k)  # (N, Tk, D)
    dv = torch.empty_like(v)  # (N, Tk, Dv)
    for k0 in range(0, t_k, block_k):
        k1 = min(k0 + block_k, t_k)
        k_blk, v_blk = k[:, k0:k1], v[:, k0:k1]  # (N, Bk, D), (N, Bk, Dv)
        k_blk_t, v_blk_t = k_blk.transpose(1, 2).contiguous(), v_blk.transpose(1, 2).contiguous()
        dk_blk = torch.zeros_like(k_blk)  # (N, Bk, D)
        dv_blk = torch.zeros_like(v_blk)  # (N, Bk, Dv)
        # causal: queries before k0 see none of these keys; start at the block holding query k0
        q_start = (k0 // block_q) * block_q if causal else 0
        for q0 in range(q_start, t_q, block_q):
            q1 = min(q0 + block_q, t_q)
            s = torch.bmm(q2[:, q0:q1], k_blk_t)  # (N, Bq, D) @ (N, D, Bk) -> (N, Bq, Bk)
            if causal and k1 - 1 > q0:
                s.masked_fill_(_above_diagonal(q0, q1, k0, k1, s.device), _NEG_INF)
            p = s.sub_(lse2[:, q0:q1]).exp2_()  # (N, Bq, Bk): the forward's probabilities, recomputed
            do_blk = d_out[:, q0:q1]  # (N, Bq, Dv)
            dv_blk.baddbmm_(p.transpose(1, 2), do_blk)  # (N, Bk, Bq) @ (N, Bq, Dv) -> (N, Bk, Dv)
            dp = torch.bmm(do_blk, v_blk_t)  # (N, Bq, Dv) @ (N, Dv, Bk) -> (N, Bq, Bk)
            ds = dp.sub_(delta[:, q0:q1]).mul_(p)  # (N, Bq, Bk): dS = P * (dP - D)
            dq[:, q0:q1].baddbmm_(ds, k_blk, alpha=scale)  # (N, Bq, Bk) @ (N, Bk, D) -> (N, Bq, D)
            dk_blk.baddbmm_(ds.transpose(1, 2), q[:, q0:q1], alpha=scale)  # (N, Bk, Bq) @ (N, Bq, D) -> (N, Bk, D)
        dk[:, k0:k1] = dk_blk
        dv[:, k0:k1] = dv_blk
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd node of `flash_attention`: saves q, k, v, out and lse (all O(T)), never the weights.

    ``apply(query, key, value, is_causal, scale, block_q, block_k)`` takes validated arguments (a float
    scale; int block sizes, or None for each pass's default) and returns ``(out, lse)``.
    """

    @staticmethod
    def forward(ctx, query, key, value, is_causal, scale, block_q, block_k):
        lead = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
        work = _compute_dtype(query.dtype)
        n = math.prod(lead)
        q, k, v = (x.expand(*lead, *x.shape[-2:]).reshape(n, *x.shape[-2:]).to(work)
                   for x in (query, key, value))  # (N, T, D): batch and heads flattened into one axis
        default_q, default_k = default_block_sizes(q.device)
        out, lse = _tiled_forward(q, k, v, is_causal, scale, block_q or default_q, block_k or default_k)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (is_causal, scale, block_q, block_k, lead,
                      [(x.shape, x.dtype) for x in (query, key, value)])
        ctx.set_materialize_grads(False)  # an unused output (often lse) arrives as None
        out = out.to(query.dtype).reshape(*lead, *out.shape[-2:])  # (N, Tq, Dv) -> (..., Tq, Dv)
        lse = lse.reshape(*lead, lse.shape[-1])  # (N, Tq) -> (..., Tq), kept in the working dtype
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        is_causal, scale, block_q, block_k, lead, inputs = ctx.config
        if d_out is None:
            d_out = torch.zeros_like(out)  # (N, Tq, Dv)
        d_out = d_out.reshape(out.shape).to(out.dtype)  # (..., Tq, Dv) -> (N, Tq, Dv)
        if d_lse is not None:
            d_lse = d_lse.reshape(lse.shape).to(lse.dtype)  # (..., Tq) -> (N, Tq)
        default_q, default_k = default_block_sizes(q.device, backward=True)
        grads = _tiled_backward(q, k, v, out, lse, d_out, d_lse, is_causal, scale, block_q or default_q,
                                block_k or default_k)
        # back to each input's own shape (summing over broadcast leading dims) and dtype
        grads = [g.reshape(*lead, *g.shape[-2:]).sum_to_size(shape).to(dtype)
                 for g, (shape, dtype) in zip(grads, inputs)]
        return (*grads, None, None, None, None)


def flash_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled attention returning ``(out, lse)``; both differentiable.

    Args:
        query: (..., Tq, D); key: (..., Tk, D); value: (..., Tk, Dv); leading dims broadcast.
        is_causal: top-left aligned causal mask (query i sees keys 0..i), as PyTorch's ``is_causal``.
        scale: defaults to 1/sqrt(D).
        block_q, block_k: tile sizes (positive ints) of both passes; None picks
            :func:`default_block_sizes` (forward and backward each get their own).

    Returns:
        out (..., Tq, Dv) equal to :func:`attncourse.scaled_dot_product_attention`, and lse (..., Tq),
        the natural-log log-sum-exp of each scaled, masked score row (-inf and a zero output for a row
        with no key, which happens only when Tk = 0).
    """
    scale, block_q, block_k = _check_args(query, key, value, is_causal, scale, block_q, block_k)
    return FlashAttentionFunction.apply(query, key, value, is_causal, scale, block_q, block_k)


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """FlashAttention: tiled, O(T) extra memory, differentiable through :class:`FlashAttentionFunction`.

    Same arguments as :func:`flash_attention_forward`; returns only out (..., Tq, Dv).
    """
    return flash_attention_forward(query, key, value, is_causal=is_causal, scale=scale,
                                   block_q=block_q, block_k=block_k)[0]


# ----------------------------------------------------------------------------- causal block skipping


def causal_tile_map(q_len: int, k_len: int, block_q: int, block_k: int) -> torch.Tensor:
    """(ceil(Tq/Bq), ceil(Tk/Bk)) int tensor: 0 = tile skipped (every key after every query), 1 = tile
    on the diagonal (computed, then partly masked), 2 = tile fully visible (computed, no mask).

    Top-left alignment: query i sees keys 0..i. Tile (a, b) holds queries [a Bq, (a+1) Bq) and keys
    [b Bk, (b+1) Bk); it is skipped when its first key comes after its last query.
    """
    _validate.positive_int("q_len", q_len)
    _validate.positive_int("k_len", k_len)
    _validate.positive_int("block_q", block_q)
    _validate.positive_int("block_k", block_k)
    q_first = torch.arange(0, q_len, block_q)[:, None]  # (nQ, 1)
    q_last = (q_first + block_q).clamp(max=q_len) - 1  # (nQ, 1)
    k_first = torch.arange(0, k_len, block_k)[None, :]  # (1, nK)
    k_last = (k_first + block_k).clamp(max=k_len) - 1  # (1, nK)
    tiles = torch.ones(q_first.shape[0], k_first.shape[1], dtype=torch.long)  # (nQ, nK): diagonal
    tiles[(k_last <= q_first).expand_as(tiles)] = 2
    tiles[(k_first > q_last).expand_as(tiles)] = 0
    return tiles


def causal_block_counts(q_len: int, k_len: int, block_q: int, block_k: int) -> dict[str, int]:
    """How many tiles a causal tiled pass skips, masks and computes whole: keys "total", "skipped",
    "diagonal", "full". For Tq = Tk = T and Bq = Bk = B the skipped fraction tends to 1/2 as T grows."""
    tiles = causal_tile_map(q_len, k_len, block_q, block_k)
    return {"total": tiles.numel(), "skipped": int((tiles == 0).sum()),
            "diagonal": int((tiles == 1).sum()), "full": int((tiles == 2).sum())}


# ----------------------------------------------------------------------------- HBM traffic model


@dataclass(frozen=True)
class HBMTraffic:
    """Elements read from and written to slow memory ("HBM") by one attention forward."""

    reads: int
    writes: int
    block_r: int = 0  # query rows per tile (FlashAttention only)
    block_c: int = 0  # key columns per tile (FlashAttention only)

    @property
    def total(self) -> int:
        return self.reads + self.writes


def _model_args(seq_len: int, head_dim: int) -> None:
    _validate.positive_int("seq_len", seq_len)
    _validate.positive_int("head_dim", head_dim)


def hbm_traffic_standard(seq_len: int, head_dim: int) -> HBMTraffic:
    """Standard attention (Dao et al. 2022, Algorithm 0) on N = seq_len, d = head_dim.

    S = QK^T reads Q, K (2Nd) and writes S (N^2); softmax reads S and writes P (2 N^2); O = PV reads
    P and V (N^2 + Nd) and writes O (Nd). Theorem 2: Theta(Nd + N^2).
    """
    _model_args(seq_len, head_dim)
    n, d = seq_len, head_dim
    return HBMTraffic(reads=2 * n * d + n * n + n * n + n * d, writes=n * n + n * n + n * d)


def flash_block_sizes(head_dim: int, sram: int) -> tuple[int, int]:
    """(B_r, B_c) of Algorithm 1 for on-chip memory of `sram` elements: B_c = ceil(M / 4d),
    B_r = min(ceil(M / 4d), d)."""
    _validate.positive_int("head_dim", head_dim)
    _validate.positive_int("sram", sram)
    block_c = -(-sram // (4 * head_dim))
    return min(block_c, head_dim), block_c


def hbm_traffic_flash(seq_len: int, head_dim: int, sram: int) -> HBMTraffic:
    """FlashAttention's forward (Dao et al. 2022, Algorithm 1) with on-chip memory of M = `sram` elements.

    It writes O, l, m once to initialise them (Nd + 2N); each of the T_c = ceil(N / B_c) key blocks is
    read once (K_j, V_j: 2 B_c d), and for each of them every query block is read (Q_i, O_i, l_i, m_i)
    and written back (O_i, l_i, m_i). So about T_c (3Nd + 4N) = 12 N^2 d^2 / M + ... elements: the
    Theta(N^2 d^2 / M) of Theorem 2.
    """
    _model_args(seq_len, head_dim)
    _validate.positive_int("sram", sram)
    if sram < head_dim:
        raise ValueError(f"sram (M = {sram}) must hold at least one row of head_dim = {head_dim}")
    n, d = seq_len, head_dim
    block_r, block_c = flash_block_sizes(d, sram)
    t_c = -(-n // block_c)
    reads = 2 * n * d + t_c * (2 * n * d + 2 * n)  # K, V once; Q, O, l, m once per key block
    writes = n * d + 2 * n + t_c * (n * d + 2 * n)  # initial O, l, m; O, l, m once per key block
    return HBMTraffic(reads=reads, writes=writes, block_r=block_r, block_c=block_c)


def theorem2_bound(seq_len: int, head_dim: int, sram: int) -> float:
    """N^2 d^2 / M: the order of FlashAttention's HBM accesses (Theorem 2), without its constant."""
    _model_args(seq_len, head_dim)
    _validate.positive_int("sram", sram)
    return seq_len**2 * head_dim**2 / sram
