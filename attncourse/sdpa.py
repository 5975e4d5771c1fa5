r"""Scaled dot-product attention written out from matmul and softmax: the course's oracle.

.. math:: \mathrm{Attention}(Q, K, V) = \mathrm{softmax}\!\left(\frac{QK^\top}{\sqrt{d_k}} + M\right) V

Same results as :func:`torch.nn.functional.scaled_dot_product_attention` without dropout, except that a
query row with no allowed key gives zeros (output and weights) instead of NaN.
"""

from __future__ import annotations

import math

import torch

from . import _validate


def safe_softmax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax that subtracts the row max and returns zeros on rows that are entirely ``-inf``.

    Plain ``torch.softmax`` gives NaN on such a row (``-inf - (-inf)``); attention needs zeros there.
    """
    row_max = scores.amax(dim=dim, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - row_max)  # exp(-inf) = 0, so masked entries vanish
    total = exp.sum(dim=dim, keepdim=True)
    return exp / torch.where(total > 0, total, torch.ones_like(total))


def _check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        _validate.tensor(name, x, min_rank=2, floating=True)
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"query, key and value must have the same rank, got {shapes}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must share the last (head) dim, got {shapes}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must have the same length (dim -2), got {shapes}")
    try:
        torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    except RuntimeError:
        raise ValueError(f"leading (batch, head) dims do not broadcast: {shapes}") from None
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores and softmax are computed in: float32 for half precision (as PyTorch's kernels do)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean (Tq, Tk) mask, True where key j <= query i: top-left aligned, as PyTorch's ``is_causal``."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()


def key_padding_mask(lengths: torch.Tensor, k_len: int) -> torch.Tensor:
    """Boolean (B, 1, 1, Tk) keep-mask from each sequence's number of real keys: True at key positions < length.

    It broadcasts over heads and queries. ``nn.MultiheadAttention``'s ``key_padding_mask`` has the opposite
    polarity (True at padding) and shape (B, Tk): pass ``~mask[:, 0, 0]`` there.
    """
    _validate.tensor("lengths", lengths, min_rank=1)
    _validate.positive_int("k_len", k_len)
    if lengths.dim() != 1 or lengths.is_floating_point() or bool((lengths < 0).any() or (lengths > k_len).any()):
        raise ValueError(f"lengths must be a 1-D integer tensor with values in [0, k_len={k_len}], "
                         f"got shape {tuple(lengths.shape)} and values {lengths.tolist()[:8]}")
    keep = torch.arange(k_len, device=lengths.device) < lengths[:, None]  # (B, Tk)
    return keep[:, None, None, :]


def apply_mask(scores: torch.Tensor, attn_mask: torch.Tensor | None = None, *, is_causal: bool = False
               ) -> torch.Tensor:
    """Scores (..., Tq, Tk) with the course's mask convention applied: a boolean `attn_mask` puts -inf where
    it is False, a float one is added, `is_causal` blocks keys after the query (top-left aligned)."""
    q_len, k_len = scores.shape[-2:]
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        _validate.broadcastable("attn_mask", tuple(attn_mask.shape), tuple(scores.shape), "scores")
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        elif attn_mask.is_floating_point():
            scores = scores + attn_mask.to(scores.dtype)
        else:
            raise TypeError(f"attn_mask must be bool or floating point, got dtype {attn_mask.dtype}")
    if is_causal:
        allowed = causal_mask(q_len, k_len, device=scores.device)  # (Tq, Tk)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of `query` (..., Tq, D) over `key` (..., Tk, D) and `value` (..., Tk, Dv).

    Args:
        attn_mask: boolean (True = may attend) or float (added to the scores), broadcastable to
            (..., Tq, Tk).
        is_causal: apply a top-left aligned causal mask (query i sees keys 0..i), like PyTorch.
        scale: defaults to 1/sqrt(D).
        return_weights: also return the attention weights (..., Tq, Tk).

    Returns:
        out (..., Tq, Dv), and the weights if asked. Fully masked rows give zeros, never NaN.
    """
    _check_qkv(query, key, value)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])

    # Half precision: scores, softmax and the weighted sum in float32, rounded once at the end, as PyTorch's
    # kernels do (compute_dtype). Other dtypes compute in their own precision.
    work = compute_dtype(query.dtype)
    q, k, v = query.to(work), key.to(work), value.to(work)
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., Tq, D) @ (..., D, Tk) -> (..., Tq, Tk)
    scores = apply_mask(scores, attn_mask, is_causal=is_causal)
    weights = safe_softmax(scores)
    out = (weights @ v).to(value.dtype)  # (..., Tq, Tk) @ (..., Tk, Dv) -> (..., Tq, Dv)
    weights = weights.to(value.dtype)
    return (out, weights) if return_weights else out
