r"""Sparse attention patterns as mask functions, and what they cost.

Every factory here returns a ``mask_mod`` ``(b, h, q_idx, kv_idx) -> bool`` in the convention of
:mod:`attncourse.masks` (True = may attend), so the patterns compose with ``and_masks`` / ``or_masks``,
become dense masks through ``masks.materialize`` and feed FlexAttention unchanged.

=====================  ==============================================  ======================
pattern                query i may attend to key j when                scored pairs
=====================  ==============================================  ======================
sliding window         ``0 <= i - j < w`` (``masks.sliding_window``)    O(T w)
:func:`dilated`        ``i - j = d*m`` for m = 0 .. w-1                 O(T w)
:func:`log_dilated`    dense near, exponentially sparser far away      O(T log T)
:func:`longformer`     ``|i - j| <= w//2``, or i or j a global token    O(T (w + g))
:func:`bigbird`        Longformer + r random key blocks per query      O(T (w + g + r))
=====================  ==============================================  ======================

:func:`count_scored_pairs` counts the pairs a pattern keeps, one block of query rows at a time.
:func:`gathered_attention` gathers each query's allowed keys, padded to the widest row: it equals dense
attention under the mask, but its memory and work are O(Tq N D) with N the most keys any query sees, so one
global token (N = Tk) makes it build a (Tq, Tk, D) tensor, far more than dense attention's (Tq, Tk) scores.
Sparsity pays at the granularity of tiles instead: see :mod:`attncourse.block_sparse`.
"""

from __future__ import annotations

import math

import torch

from . import _validate
from .masks import MaskMod, and_masks, causal, materialize_at, or_masks
from .sdpa import _check_qkv, compute_dtype, safe_softmax

__all__ = ["dilated", "log_dilated", "local", "global_tokens", "longformer", "bigbird_random",
           "bigbird", "count_scored_pairs", "gathered_attention", "allowed_keys"]


def _nonneg_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _named(mask: MaskMod, name: str) -> MaskMod:
    mask.__name__ = name
    return mask


def dilated(window: int, dilation: int) -> MaskMod:
    """Causal dilated window (Longformer's dilated sliding window, Beltagy et al. 2020, section 3.1): query i
    sees keys i, i - d, ..., i - (w-1) d (w keys spread over w*d).

    ``dilation=1`` is ``masks.sliding_window(window)``. Different heads often use different
    dilations so that together they cover every offset.
    """
    _validate.positive_int("window", window)
    _validate.positive_int("dilation", dilation)

    def mask(b, h, q_idx, kv_idx):
        gap = q_idx - kv_idx
        return (gap >= 0) & (gap < window * dilation) & (gap % dilation == 0)

    return _named(mask, f"dilated_{window}x{dilation}")


def log_dilated(window: int) -> MaskMod:
    r"""Causal, dense near the query and exponentially sparser far from it (the LongNet idea).

    Level :math:`\ell = 0, 1, 2, \dots` covers the gaps :math:`[w(2^\ell - 1),\ w(2^{\ell+1} - 1))` with
    stride :math:`2^\ell`: w keys per level, and about :math:`\log_2(T / w)` levels, so each query scores
    O(w log T) keys and the whole pattern O(T w log T). (LongNet itself splits the sequence into
    segments with geometrically growing segment lengths and dilations, which makes it linear.)
    """
    _validate.positive_int("window", window)

    def mask(b, h, q_idx, kv_idx):
        gap = q_idx - kv_idx
        level = torch.floor(torch.log2(gap.clamp(min=0).double() / window + 1.0)).long()  # gap's level
        stride = torch.pow(2, level)  # 1, 2, 4, ...
        return (gap >= 0) & (gap % stride == 0)

    return _named(mask, f"log_dilated_{window}")


def local(window: int) -> MaskMod:
    """Bidirectional local band: query i sees keys j with ``|i - j| <= window // 2`` (an encoder's window)."""
    _validate.positive_int("window", window)
    half = window // 2

    def mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= half

    return _named(mask, f"local_{window}")


def global_tokens(n_global: int) -> MaskMod:
    """The first `n_global` tokens are global: they see every key and every query sees them."""
    _nonneg_int("n_global", n_global)

    def mask(b, h, q_idx, kv_idx):
        return (q_idx < n_global) | (kv_idx < n_global)

    return _named(mask, f"global_{n_global}")


def longformer(window: int, n_global: int, *, is_causal: bool = False) -> MaskMod:
    """Longformer: a local band of width `window` plus `n_global` global tokens (e.g. [CLS]).

    ``is_causal=True`` keeps only keys j <= i (a decoder's version).
    """
    mod = or_masks(local(window), global_tokens(n_global))
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    return _named(and_masks(causal, mod) if is_causal else mod,
                  f"longformer_{window}_{n_global}" + ("_causal" if is_causal else ""))


