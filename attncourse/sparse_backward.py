r"""The backward of selected-block attention as a kernel does it: a loop over key blocks, each visiting only the
queries that chose it, with work proportional to the selection.

:func:`attncourse.learned_sparse.selected_attention` runs the forward query tile by query tile over the blocks each
query selected, and keeps the output and the log-sum-exp. FlashAttention-2's backward (Dao 2023, Algorithm 2) loops
the other way, over key blocks: block :math:`b`'s :math:`dK_b` and :math:`dV_b` are sums over the queries that read
it, so a program that owns block :math:`b` writes them without atomics, and needs the list of those queries, the
selection transposed. For each such (query rows, key block) pair it recomputes the scores and probabilities from the
stored log-sum-exp, :math:`P = \exp(S - \mathrm{lse})`, and does

.. math:: dV_b \mathrel{+}= P^\top dO, \quad dP = dO\, V_b^\top, \quad dS = P \odot (dP - \delta), \quad
          dK_b \mathrel{+}= dS^\top Q\, s, \quad dQ \mathrel{+}= dS\, K_b\, s,

with :math:`\delta_t = dO_t \cdot O_t` and :math:`s` the scale. :math:`dQ` of a query collects from every block it
chose: in this loop that is the scattered write (a kernel adds it atomically, or runs a second pass over queries, as
NSA's and flash-linear-attention's backward kernels do). :func:`selected_backward` counts the scores it recomputes;
they equal the forward's, query by query.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _validate
from .learned_sparse import n_blocks
from .sdpa import compute_dtype as _compute_dtype

__all__ = ["SelectedGrads", "selected_backward"]


class SelectedGrads(NamedTuple):
    """dq (B, H, T, D), dk (B, Hkv, T, D), dv (B, Hkv, T, Dv); ``pairs``: query-key scores recomputed (summed over
    batch and heads); ``per_block``: (B, Hkv, nB) query rows (over the group's heads) each key block visited."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    pairs: int
    per_block: torch.Tensor


def selected_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, selected: torch.Tensor,
                      block_size: int, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, *,
                      scale: float | None = None) -> SelectedGrads:
    """Gradients of causal selected-block attention, key block by key block (see the module's docstring).

    query (B, H, T, D), key (B, Hkv, T, D), value (B, Hkv, T, Dv), selected (B, H or Hkv, T, nB) bool as for
    :func:`attncourse.learned_sparse.selected_attention`; out (B, H, T, Dv) and lse (B, H, T) what its forward
    returned; grad_out (B, H, T, Dv). Rows that selected nothing (lse -inf) get no gradient.
    """
    for name, x in (("query", query), ("key", key), ("value", value), ("out", out), ("grad_out", grad_out)):
        _validate.tensor(name, x, min_rank=4, floating=True)
    b, h, t, d = query.shape
    hkv = key.shape[1]
    nb = n_blocks(t, block_size)
    if key.shape != (b, hkv, t, d) or value.shape[:3] != (b, hkv, t) or h % hkv:
        raise ValueError(f"key (B, Hkv, T, D) and value (B, Hkv, T, Dv) must fit query {tuple(query.shape)} with H a "
                         f"multiple of Hkv, got key {tuple(key.shape)}, value {tuple(value.shape)}")
    if out.shape != (b, h, t, value.shape[-1]) or grad_out.shape != out.shape or tuple(lse.shape) != (b, h, t):
        raise ValueError(f"out and grad_out must be (B, H, T, Dv) = {(b, h, t, value.shape[-1])} and lse (B, H, T), "
                         f"got out {tuple(out.shape)}, grad_out {tuple(grad_out.shape)}, lse {tuple(lse.shape)}")
    if selected.dtype != torch.bool or selected.shape[0] != b or selected.shape[1] not in (h, hkv) \
            or tuple(selected.shape[2:]) != (t, nb):
        raise ValueError(f"selected must be bool (B, H or Hkv, T, nB) = ({b}, {h} or {hkv}, {t}, {nb}), got "
                         f"{selected.dtype} {tuple(selected.shape)}")
    g = h // hkv
    scale = d ** -0.5 if scale is None else float(scale)
    work = _compute_dtype(query.dtype)
    q = query.to(work).reshape(b, hkv, g * t, d)  # (B, Hkv, G T, D): the group's query rows, head-major
    k, v = key.to(work), value.to(work)
    do = grad_out.to(work).reshape(b, hkv, g * t, -1)  # (B, Hkv, G T, Dv)
    delta = (do * out.to(work).reshape(b, hkv, g * t, -1)).sum(-1)  # (B, Hkv, G T): dO_t . O_t
    l_rows = lse.to(work).reshape(b, hkv, g * t)
    sel = selected.expand(b, h, t, nb) if selected.shape[1] == h else selected.repeat_interleave(g, 1)
    sel_t = sel.reshape(b, hkv, g * t, nb).transpose(-2, -1)  # (B, Hkv, nB, G T): block -> the rows that chose it
    pos = torch.arange(t).repeat(g)  # (G T,) each row's position
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    per_block = torch.zeros(b, hkv, nb, dtype=torch.long)
    pairs = 0
    for bi in range(b):
        for kh in range(hkv):
            for blk in range(nb):
                rows = torch.nonzero(sel_t[bi, kh, blk]).flatten()  # the queries (of any head) that read block blk
                rows = rows[torch.isfinite(l_rows[bi, kh, rows])]
                if rows.numel() == 0:
                    continue
                k0, k1 = blk * block_size, min((blk + 1) * block_size, t)
                kb, vb, qr, dor = k[bi, kh, k0:k1], v[bi, kh, k0:k1], q[bi, kh, rows], do[bi, kh, rows]
                s = qr @ kb.T * scale  # (R, Bk) recomputed scores
                s = s.masked_fill(torch.arange(k0, k1)[None, :] > pos[rows][:, None], float("-inf"))  # causal
                p = torch.exp(s - l_rows[bi, kh, rows, None])  # (R, Bk) the forward's probabilities
                dv[bi, kh, k0:k1] += p.T @ dor  # (Bk, R) @ (R, Dv)
                ds = p * (dor @ vb.T - delta[bi, kh, rows, None])  # (R, Bk)
                dk[bi, kh, k0:k1] += ds.T @ qr * scale  # written by this block's loop alone
                dq[bi, kh].index_add_(0, rows, ds @ kb * scale)  # the scattered write
                per_block[bi, kh, blk] = rows.numel()
                pairs += int((s > float("-inf")).sum())
    return SelectedGrads(dq.reshape(b, h, t, d).to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), pairs,
                         per_block)
