r"""Query-aware page selection (Quest: Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", section 3): keep the whole paged cache, but let each decode query read only the pages that can matter
to *it*.

For every page the cache keeps the elementwise minimum :math:`m` and maximum :math:`M` of its keys (two vectors of
D numbers, updated when a key is written). For a query :math:`q`, every key :math:`k` of the page satisfies
:math:`q \cdot k = \sum_d q_d k_d \le \sum_d \max(q_d m_d, q_d M_d)`, so that sum is an **upper bound** on the
page's best score, computed from 2D numbers instead of the page's keys. The query reads the `pages` pages with the
largest bounds (plus, here, the page holding its own position, a choice of ours) and attends to their keys only.
Unlike eviction (:mod:`attncourse.kv_compress`, :mod:`attncourse.kv_evict`), nothing is thrown away: the next
query may pick other pages. What it saves is reading, the decode step's bottleneck (chapter 10), not memory.

MoBA's gate (:func:`attncourse.learned_sparse.moba_gate`, chapter 14) ranks pages by their *mean* key instead: an
estimate of a typical score, where one key that matches the query is diluted by the page size; Quest's bound is set by
the extremes. :func:`quest_scores` gives the bounds in attention's (B, H, Tq, D) layout, GQA included.
"""

from __future__ import annotations

import torch

from . import _validate
from .sdpa import compute_dtype as _compute_dtype

__all__ = ["page_bounds", "page_upper_bounds", "quest_scores", "quest_keep", "quest_eval"]


def page_bounds(key: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per page of `page_size` consecutive keys: the elementwise (min, max), each (..., n_pages, D); the last page
    may be partial (only its real keys count). key: (..., S, D) float.
    Raises: TypeError for a non-tensor or a non-floating key, ValueError for rank < 2 or page_size < 1."""
    _validate.tensor("key", key, min_rank=2, floating=True)
    _validate.positive_int("page_size", page_size)
    k = key
    s, d = k.shape[-2], k.shape[-1]
    n = -(-s // page_size)
    pad = n * page_size - s
    lo = torch.cat([k, k.new_full((*k.shape[:-2], pad, d), float("inf"))], -2)  # padding never the minimum
    hi = torch.cat([k, k.new_full((*k.shape[:-2], pad, d), float("-inf"))], -2)  # ... nor the maximum
    shape = (*k.shape[:-2], n, page_size, d)
    return lo.reshape(shape).amin(-2), hi.reshape(shape).amax(-2)  # (..., n_pages, D) each


def page_upper_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's bound on q . k over each page: sum_d max(q_d min_d, q_d max_d). q (..., D), bounds (..., n_pages, D)
    -> (..., n_pages); never below the page's best exact score."""
    _validate.tensor("q", q, min_rank=1, floating=True)
    if kmin.shape != kmax.shape or kmin.shape[-1] != q.shape[-1]:
        raise ValueError(f"kmin and kmax must be (..., n_pages, D) with q's D, got q {tuple(q.shape)}, "
                         f"kmin {tuple(kmin.shape)}, kmax {tuple(kmax.shape)}")
    qd = q[..., None, :]  # (..., 1, D)
    return torch.maximum(qd * kmin, qd * kmax).sum(-1)





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


def quest_keep(q: torch.Tensor, k: torch.Tensor, page_size: int, pages: int, *, oracle: bool = False
               ) -> torch.Tensor:
    """bool (..., S): the keys of the `pages` pages with the largest upper bounds for query q (..., D), plus the
    last page (the query's own). k: (..., S, D). ``oracle=True`` ranks pages by their exact best score instead (what
    the bound approximates; it needs every key read)."""
    _validate.positive_int("pages", pages)
    s = k.shape[-2]
    n = -(-s // page_size)
    if oracle:
        scores = (k @ q[..., :, None]).squeeze(-1)  # (..., S)
        pad = scores.new_full((*scores.shape[:-1], n * page_size - s), float("-inf"))
        rank = torch.cat([scores, pad], -1).reshape(*scores.shape[:-1], n, page_size).amax(-1)  # (..., n_pages)
    else:
        rank = page_upper_bounds(q, *page_bounds(k, page_size))
    rank = rank.clone()
    rank[..., -1] = float("inf")  # the query's own page is always read
    top = rank.topk(min(pages + 1, n), dim=-1).indices  # (..., pages + 1)
    chosen = torch.zeros(rank.shape, dtype=torch.bool, device=k.device).scatter(-1, top, True)
    return chosen.repeat_interleave(page_size, -1)[..., :s]  # (..., S)


def quest_eval(model, tokens: torch.Tensor, prompt_len: int, *, page_size: int, pages: int, mode: str = "quest"
               ) -> dict:
    """Next-token accuracy of the decode steps (queries at prompt_len .. T-2, teacher-forced) when each decode query
    of every layer and head reads only the pages `mode` picks for it: "quest" (upper bounds), "oracle" (exact best
    score per page) or "recent" (the newest pages). `pages` pages are picked besides the query's own.

    Returns ``{"accuracy", "per_step", "recall", "logits" (B, T, V)}``: recall is the share of the full attention weight (the query's
    weights over all its keys) that falls on the keys it read, averaged over decode queries, layers and heads."""
    if mode not in ("quest", "oracle", "recent"):
        raise ValueError(f"mode must be 'quest', 'oracle' or 'recent', got {mode!r}")
    _validate.tensor("tokens", tokens, min_rank=2)
    _validate.positive_int("page_size", page_size)
    _validate.positive_int("pages", pages)
    b, t = tokens.shape
    if not 1 <= prompt_len < t - 1:
        raise ValueError(f"prompt_len must leave a continuation: 1 <= prompt_len < T - 1 = {t - 1}, got {prompt_len}")
    recall = []
    with torch.no_grad():
        x = model.tok(tokens) + model.pos(torch.arange(t))  # (B, T, d)
        for norm, attn in zip(model.norms, model.attns):
            h = norm(x)
            heads, hd = attn.n_heads, attn.head_dim
            q = attn.q_proj(h).view(b, t, heads, hd).transpose(1, 2) * hd ** -0.5  # (B, H, T, D), scaled
            k = attn.k_proj(h).view(b, t, attn.n_kv_heads, hd).transpose(1, 2).repeat_interleave(attn.n_rep, 1)
            mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, heads, t, t).clone()  # (B, H, T, T)
            _, full = attn(h, is_causal=True, return_weights=True)  # (B, H, T, T): what each query would weigh
            for s in range(prompt_len, t - 1):
                keys = k[:, :, :s + 1]  # (B, H, s+1, D)
                if mode == "recent":
                    start = max(0, (s // page_size - pages) * page_size)
                    keep = torch.zeros(b, heads, s + 1, dtype=torch.bool)
                    keep[..., start:] = True
                else:
                    keep = quest_keep(q[:, :, s], keys, page_size, pages, oracle=mode == "oracle")
                mask[:, :, s, :s + 1] = keep
                recall.append(float((full[:, :, s, :s + 1] * keep).sum(-1).mean()))
            x = x + attn(h, attn_mask=mask)
        logits = model.head(model.norm(x))  # (B, T, V)
    hits = (logits[:, prompt_len:-1].argmax(-1) == tokens[:, prompt_len + 1:]).double()
    return {"accuracy": hits.mean().item(), "per_step": hits.mean(0).tolist(), "recall": sum(recall) / len(recall),
            "logits": logits}
