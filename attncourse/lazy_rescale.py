r"""FlashAttention-4's conditional rescaling: one-pass attention in base 2 whose running reference max moves only
past a threshold (re-exported by :mod:`attncourse.online_softmax`, whose helpers it uses)."""

from __future__ import annotations

import torch

from . import _validate
from .online_softmax import _NEG_INF, _divide, _safe
from .sdpa import _check_qkv, causal_mask
from .sdpa import compute_dtype as _compute_dtype

__all__ = ["lazy_rescale_attention"]

_LOG2E = 1.4426950408889634  # log2(e): e^x = 2^(x log2 e)
_LN2 = 0.6931471805599453


def lazy_rescale_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    chunk_size: int = 128,
    threshold: float = 8.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    r"""One-pass attention in base 2 with **conditional rescaling** (the idea of FlashAttention-4's Blackwell kernel).

    Scores are kept in base-2 units, :math:`s_2 = (q \cdot k)\, \mathrm{scale} \cdot \log_2 e`, so every exponential
    is an ``exp2``. The accumulator and the running sum are kept relative to a reference max :math:`r` that is
    moved (and the old values rescaled by :math:`2^{r - r'}`) only when a chunk's max exceeds :math:`r` by more
    than `threshold` (base-2 units, so the unnormalised terms stay below :math:`2^{\mathrm{threshold}}`). The
    result is exact: accumulator and sum share the same reference, and ``acc / l`` does not depend on it.
    ``threshold=0`` is the ordinary online softmax (a rescale whenever the max grows).

    Args: query (..., Tq, D), key (..., Tk, D), value (..., Tk, Dv); is_causal (top-left, as
    ``F.scaled_dot_product_attention``); chunk_size keys per step (positive int); threshold >= 0.

    Returns:
        out (..., Tq, Dv) in value's dtype (zeros on fully masked rows), lse (..., Tq) in natural log, and counts
        ``{"max_grew": ..., "rescaled": ...}``: over all (row, chunk) pairs after a row's first finite max, how
        often its running max grew (what the ordinary online softmax rescales) and how often this one rescaled.

    Raises:
        TypeError/ValueError: bad tensors or shapes (as :func:`online_attention`), a non-positive chunk_size,
        a negative or non-numeric threshold.
    """
    _check_qkv(query, key, value)
    size = _validate.positive_int("chunk_size", chunk_size)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(f"threshold must be a number >= 0 (base-2 units), got {threshold!r}")
    q_len, k_len, dv = query.shape[-2], key.shape[-2], value.shape[-1]
    lead = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    dtype = _compute_dtype(query.dtype)
    q = query.to(dtype) * (query.shape[-1] ** -0.5 * _LOG2E)  # (..., Tq, D): scale and log2(e) folded into q
    ref = torch.full((*lead, q_len), _NEG_INF, dtype=dtype, device=query.device)  # (..., Tq) reference max
    top = ref.clone()  # (..., Tq) the true running max, to count what the ordinary algorithm would rescale
    l = torch.zeros_like(ref)  # noqa: E741
    acc = torch.zeros(*lead, q_len, dv, dtype=dtype, device=query.device)  # (..., Tq, Dv)
    grew = rescaled = 0
    for start in range(0, k_len, size):
        stop = min(start + size, k_len)
        s = q @ key[..., start:stop, :].to(dtype).transpose(-2, -1)  # (..., Tq, C) in base-2 units
        if is_causal:
            s = s.masked_fill(~causal_mask(q_len, k_len, device=s.device)[:, start:stop], _NEG_INF)
        c_max = s.amax(dim=-1)  # (..., Tq)
        new_top = torch.maximum(top, c_max)
        grew += int(((new_top > top) & torch.isfinite(top)).sum())
        top = new_top
        need = c_max > ref + threshold  # (..., Tq): move the reference only past the threshold
        rescaled += int((need & torch.isfinite(ref)).sum())
        new_ref = torch.where(need, c_max, ref)
        alpha = torch.where(need, torch.exp2(ref - _safe(new_ref)), torch.ones_like(ref))  # (..., Tq)
        p = torch.exp2(s - _safe(new_ref)[..., None])  # (..., Tq, C), each term below 2^threshold
        l = alpha * l + p.sum(dim=-1)  # noqa: E741
        acc = alpha[..., None] * acc + p @ value[..., start:stop, :].to(dtype)  # (..., Tq, Dv)
        ref = new_ref
    out = _divide(acc, l[..., None])
    lse = (ref + torch.log2(l)) * _LN2  # (..., Tq): -inf on fully masked rows
    return out.to(value.dtype), lse, {"max_grew": grew, "rescaled": rescaled}
