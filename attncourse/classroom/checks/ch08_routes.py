"""Chapter 08's shortcuts and breakers (answers built on forbidden functions, right outputs computed the
wrong way), kept apart from the exercises in ch08.py so that each module stays readable; and the operator classes that
exercise 2's property counts (reductions; statistics of a row)."""

from __future__ import annotations
import functools
import math
import re
import torch
from attncourse.online_softmax import (AttentionState, SoftmaxState, finalize_attention_state, merge_attention_states,
                                       merge_softmax_states, online_softmax_trace, softmax_state)
from . import Case, edits, exercise

NEG_INF = float("-inf")


def _op(name: str) -> str:
    return name.split("::")[-1].split(".")[0]


_REDUCTIONS = re.compile(r"^(sum|nansum|mean|nanmean|amax|amin|max|min|aminmax|prod|all|any|norm|linalg_vector_norm|"
                         r"var|std|var_mean|std_mean|cumsum|cumprod|cummax|cummin|sort|topk|argmax|argmin|median|"
                         r"nanmedian|kthvalue|mode|count_nonzero|logsumexp|logcumsumexp|mm|mv|bmm|addmm|addmv|matmul|"
                         r"dot|vdot|inner|outer|linear|einsum|tensordot|baddbmm|addbmm|chain_matmul|multi_dot|"
                         r"\w*pool\w*|\w*conv\w*|convolution\w*|cudnn\w*|mkldnn\w*|embedding_bag\w*|"
                         r"segment_reduce|scatter_reduce\w*|scatter_add\w*|index_add\w*|index_reduce\w*|"
                         r"bincount|histc|histogram\w*|trapz|trapezoid|cumulative_trapezoid|renorm|"
                         r"unique\w*|searchsorted|bucketize|nanquantile|quantile|msort|argsort|fft_\w*|_fft_\w*|"
                         r"\w*_loss|\w*_loss_forward|cross_entropy\w*|nll_loss\w*|cosine_similarity|pdist|cdist|"
                         r"_cdist_forward|_euclidean_dist)$")


_STATISTICS = re.compile(r"^(exp|exp2|expm1|log|log2|log10|log1p|logaddexp|logaddexp2|pow|float_power|sigmoid|"
                         r"softplus|maximum|minimum|fmax|fmin|xlogy|special_\w*)_?$")


def _statistics(ops) -> int:
    """The operators among ``ops`` that compute a statistic of the row (a reduction, an exponential or logarithm,
    a running maximum), as opposed to applying one (a subtraction, a copy, a concatenation, a mask)."""
    return sum(bool(_REDUCTIONS.match(_op(name).lstrip("_")) or _STATISTICS.match(_op(name).lstrip("_")))
               for name, *_ in ops)


def _shortcut_merge_fold(m_all, l_all):
    """A left fold of the package's pairwise merge: must be refused."""
    states = [SoftmaxState(m, l) for m, l in zip(m_all, l_all)]
    return tuple(functools.reduce(merge_softmax_states, states))


def _shortcut_merge_lse(m_all, l_all):
    """Through torch.logsumexp of the per-chunk log-sum-exps: must be refused."""
    m = torch.amax(m_all, 0)
    ref = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    lse = torch.logsumexp(m_all - ref + torch.log(l_all), dim=0)  # relative to the merged max: no cancellation
    return m, torch.exp(lse)


def _breaker_merge_pairwise(m_all, l_all):
    """A left fold of a hand-written pairwise merge: right, but one state at a time (refused by the property)."""
    m, l = m_all[0], l_all[0]
    for m_b, l_b in zip(m_all[1:], l_all[1:]):
        new = torch.maximum(m, m_b)
        ref = new.masked_fill(torch.isneginf(new), 0.0)
        l = l * torch.exp(m - ref) + l_b * torch.exp(m_b - ref)
        m = new
    return m, l


def _shortcut_log_softmax(chunks, chunk_size):
    """PyTorch's log_softmax of the chunks put back together, fully masked rows mended: must be refused."""
    x = torch.cat([c.clone() for c in chunks], dim=-1)
    return torch.where(torch.isneginf(x).all(dim=-1, keepdim=True), torch.full_like(x, NEG_INF), x.log_softmax(-1))


def _shortcut_logsumexp(chunks, chunk_size):
    """x minus torch.logsumexp of the row: must be refused."""
    x = torch.cat([c.clone() for c in chunks], dim=-1)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    return torch.where(torch.isneginf(lse), torch.full_like(x, NEG_INF), x - lse)


