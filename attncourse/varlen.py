"""Packed variable-length batches for the chunkwise recurrence (``cu_seqlens``, as FlashAttention's and
flash-linear-attention's varlen entry points take them).

Training batches of documents of different lengths are packed into one row of ``total`` tokens with the cumulative
lengths ``cu_seqlens = [0, T_0, T_0 + T_1, ..., total]``; no padding is stored. Each document must start from an empty
state and the state must not leak from one document into the next. :func:`chunked_varlen` scatters the packed tokens
into a (N, H, T_max, D) batch whose tails are *inert* tokens (k = 0, v = 0, beta = 0, g = 0: no write and no decay, so
the state is unchanged), runs :func:`attncourse.linear_attention.chunked` once on the whole batch, and gathers the
outputs back. The final state of each document is the batch's final state: the inert tail leaves it as it was at the
document's last token. fla's varlen kernels instead index chunks per document without the padded copy; the result is
the same, which the tests check against one run per document.
"""

from __future__ import annotations

import torch

from . import _validate
from . import linear_attention as la


def _check_cu(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    _validate.tensor("cu_seqlens", cu_seqlens, min_rank=1)
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [0, ..., total] of N + 1 entries, got "
                         f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
    lengths = cu_seqlens.diff()
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total or bool((lengths <= 0).any()):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to the packed length {total}, got {cu_seqlens.tolist()}")
    return lengths


def chunked_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                   g: torch.Tensor | None = None, beta: torch.Tensor | None = None, chunk_size: int = 64,
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunkwise recurrence over N packed documents, each from a zero state.

    Args:
        q, k: (1, H, total, Dk); v: (1, H, total, Dv); g: None, (1, H, total) or (1, H, total, Dk); beta: None or
            (1, H, total). cu_seqlens: (N + 1,) int, 0 = cu[0] < cu[1] < ... < cu[N] = total.
        chunk_size, scale: as :func:`attncourse.linear_attention.chunked`.
    Returns:
        (o, states): o (1, H, total, Dv) packed like the inputs; states (N, H, Dk, Dv), each document's final state.
    Raises:
        TypeError, ValueError: for non-tensors, a batch dimension other than 1, or a bad cu_seqlens.
    """
    la._check(q, k, v, g, beta)
    if q.shape[0] != 1:
        raise ValueError(f"packed inputs have batch size 1, got q of shape {tuple(q.shape)}")
    lengths = _check_cu(cu_seqlens, q.shape[2])
    n, t_max = lengths.numel(), int(lengths.max())
    doc = torch.repeat_interleave(torch.arange(n), lengths.cpu())  # (total,) the document of each packed token
    pos = torch.arange(q.shape[2]) - cu_seqlens.cpu()[doc]  # (total,) its position inside the document

    def unpack(x: torch.Tensor | None) -> torch.Tensor | None:  # (1, H, total, ...) -> (N, H, T_max, ...), zero tails
        if x is None:
            return None
        out = x.new_zeros(n, x.shape[1], t_max, *x.shape[3:])
        out[doc, :, pos] = x[0].transpose(0, 1)  # (total, H, ...) into (N, T_max, H, ...) positions
        return out

    o, states = la.chunked(unpack(q), unpack(k), unpack(v), unpack(g), unpack(beta), chunk_size=chunk_size,
                           scale=scale)  # (N, H, T_max, Dv), (N, H, Dk, Dv)
    return o[doc, :, pos].transpose(0, 1)[None], states
