r"""Block sparsity: attention that skips whole tiles, the way FlexAttention's ``BlockMask`` and BigBird's
blocked kernel make a sparse pattern pay.

A sparse mask saves work only if the kernel never touches what it masks. A tiled (FlashAttention) loop
works on (block_q x block_k) tiles of the score matrix, so the unit of sparsity is the tile:

1. :func:`tile_states` evaluates the mask function on every (query, key) pair, one row of tiles at a time
   (as ``create_block_mask`` does: per element, then reduced per tile), and labels each tile
   ``EMPTY`` (no allowed pair: never visited), ``PARTIAL`` (some: computed, then masked) or ``FULL``
   (every pair allowed: computed with no mask at all);
2. :func:`block_sparse_attention` runs the tiled online-softmax loop over the non-empty tiles of each row
   of tiles only, and evaluates the mask function only on the partial ones;
3. :func:`block_sparse_work` counts what that costs: tiles visited and masked, and the matrix-product FLOPs
   (``4 Bq Bk D`` per tile: ``Q K^T`` and ``P V``), against dense attention's.

For a sliding window, Longformer or BigBird the non-empty tiles per row of tiles stay constant as T grows,
so the tiles visited grow like T (with the pairs), not like T^2.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import _validate
from .masks import MaskMod, materialize_at
from .sdpa import _check_qkv
from .sdpa import compute_dtype as _compute_dtype

__all__ = ["EMPTY", "PARTIAL", "FULL", "tile_states", "block_sparse_attention", "BlockSparseOutput",
           "block_sparse_work"]

EMPTY, PARTIAL, FULL = 0, 1, 2
_NEG_INF = float("-inf")


def _blocks(q_len: int, k_len: int, block_q: int, block_k: int) -> tuple[int, int]:
    for name, x in (("q_len", q_len), ("k_len", k_len), ("block_q", block_q), ("block_k", block_k)):
        _validate.positive_int(name, x)
    return math.ceil(q_len / block_q), math.ceil(k_len / block_k)


def tile_states(mask_mod: MaskMod, q_len: int, k_len: int, block_q: int, block_k: int) -> torch.Tensor:
    """(ceil(Tq/Bq), ceil(Tk/Bk)) long tensor of EMPTY (0), PARTIAL (1) or FULL (2) per tile.

    The mask is evaluated per element, one row of tiles (block_q query rows, every key) at a time, so no
    (Tq, Tk) mask is ever held; each tile's allowed pairs are then counted. Tiles at the ends may be
    smaller than block_q x block_k; a tile is FULL when every pair it really holds is allowed.
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    n_q, n_k = _blocks(q_len, k_len, block_q, block_k)
    keys = torch.arange(k_len)
    k_sizes = torch.full((n_k,), block_k)
    k_sizes[-1] = k_len - (n_k - 1) * block_k  # (nK,) real width of each tile
    states = torch.empty(n_q, n_k, dtype=torch.long)
    for a in range(n_q):
        q0, q1 = a * block_q, min((a + 1) * block_q, q_len)
        allowed = materialize_at(mask_mod, torch.arange(q0, q1), keys)  # (Bq, Tk) bool, this row of tiles only
        padded = torch.zeros(q1 - q0, n_k * block_k, dtype=torch.long)
        padded[:, :k_len] = allowed
        counts = padded.view(q1 - q0, n_k, block_k).sum(dim=(0, 2))  # (nK,) allowed pairs per tile
        states[a] = torch.where(counts == 0, EMPTY, torch.where(counts == (q1 - q0) * k_sizes, FULL, PARTIAL))
    return states


class BlockSparseOutput(NamedTuple):
    """What :func:`block_sparse_attention` returns: out (..., Tq, Dv), lse (..., Tq), and the tiles it
    visited (computed) and masked (partial ones) per head."""

    out: torch.Tensor
    lse: torch.Tensor
    tiles_visited: int
    tiles_masked: int


