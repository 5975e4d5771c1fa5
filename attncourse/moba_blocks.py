"""MoBA's kernel strategy: loop over the key blocks, and for each one gather the queries that chose it.

:func:`attncourse.learned_sparse.selected_attention` loops over query tiles and visits the blocks each tile chose. MoBA's
own kernel (Lu et al. 2025, Algorithm 1) turns the loop around: for every key block it gathers the queries that
selected it, runs one dense attention of those queries against the block (a variable-length batch), and merges each
query's partial results with the online-softmax update of chapter 08, so a key block is loaded once per step and
every product is a full matrix product. :func:`moba_by_key_blocks` does that in PyTorch; it computes attention itself
(no fused kernel) and must equal dense attention under the selection's token mask.
"""

from __future__ import annotations

import math

import torch

from . import _validate
from .learned_sparse import n_blocks
from .online_softmax import AttentionState, finalize_attention_state, online_attention_update
from .sdpa import compute_dtype as _compute_dtype

__all__ = ["moba_by_key_blocks"]


def moba_by_key_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, selected: torch.Tensor,
                       block_size: int, *, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over each query's selected key blocks, one key block at a time: (out, lse).

    query (B, H, T, D), key (B, Hkv, T, D), value (B, Hkv, T, Dv) with H a multiple of Hkv; selected (B, H, T, nB)
    bool (e.g. :func:`~attncourse.learned_sparse.moba_gate`), nB = ceil(T / block_size). For every batch, KV head and
    key block the queries of the group that chose the block are gathered, scored against the block's keys (causally
    inside a query's own block), and merged into their running (max, sum, output). Returns out (B, H, T, Dv) in the
    query's dtype and lse (B, H, T) in float32 (float64 for float64 inputs); a query that selected nothing gets 0.

    Raises ValueError/TypeError for tensors of the wrong rank, shapes that disagree, H not a multiple of Hkv, a
    selection that is not bool or not (B, H, T, nB), or a block_size that is not a positive int.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if _validate.tensor(name, x, min_rank=4, floating=True).dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, heads, T, dim), got shape {tuple(x.shape)}")
    _validate.positive_int("block_size", block_size)
    b, h, t, d = query.shape
    hkv = key.shape[1]
    if key.shape[0] != b or key.shape[2] != t or key.shape[3] != d or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"key (B, Hkv, T, D) and value (B, Hkv, T, Dv) must match query (B, H, T, D): got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if h % hkv:
        raise ValueError(f"the query heads ({h}) must be a multiple of the KV heads ({hkv})")
    nb = n_blocks(t, block_size)
    if not isinstance(selected, torch.Tensor) or selected.dtype != torch.bool:
        raise TypeError(f"selected must be a bool tensor, got {getattr(selected, 'dtype', type(selected).__name__)}")
    if tuple(selected.shape) != (b, h, t, nb):
        raise ValueError(f"selected must be (B, H, T, nB) = {(b, h, t, nb)}, got {tuple(selected.shape)}")
    g = h // hkv
    work = _compute_dtype(query.dtype)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q = query.to(work).reshape(b, hkv, g * t, d)  # (B, Hkv, G*T, D): the group's queries as one list of rows
    k, v = key.to(work), value.to(work)
    pos = torch.arange(t, device=query.device).repeat(g)  # (G*T,) each row's position
    m = q.new_full((b, hkv, g * t), -math.inf)
    state = AttentionState(m, torch.zeros_like(m), q.new_zeros(b, hkv, g * t, value.shape[-1]))
    chosen = selected.reshape(b, hkv, g * t, nb)  # (B, Hkv, G*T, nB)
    for bi in range(b):
        for hi in range(hkv):
            for j in range(nb):
                rows = chosen[bi, hi, :, j].nonzero().squeeze(1)  # (n,) the rows that chose block j
                if rows.numel() == 0:
                    continue
                k0, k1 = j * block_size, min((j + 1) * block_size, t)
                s = (q[bi, hi, rows] @ k[bi, hi, k0:k1].transpose(0, 1)) * scale  # (n, D) @ (D, Bk) -> (n, Bk)
                s = s.masked_fill(torch.arange(k0, k1, device=s.device)[None, :] > pos[rows, None], -math.inf)
                part = AttentionState(state.m[bi, hi, rows], state.l[bi, hi, rows], state.acc[bi, hi, rows])
                part = online_attention_update(part, s, v[bi, hi, k0:k1])
                state.m[bi, hi, rows], state.l[bi, hi, rows], state.acc[bi, hi, rows] = part
    out, lse = finalize_attention_state(state)
    return out.reshape(b, h, t, -1).to(query.dtype), lse.reshape(b, h, t)
