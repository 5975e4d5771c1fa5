"""Chapter 11's find-the-bug exercise graded as a diagnosis (see :mod:`.edits`): the given decode step exactly as the
exercise notebook shows it (tests/test_edits.py compares the two), how far a fix may move from it, and a paged
decode written afresh that the small-edit property refuses. Kept apart from ch11.py so that each module stays
readable."""

from __future__ import annotations

import math

import torch

from . import edits

# The given function exactly as the exercise notebook shows it (tests/test_edits.py compares the two).
BUGGY_PAGED = '''\
def paged_alibi_decode(query, k_pages, v_pages, block_table, length, slopes):
    """query (H, D) at position length - 1; pages (n_pages, Hkv, P, D), H a multiple of Hkv; slopes (H,) -> (H, D)."""
    h, d = query.shape
    hkv, page = k_pages.shape[1], k_pages.shape[2]
    kv_of = torch.arange(h) // (h // hkv)  # (H,): query heads 0..G-1 read KV head 0, the next G KV head 1, ...
    m = torch.full((h,), -math.inf, dtype=query.dtype)
    l = torch.zeros(h, dtype=query.dtype)
    acc = torch.zeros(h, d, dtype=query.dtype)
    for i, p in enumerate(block_table):
        n = min(page, length - i * page)  # tokens stored in this page
        k, v = k_pages[p, kv_of, :n], v_pages[p, kv_of, :n]  # (H, n, D): this page only
        key_pos = p * page + torch.arange(n)  # (n,) positions in the sequence
        s = (k @ query[:, :, None]).squeeze(-1) / math.sqrt(d)  # (H, n, D) @ (H, D, 1) -> (H, n)
        s = s - slopes[:, None] * ((length - 1) - key_pos)[None, :]  # ALiBi: farther keys lose more
        m_new = torch.maximum(m, s.amax(-1))
        alpha, e = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
        l = alpha * l + e.sum(-1)
        acc = alpha[:, None] * acc + (e[:, None, :] @ v).squeeze(1)  # (H, 1, n) @ (H, n, D) -> (H, D)
        m = m_new
    return acc / l[:, None]
'''
FIX_PAGED = edits.SmallEdit(BUGGY_PAGED, most=12, lines=(12,))


def _breaker_rewrite_paged(query, k_pages, v_pages, block_table, length, slopes):
    """A page-by-page decode with an online softmax written afresh, without reading the given code: right values,
    the pages read in place, refused as no edit of the given function."""
    h, d = query.shape
    group, page = h // k_pages.shape[1], k_pages.shape[2]
    top = torch.full((h,), -math.inf, dtype=query.dtype)
    total, out = torch.zeros(h, dtype=query.dtype), torch.zeros(h, d, dtype=query.dtype)
    for slot, phys in enumerate(block_table):
        count = min(page, length - slot * page)
        keys = k_pages[phys].repeat_interleave(group, 0)[:, :count]  # (H, count, D)
        vals = v_pages[phys].repeat_interleave(group, 0)[:, :count]
        dist = (length - 1) - (slot * page + torch.arange(count))  # (count,)
        s = torch.einsum("hnd,hd->hn", keys, query) / math.sqrt(d) - slopes[:, None] * dist
        new_top = torch.maximum(top, s.amax(-1))
        scale, p = torch.exp(top - new_top), torch.exp(s - new_top[:, None])
        total = scale * total + p.sum(-1)
        out = scale[:, None] * out + torch.einsum("hn,hnd->hd", p, vals)
        top = new_top
    return out / total[:, None]
