r"""Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", arXiv:2406.10774):
training-free page selection for decoding from a dense-trained model.

Quest keeps, for each page of ``page_size`` cached keys, two vectors: the per-channel minimum :math:`m` and maximum
:math:`M` of the page's keys. For a query :math:`q`, every key :math:`k` of the page has :math:`k_c \in [m_c, M_c]`, so

.. math:: q \cdot k \;\le\; \sum_c \max(q_c m_c,\; q_c M_c),

an upper bound on the best single score in the page. Quest reads the pages with the largest bounds. MoBA's gate
(:func:`attncourse.learned_sparse.moba_gate`) ranks by the page's *mean* key instead: an estimate of a typical score,
where one key that matches the query is diluted by the page size; the bound is set by the extremes.
"""

from __future__ import annotations

import torch

from . import _validate
from .learned_sparse import n_blocks
from .sdpa import compute_dtype as _compute_dtype

__all__ = ["page_bounds", "quest_scores"]


def page_bounds(key: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., S, D) keys -> (minimum, maximum), each (..., nP, D): per channel, over each page's real keys.

    ``nP = ceil(S / page_size)``; the last page may be short (its bounds cover only the keys it holds).
    Raises: TypeError for a non-tensor or a non-floating key, ValueError for rank < 2 or page_size < 1.
    """
    _validate.tensor("key", key, min_rank=2, floating=True)
    _validate.positive_int("page_size", page_size)
    s, d = key.shape[-2], key.shape[-1]
    n_pages = n_blocks(s, page_size)
    pad = n_pages * page_size - s
    paged = lambda fill: torch.cat([key, key.new_full((*key.shape[:-2], pad, d), fill)], -2).unflatten(  # noqa: E731
        -2, (n_pages, page_size))  # (..., nP, page, D), the padding never wins the min or the max
    return paged(float("inf")).amin(-2), paged(float("-inf")).amax(-2)


def quest_scores(query: torch.Tensor, key: torch.Tensor, page_size: int) -> torch.Tensor:
    """Quest's page criticality: query (B, H, Tq, D) against key (B, Hkv, S, D) -> (B, H, Tq, nP).

    Entry (b, h, t, p) is :math:`\\sum_c \\max(q_c m_{pc}, q_c M_{pc})` for query head h's KV head, never below the
    largest :math:`q \\cdot k` of page p. Causality is the caller's (Quest runs at decode, over pages already written).
    Half-precision inputs are scored in float32; the result is in the compute dtype.
    Raises: TypeError, ValueError for non-tensors, ranks other than 4, or shapes that do not fit together.
    """
    for name, x in (("query", query), ("key", key)):
        _validate.tensor(name, x, min_rank=4, floating=True)
        if x.dim() != 4:
            raise ValueError(f"{name} must be (B, heads, T, D), got shape {tuple(x.shape)}")
    h, hkv = query.shape[1], key.shape[1]
    if key.shape[0] != query.shape[0] or key.shape[-1] != query.shape[-1] or h % hkv:
        raise ValueError(f"key {tuple(key.shape)} must be (B, Hkv, S, D) for query {tuple(query.shape)}, with the "
                         "query heads a multiple of the key heads")
    work = _compute_dtype(query.dtype)
    low, high = page_bounds(key.to(work), page_size)  # (B, Hkv, nP, D) each
    low, high = (x.repeat_interleave(h // hkv, dim=1)[:, :, None] for x in (low, high))  # (B, H, 1, nP, D)
    q = query.to(work)[:, :, :, None, :]  # (B, H, Tq, 1, D)
    return torch.maximum(q * low, q * high).sum(-1)  # (B, H, Tq, nP, D) -> (B, H, Tq, nP)