def bigbird_random(seq_len: int, n_random: int, *, block_size: int = 1, seed: int = 0,
                   is_causal: bool = False) -> MaskMod:
    """BigBird's random part: each block of `block_size` queries sees `n_random` key blocks drawn at random.

    The draw is made here, once, with a ``torch.Generator`` seeded by `seed` (same seed, same mask), over
    the ``ceil(seq_len / block_size)`` blocks (only blocks at or before the query's block when
    `is_causal`). The mask is valid for indices below `seq_len`.
    """
    _validate.positive_int("seq_len", seq_len)
    _nonneg_int("n_random", n_random)
    _validate.positive_int("block_size", block_size)
    _nonneg_int("seed", seed)
    n_blocks = math.ceil(seq_len / block_size)
    gen = torch.Generator().manual_seed(seed)
    table = torch.zeros(n_blocks, n_blocks, dtype=torch.bool)  # (query block, key block)
    for qb in range(n_blocks):
        choices = qb + 1 if is_causal else n_blocks
        picks = torch.randperm(choices, generator=gen)[:n_random]
        table[qb, picks] = True

    def mask(b, h, q_idx, kv_idx):
        return table.to(q_idx.device)[q_idx // block_size, kv_idx // block_size]

    mask.table = table  # the drawn (query block, key block) table, for plots and tests
    return _named(mask, f"bigbird_random_{n_random}_seed{seed}")


def bigbird(seq_len: int, window: int, n_global: int, n_random: int, *, block_size: int = 1,
            seed: int = 0, is_causal: bool = False) -> MaskMod:
    """BigBird: local band + global tokens + random key blocks (Zaheer et al. 2020), for sequences of
    at most `seq_len` tokens. See :func:`longformer` and :func:`bigbird_random` for the parts."""
    mod = or_masks(local(window), global_tokens(n_global),
                   bigbird_random(seq_len, n_random, block_size=block_size, seed=seed, is_causal=is_causal))
    return _named(and_masks(causal, mod) if is_causal else mod,
                  f"bigbird_{window}_{n_global}_{n_random}" + ("_causal" if is_causal else ""))


def count_scored_pairs(mask_mod: MaskMod, q_len: int, k_len: int | None = None, *, rows: int = 512) -> int:
    """How many (query, key) pairs `mask_mod` allows in a (q_len, k_len) grid, evaluated `rows` query
    rows at a time so that long sequences never need the whole T x T mask."""
    k_len = q_len if k_len is None else k_len
    _validate.positive_int("q_len", q_len)
    _validate.positive_int("k_len", k_len)
    _validate.positive_int("rows", rows)
    keys = torch.arange(k_len)
    return sum(int(materialize_at(mask_mod, torch.arange(s, min(s + rows, q_len)), keys).sum())
               for s in range(0, q_len, rows))


def allowed_keys(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From a bool (Tq, Tk) mask, each query's allowed key indices padded to the widest row.

    Returns ``index`` (Tq, N) long (padding points at key 0) and ``valid`` (Tq, N) bool, N the largest
    number of keys any query may see (at least 1).
    """
    _validate.tensor("mask", mask, min_rank=2)
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool (Tq, Tk) tensor, got shape {tuple(mask.shape)}, dtype {mask.dtype}")
    counts = mask.sum(dim=-1)  # (Tq,)
    width = max(int(counts.max()), 1)
    # A stable sort puts the allowed keys first, in increasing order.
    order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices[:, :width]  # (Tq, N)
    valid = torch.arange(width)[None, :] < counts[:, None]  # (Tq, N)
    return torch.where(valid, order, torch.zeros_like(order)), valid


def gathered_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, *,
                       scale: float | None = None) -> torch.Tensor:
    """Attention computed only on the pairs a sparse `mask` allows: each query gathers its own keys.

    query (..., Tq, D), key (..., Tk, D), value (..., Tk, Dv), mask bool (Tq, Tk). Scores and weights are
    (..., Tq, N) with N the most keys any query sees, and the gathered keys and values (..., Tq, N, D): work and
    memory O(Tq N D). That pays only when every row sees few keys; with a global token N = Tk and the gathered
    keys alone are D times the dense score matrix. Equal to dense attention under the same mask; a query with
    no allowed key gets zeros. Kept to show why sparsity is done per tile (:mod:`attncourse.block_sparse`).
    """
    _check_qkv(query, key, value)
    _validate.tensor("mask", mask, min_rank=2)
    if mask.shape != (query.shape[-2], key.shape[-2]):
        raise ValueError(f"mask must be (Tq, Tk) = {(query.shape[-2], key.shape[-2])}, got {tuple(mask.shape)}")
    index, valid = allowed_keys(mask)  # (Tq, N) each
    dtype = value.dtype
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    # Float32 for half precision (the gathers' gradients also add up in float32), rounded once at the end.
    work = compute_dtype(query.dtype)
    query, key, value = query.to(work), key.to(work), value.to(work)
    k_sel = key[..., index, :]  # (..., Tk, D) -> (..., Tq, N, D)
    v_sel = value[..., index, :]  # (..., Tk, Dv) -> (..., Tq, N, Dv)
    scores = (k_sel @ query[..., None]).squeeze(-1) * scale  # (..., Tq, N, D) @ (..., Tq, D, 1) -> (..., Tq, N)
    weights = safe_softmax(scores.masked_fill(~valid, float("-inf")))  # (..., Tq, N)
    out = (weights[..., None, :] @ v_sel).squeeze(-2)  # (..., Tq, 1, N) @ (..., Tq, N, Dv) -> (..., Tq, Dv)
    return out.to(dtype)