def block_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask_mod: MaskMod, *,
                           block_q: int = 128, block_k: int = 128, states: torch.Tensor | None = None,
                           scale: float | None = None) -> BlockSparseOutput:
    """Attention under `mask_mod` (True = may attend) that visits only the non-empty tiles.

    query (..., Tq, D), key (..., Tk, D), value (..., Tk, Dv), leading dims broadcast. `states` is
    :func:`tile_states` for these lengths and block sizes (computed here when None; pass it to reuse it,
    as a ``BlockMask`` is reused across layers). A query row with no allowed key gets zeros and lse -inf.
    Half precision is computed in float32.
    """
    _check_qkv(query, key, value)
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    t_q, t_k = query.shape[-2], key.shape[-2]
    n_q, n_k = _blocks(t_q, t_k, block_q, block_k)
    if states is None:
        states = tile_states(mask_mod, t_q, t_k, block_q, block_k)
    _validate.tensor("states", states, min_rank=2)
    if tuple(states.shape) != (n_q, n_k):
        raise ValueError(f"states must be (ceil(Tq/block_q), ceil(Tk/block_k)) = {(n_q, n_k)} for Tq={t_q}, "
                         f"Tk={t_k}, got {tuple(states.shape)}")
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    lead = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    work = _compute_dtype(query.dtype)
    q, k, v = (x.expand(*lead, *x.shape[-2:]).to(work) for x in (query, key, value))
    out = q.new_zeros(*lead, t_q, v.shape[-1])  # (..., Tq, Dv)
    lse = q.new_full((*lead, t_q), _NEG_INF)  # (..., Tq)
    visited = masked = 0
    for a in range(n_q):
        q0, q1 = a * block_q, min((a + 1) * block_q, t_q)
        q_blk = q[..., q0:q1, :] * scale  # (..., Bq, D)
        m = q.new_full((*lead, q1 - q0), _NEG_INF)  # (..., Bq) running max
        l = torch.zeros_like(m)  # noqa: E741  (..., Bq) running sum
        acc = q.new_zeros(*lead, q1 - q0, v.shape[-1])  # (..., Bq, Dv) unnormalised output
        for b in torch.nonzero(states[a] != EMPTY).flatten().tolist():  # the only tiles this row visits
            k0, k1 = b * block_k, min((b + 1) * block_k, t_k)
            s = q_blk @ k[..., k0:k1, :].transpose(-2, -1)  # (..., Bq, D) @ (..., D, Bk) -> (..., Bq, Bk)
            if states[a, b] == PARTIAL:  # only partial tiles evaluate the mask
                keep = materialize_at(mask_mod, torch.arange(q0, q1), torch.arange(k0, k1)).to(s.device)  # (Bq, Bk)
                s = s.masked_fill(~keep, _NEG_INF)
                masked += 1
            m_new = torch.maximum(m, s.amax(dim=-1))  # (..., Bq)
            ref = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))  # no -inf - (-inf)
            p = torch.exp(s - ref[..., None])  # (..., Bq, Bk)
            alpha = torch.exp(m - ref)  # (..., Bq)
            l = alpha * l + p.sum(dim=-1)  # noqa: E741
            acc = alpha[..., None] * acc + p @ v[..., k0:k1, :]  # (..., Bq, Bk) @ (..., Bk, Dv) -> (..., Bq, Dv)
            m = m_new
            visited += 1
        seen = l > 0  # (..., Bq) rows that saw at least one key
        out[..., q0:q1, :] = torch.where(seen[..., None], acc / torch.where(seen, l, 1.0)[..., None], 0.0)
        lse[..., q0:q1] = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), _NEG_INF)
    return BlockSparseOutput(out.to(value.dtype), lse, visited, masked)


def block_sparse_work(states: torch.Tensor, q_len: int, k_len: int, block_q: int, block_k: int,
                      head_dim: int) -> dict[str, int]:
    """The work of one head of :func:`block_sparse_attention` under `states` (and of dense attention).

    Returns ``tiles_visited`` (non-empty), ``tiles_masked`` (partial), ``tiles_total``, ``flops`` (4 Bq Bk D
    per visited tile, with the real tile sizes at the ends: Q K^T and P V, 2 FLOPs per multiply-add) and
    ``dense_flops`` (4 Tq Tk D, every tile).
    """
    n_q, n_k = _blocks(q_len, k_len, block_q, block_k)
    _validate.positive_int("head_dim", head_dim)
    _validate.tensor("states", states, min_rank=2)
    if tuple(states.shape) != (n_q, n_k):
        raise ValueError(f"states must be {(n_q, n_k)} for Tq={q_len}, Tk={k_len}, got {tuple(states.shape)}")
    rows = torch.full((n_q,), block_q)
    rows[-1] = q_len - (n_q - 1) * block_q
    cols = torch.full((n_k,), block_k)
    cols[-1] = k_len - (n_k - 1) * block_k
    visited = states != EMPTY  # (nQ, nK)
    pairs = int((rows[:, None] * cols[None, :])[visited].sum())
    return {"tiles_visited": int(visited.sum()), "tiles_masked": int((states == PARTIAL).sum()),
            "tiles_total": n_q * n_k, "flops": 4 * pairs * head_dim, "dense_flops": 4 * q_len * k_len * head_dim}