def _breaker_buffer_three_pass(chunks, chunk_size):
    """Keep every chunk, then the three-pass log-softmax over the whole row: refused by the property."""
    x = torch.cat([c.clone() for c in chunks], dim=-1)
    m = x.amax(dim=-1, keepdim=True)
    ref = m.masked_fill(torch.isneginf(m), 0.0)
    lse = torch.log(torch.exp(x - ref).sum(dim=-1, keepdim=True)) + ref
    return torch.where(torch.isneginf(lse), torch.full_like(x, NEG_INF), x - lse)


def _breaker_rewrite_at_each_chunk(chunks, chunk_size):
    """One pass, but everything written so far is shifted again (a new tensor) whenever a chunk arrives: about
    N^2 / C entries moved, where the correction could wait until the end. Refused by the property."""
    out = top = total = None
    for piece in chunks:
        if out is None:
            out = piece.new_empty(*piece.shape[:-1], 0)
            top = piece.new_full(piece.shape[:-1], NEG_INF)
            total = piece.new_zeros(piece.shape[:-1])
        top_now = torch.maximum(top, piece.amax(dim=-1))
        ref = top_now.masked_fill(torch.isneginf(top_now), 0.0)
        old = top.masked_fill(torch.isneginf(top), 0.0)
        out = torch.cat([out - (ref - old)[..., None], piece - ref[..., None]], dim=-1)
        total = total * torch.exp(top - ref) + torch.exp(piece - ref[..., None]).sum(dim=-1)
        top = top_now
    log_sum = torch.log(total)
    return torch.where(torch.isneginf(log_sum)[..., None], torch.full_like(out, NEG_INF), out - log_sum[..., None])


def _breaker_buffer_unit_axis(chunks, chunk_size):
    """Keep every chunk, then the three-pass log-softmax over the whole row moved to an axis before a trailing unit
    axis (the last axis is 1 wide): refused by the property, which counts the entries of a row a reduction holds."""
    x = torch.cat([c.clone() for c in chunks], dim=-1).unsqueeze(-1)  # (..., N, 1)
    m = x.amax(dim=-2, keepdim=True)
    ref = m.masked_fill(torch.isneginf(m), 0.0)
    lse = torch.log(torch.exp(x - ref).sum(dim=-2, keepdim=True)) + ref
    return torch.where(torch.isneginf(lse), torch.full_like(x, NEG_INF), x - lse).squeeze(-1)


def _breaker_buffer_two_pass(chunks, chunk_size):
    """Keep every chunk, then a max pass and a sum pass over the kept chunks (each reduction a chunk wide)."""
    kept = [c.clone() for c in chunks]
    m = kept[0].amax(dim=-1)
    for c in kept[1:]:
        m = torch.maximum(m, c.amax(dim=-1))
    ref = m.masked_fill(torch.isneginf(m), 0.0)
    total = torch.zeros_like(m)
    for c in kept:
        total = total + torch.exp(c - ref[..., None]).sum(dim=-1)
    lse = (torch.log(total) + ref)[..., None]
    return torch.cat([torch.where(torch.isneginf(lse), torch.full_like(c, NEG_INF), c - lse) for c in kept], dim=-1)


# The given function exactly as the exercise notebook shows it (tests/test_edits.py compares the two).
BUGGY_MERGE = '''\
def merge_partial_buggy(m_a, l_a, acc_a, m_b, l_b, acc_b):
    # m, l (..., Tq); acc (..., Tq, Dv): the states of two disjoint sets of keys -> the state of both
    m = torch.maximum(m_a, m_b)                                             # (..., Tq)
    ref = m.masked_fill(torch.isneginf(m), 0.0)                             # an empty row: shift by 0
    w_a, w_b = l_a * torch.exp(m_a - ref), l_b * torch.exp(m_b - ref)       # (..., Tq) each side's weight
    return m, w_a + w_b, w_a[..., None] * acc_a + w_b[..., None] * acc_b
'''
FIX_MERGE = edits.SmallEdit(BUGGY_MERGE, most=10, lines=(5, 6))


def _breaker_rewrite_merge(m_a, l_a, acc_a, m_b, l_b, acc_b):
    """A right merge written from the lesson's formulas without reading the given code: refused as no edit of it."""
    m = torch.maximum(m_a, m_b)
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # an empty row: shift by 0
    a, b = torch.exp(m_a - safe), torch.exp(m_b - safe)
    return m, a * l_a + b * l_b, a.unsqueeze(-1) * acc_a + b.unsqueeze(-1) * acc_b
