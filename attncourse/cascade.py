r"""Cascade attention (FlashInfer's "cascade inference"; vLLM's ``cascade_attention``): attention for many requests
that share a prompt prefix, with the shared prefix read once for all of them (chapter 11).

A prefix cache (:class:`~attncourse.PrefixCache`, :class:`~attncourse.radix_cache.RadixCache`) already stores a shared
system prompt once; plain decoding still reads its keys and values once *per request*. Attention over
``[prefix; suffix_r]`` splits over the two key sets, because softmax attention over a union of keys is the merge of
the two partial results by their log-sum-exps (the online softmax of chapter 08):

.. math:: o = \frac{e^{\mathrm{lse}_p} o_p + e^{\mathrm{lse}_s} o_s}{e^{\mathrm{lse}_p} + e^{\mathrm{lse}_s}}

so the prefix part is one matmul of *all* requests' queries against the one copy of the prefix (a shared-key
batch: the prefix is read once), the suffix part is per request, and the merge is per query.
"""

from __future__ import annotations

import torch

from . import _validate
from .online_softmax import online_attention

__all__ = ["merge_attention_outputs", "cascade_attention"]


def merge_attention_outputs(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys of `a` and of `b` together from the two partial results: outputs (..., Tq, Dv) and
    log-sum-exps (..., Tq) (``-inf`` where a part saw no key). Returns (out, lse)."""
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        _validate.tensor(name, t, floating=True)
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"out_a {tuple(out_a.shape)}, out_b {tuple(out_b.shape)} must match and be lse "
                         f"{tuple(lse_a.shape)} + (Dv,), lse_b {tuple(lse_b.shape)}")
    lse = torch.logaddexp(lse_a, lse_b)  # (..., Tq)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_a - safe)[..., None]  # (..., Tq, 1): part a's share of the row
    wb = torch.exp(lse_b - safe)[..., None]
    return wa * out_a.to(lse.dtype) + wb * out_b.to(lse.dtype), lse


def cascade_attention(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                      suffix_key: torch.Tensor, suffix_value: torch.Tensor, suffix_lengths: torch.Tensor | None = None,
                      *, scale: float | None = None, chunk_size: int = 128) -> torch.Tensor:
    """Attention of R requests over one shared prefix and each request's own suffix.

    Args:
        query (R, H, Tq, D): the last Tq tokens of each request (Tq = 1 when decoding); they sit at the end of the
            request's suffix, so query i sees the whole prefix and suffix keys up to its own position (causal,
            bottom-right aligned within the suffix).
        prefix_key, prefix_value (H, P, D), (H, P, Dv): the shared prefix, stored once.
        suffix_key, suffix_value (R, H, S, D), (R, H, S, Dv): each request's suffix, padded to S.
        suffix_lengths (R,): the real suffix lengths (default S); each must be at least Tq.
    Returns (R, H, Tq, Dv) in the query's dtype, equal to attention over ``[prefix; suffix_r]``.
    """
    for name, t in (("query", query), ("prefix_key", prefix_key), ("prefix_value", prefix_value),
                    ("suffix_key", suffix_key), ("suffix_value", suffix_value)):
        _validate.tensor(name, t, floating=True)
    if query.dim() != 4 or prefix_key.dim() != 3 or suffix_key.dim() != 4:
        raise ValueError(f"query (R, H, Tq, D), prefix_key (H, P, D), suffix_key (R, H, S, D) needed, got "
                         f"{tuple(query.shape)}, {tuple(prefix_key.shape)}, {tuple(suffix_key.shape)}")
    r, h, t_q, d = query.shape
    s = suffix_key.shape[2]
    if prefix_key.shape[0] != h or prefix_key.shape[2] != d or prefix_value.shape[:2] != prefix_key.shape[:2] or \
            suffix_key.shape[:2] != (r, h) or suffix_key.shape[3] != d or \
            suffix_value.shape[:3] != suffix_key.shape[:3] or suffix_value.shape[3] != prefix_value.shape[2]:
        raise ValueError(f"shapes do not fit: query {tuple(query.shape)}, prefix_key {tuple(prefix_key.shape)}, "
                         f"prefix_value {tuple(prefix_value.shape)}, suffix_key {tuple(suffix_key.shape)}, "
                         f"suffix_value {tuple(suffix_value.shape)}")
    lengths = torch.full((r,), s) if suffix_lengths is None else suffix_lengths
    if not isinstance(lengths, torch.Tensor) or lengths.shape != (r,) or lengths.is_floating_point():
        raise ValueError(f"suffix_lengths must be an integer tensor of shape (R,) = ({r},), got {lengths!r}")
    if bool((lengths < t_q).any()) or bool((lengths > s).any()):
        raise ValueError(f"suffix_lengths must lie in [Tq, S] = [{t_q}, {s}], got {lengths.tolist()}")
    # 1. the shared prefix: every request's queries against the one copy, as one batch of R * Tq queries per head
    q_all = query.transpose(0, 1).reshape(h, r * t_q, d)  # (R, H, Tq, D) -> (H, R * Tq, D)
    out_p, lse_p = online_attention(q_all, prefix_key, prefix_value, scale=scale, chunk_size=chunk_size)
    out_p = out_p.reshape(h, r, t_q, -1).transpose(0, 1)  # (R, H, Tq, Dv)
    lse_p = lse_p.reshape(h, r, t_q).transpose(0, 1)  # (R, H, Tq)
    # 2. each request's suffix: query i (at suffix position len - Tq + i) sees suffix keys 0 .. len - Tq + i
    pos = lengths.view(r, 1) - t_q + torch.arange(t_q).view(1, t_q)  # (R, Tq) the queries' suffix positions
    keep = torch.arange(s).view(1, 1, s) <= pos[..., None]  # (R, Tq, S)
    out_s, lse_s = online_attention(query, suffix_key, suffix_value, keep[:, None].to(query.device), scale=scale,
                                    chunk_size=chunk_size)
    out, _ = merge_attention_outputs(out_p, lse_p, out_s, lse_s)
    return out.to(query.dtype)
