r"""Attention that learns where to look: per-query block selection (MoBA, NSA) and token selection (DeepSeek's
lightning indexer), with a tile loop whose work follows the selection.

Chapter 11's block masks are fixed before the data arrives. Here each query chooses its key blocks from the content:

* **MoBA** (Lu et al. 2025, arXiv 2502.13189): block :math:`b` gets the gate score :math:`q_t \cdot \bar k_b`, with
  :math:`\bar k_b` the mean of the block's keys; a query keeps its own block (causal inside it) and the top
  ``top_k - 1`` earlier blocks (:func:`moba_gate`). No parameters: the gate learns through the keys and queries.
* **NSA** (Yuan et al. 2025, arXiv 2502.11089): three branches mixed by learned sigmoid gates: attention over
  compressed (pooled) blocks, over the top-n blocks that the compressed attention's probabilities rank (summed over
  the heads of a GQA group, so the group loads one set of blocks), and a sliding window (:func:`nsa_attention`).
* **DSA** (DeepSeek-V3.2-Exp): a small indexer scores every earlier token,
  :math:`I_{t,s} = \sum_j w_{t,j}\,\mathrm{ReLU}(q^I_{t,j} \cdot k^I_s)`, and each query attends to its top-k tokens
  (:func:`indexer_scores`, :func:`top_k_tokens`, :func:`token_select_attention`); the indexer is first trained to
  match dense attention with a KL loss (:func:`indexer_kl_loss`); :func:`indexer_cost` counts what it costs.

:func:`selected_attention` is chapter 09's tile loop with chapter 08's online-softmax update, visiting for each tile of
queries only the key blocks its rows selected; its work is counted, not estimated. Selections are boolean
``(B, Hs, T, nB)`` tensors (True = this query reads this key block), ``Hs`` being the query heads (MoBA: a choice per
head) or the KV heads (NSA: one choice per GQA group). :func:`blocks_to_mask` turns one into chapter 07's token mask,
so every sparse result can be checked against dense attention under that mask.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import _validate
from .flash import flash_attention
from .online_softmax import AttentionState, finalize_attention_state, online_attention_update
from .sdpa import compute_dtype as _compute_dtype

__all__ = ["n_blocks", "mean_pool_blocks", "moba_gate", "blocks_to_mask", "selected_attention", "SelectedOutput",
           "selected_work", "compressed_attention", "nsa_select", "nsa_attention", "NSAOutput", "indexer_scores",
           "top_k_tokens", "token_select_attention", "indexer_kl_loss", "indexer_cost"]

_NEG_INF = float("-inf")


def n_blocks(length: int, block_size: int) -> int:
    """ceil(length / block_size): the number of key blocks, the last one possibly short."""
    _validate.positive_int("length", length)
    _validate.positive_int("block_size", block_size)
    return -(-length // block_size)


def _check_self(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None = None) -> tuple[int, int, int]:
    """Validate (B, H, T, D) queries over (B, Hkv, T, D) keys of the same sequence; return (H, Hkv, T)."""
    for name, x in (("query", query), ("key", key)) + ((("value", value),) if value is not None else ()):
        _validate.tensor(name, x, min_rank=4, floating=True)
        if x.dim() != 4:
            raise ValueError(f"{name} must be (B, heads, T, D), got shape {tuple(x.shape)}")
    h, hkv, t = query.shape[1], key.shape[1], query.shape[2]
    if key.shape[2] != t or key.shape[0] != query.shape[0] or key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key {tuple(key.shape)} must be (B, Hkv, T, D) for query {tuple(query.shape)}: self-attention "
                         "over the same T tokens")
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key heads ({hkv}), got query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}")
    if value is not None and value.shape[:3] != key.shape[:3]:
        raise ValueError(f"value {tuple(value.shape)} must match key {tuple(key.shape)} in (B, Hkv, T)")
    return h, hkv, t


def mean_pool_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """(..., T, D) -> (..., nB, D): the mean of each block of `block_size` rows (the last block over its real rows).

    MoBA's gate keys and the compressed keys and values of :func:`compressed_attention`.
    """
    _validate.tensor("x", x, min_rank=2)
    t, d = x.shape[-2], x.shape[-1]
    nb = n_blocks(t, block_size)
    padded = x.new_zeros(*x.shape[:-2], nb * block_size, d)
    padded[..., :t, :] = x
    sizes = torch.full((nb,), float(block_size), dtype=x.dtype, device=x.device)
    sizes[-1] = t - (nb - 1) * block_size  # real rows of the last block
    return padded.view(*x.shape[:-2], nb, block_size, d).sum(-2) / sizes[:, None]  # (..., nB, D)


def _own_block(t: int, block_size: int, device=None) -> torch.Tensor:
    return torch.arange(t, device=device) // block_size  # (T,) the block each query sits in


def moba_gate(query: torch.Tensor, key: torch.Tensor, block_size: int, top_k: int) -> torch.Tensor:
    """MoBA's causal block selection: (B, H, T, nB) bool, True where query t of head h reads key block b.

    query (B, H, T, D), key (B, Hkv, T, D) (H a multiple of Hkv; a query head scores its KV head's blocks). Each
    query keeps its own block and the ``top_k - 1`` earlier blocks with the largest :math:`q_t \\cdot \\bar k_b`
    (fewer when fewer exist); later blocks are never chosen. The scores are never formed for single keys: the
    gate costs T x nB dot products, not T x T.
    """
    h, hkv, t = _check_self(query, key)
    _validate.positive_int("top_k", top_k)
    nb = n_blocks(t, block_size)
    work = _compute_dtype(query.dtype)
    pooled = mean_pool_blocks(key.to(work), block_size).repeat_interleave(h // hkv, dim=1)  # (B, H, nB, D)
    scores = query.to(work) @ pooled.transpose(-2, -1)  # (B, H, T, D) @ (B, H, D, nB) -> (B, H, T, nB)
    own = _own_block(t, block_size, query.device)  # (T,)
    past = torch.arange(nb, device=query.device)[None, :] < own[:, None]  # (T, nB) strictly earlier blocks
    selected = past.new_zeros(scores.shape)  # (B, H, T, nB)
    if top_k > 1 and nb > 1:
        k_past = min(top_k - 1, nb - 1)
        idx = scores.masked_fill(~past, _NEG_INF).topk(k_past, dim=-1).indices  # (B, H, T, k_past) over blocks
        selected.scatter_(-1, idx, True)
        selected &= past  # keep strictly earlier blocks only
    selected[..., torch.arange(t), own] = True  # its own block, always
    return selected


def blocks_to_mask(selected: torch.Tensor, block_size: int, k_len: int, *, causal: bool = True) -> torch.Tensor:
    """(..., T, nB) block selection -> (..., T, k_len) token mask (True = may attend), causal by default."""
    _validate.tensor("selected", selected, min_rank=2)
    if selected.dtype != torch.bool:
        raise TypeError(f"selected must be a bool tensor, got {selected.dtype}")
    nb = n_blocks(k_len, block_size)
    if selected.shape[-1] != nb:
        raise ValueError(f"selected has {selected.shape[-1]} blocks in its last dim, k_len={k_len} with block_size="
                         f"{block_size} makes {nb}: got shape {tuple(selected.shape)}")
    mask = selected.repeat_interleave(block_size, dim=-1)[..., :k_len]  # (..., T, S)
    if causal:
        t = selected.shape[-2]
        mask = mask & (torch.arange(k_len, device=mask.device)[None, :] <= torch.arange(t, device=mask.device)[:, None])
    return mask


class SelectedOutput(NamedTuple):
    """What :func:`selected_attention` returns: out (B, H, T, Dv), lse (B, H, T), the (query tile, key block)
    pairs it computed summed over batch and KV heads (``tiles``), and the query-key scores it computed
    (``pairs``, the rows of every tile times its keys)."""

    out: torch.Tensor
    lse: torch.Tensor
    tiles: int
    pairs: int


def selected_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, selected: torch.Tensor,
                       block_size: int, *, block_q: int = 1, causal: bool = True,
                       scale: float | None = None) -> SelectedOutput:
    """Causal attention over the key blocks each query selected, visiting only those blocks.

    query (B, H, T, D), key (B, Hkv, T, D), value (B, Hkv, T, Dv); selected (B, Hs, T, nB) bool with Hs = H (a
    selection per query head, MoBA) or Hs = Hkv (one per GQA group, NSA). The loop runs per (batch, KV head) over
    tiles of ``block_q`` queries x the G query heads of the group (chapter 09's layout); a tile visits the union of
    the blocks its rows selected, masks the rows that did not select a block and, inside a query's own block, the
    later keys. Rows that selected nothing get zeros and lse -inf. Half precision is computed in float32.
    """
    h, hkv, t = _check_self(query, key, value)
    _validate.tensor("selected", selected, min_rank=4)
    nb = n_blocks(t, block_size)
    _validate.positive_int("block_q", block_q)
    if selected.dtype != torch.bool or selected.shape[0] != query.shape[0] or selected.shape[1] not in (h, hkv) \
            or tuple(selected.shape[2:]) != (t, nb):
        raise ValueError(f"selected must be bool (B, H or Hkv, T, nB) = ({query.shape[0]}, {h} or {hkv}, {t}, {nb}), "
                         f"got {selected.dtype} {tuple(selected.shape)}")
    g = h // hkv
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    work = _compute_dtype(query.dtype)
    q = query.to(work).reshape(query.shape[0], hkv, g, t, query.shape[-1])  # (B, Hkv, G, T, D)
    k, v = key.to(work), value.to(work)
    sel = selected.reshape(selected.shape[0], hkv, -1, t, nb)  # (B, Hkv, G or 1, T, nB)
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])  # (B, Hkv, G, T, Dv)
    lse = q.new_full(q.shape[:-1], _NEG_INF)  # (B, Hkv, G, T)
    tiles = pairs = 0
    for bi in range(q.shape[0]):
        for kh in range(hkv):
            for q0 in range(0, t, block_q):
                q1 = min(q0 + block_q, t)
                rows = q[bi, kh, :, q0:q1] * scale  # (G, Bq, D): the group's heads stacked as one tile
                need = sel[bi, kh, :, q0:q1]  # (G or 1, Bq, nB)
                m0 = rows.new_full(rows.shape[:-1], _NEG_INF)  # (G, Bq)
                state = AttentionState(m0, torch.zeros_like(m0), rows.new_zeros(*m0.shape, v.shape[-1]))
                for b in torch.nonzero(need.any(dim=(0, 1))).flatten().tolist():  # the only blocks this tile reads
                    k0, k1 = b * block_size, min((b + 1) * block_size, t)
                    s = rows @ k[bi, kh, k0:k1].transpose(-2, -1)  # (G, Bq, D) @ (D, Bk) -> (G, Bq, Bk)
                    keep = need[..., b, None].expand(s.shape)  # (G, Bq, Bk) rows that chose this block
                    if causal and k1 - 1 > q0:  # the block reaches past the tile's first query: mask the later keys
                        keep = keep & (torch.arange(k0, k1)[None, :] <= torch.arange(q0, q1)[:, None])
                    state = online_attention_update(state, s.masked_fill(~keep, _NEG_INF), v[bi, kh, k0:k1])
                    tiles += 1
                    pairs += s.numel()
                o, l = finalize_attention_state(state)  # noqa: E741  (G, Bq, Dv), (G, Bq)
                out[bi, kh, :, q0:q1], lse[bi, kh, :, q0:q1] = o, l
    return SelectedOutput(out.reshape(*query.shape[:-1], v.shape[-1]).to(value.dtype), lse.reshape(query.shape[:-1]),
                          tiles, pairs)


def selected_work(selected: torch.Tensor, block_size: int, k_len: int) -> dict[str, int]:
    """What the selection costs with one query per tile: ``blocks`` (query x selected block, summed over batch and
    heads), ``keys`` (keys scored, the own block counted up to the query: causal) and ``dense_causal_keys``
    (the same for dense causal attention, T (T + 1) / 2 per batch and head)."""
    mask = blocks_to_mask(selected, block_size, k_len)  # (..., T, S)
    t = selected.shape[-2]
    lead = math.prod(selected.shape[:-2])
    return {"blocks": int(selected.sum()), "keys": int(mask.sum()), "dense_causal_keys": lead * t * (t + 1) // 2}


# ----------------------------------------------------------------------------- NSA


def compressed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_size: int, *,
                         scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NSA's compressed branch: attention over one mean-pooled key and value per block, causal by blocks.

    query (B, H, T, D), key (B, Hkv, T, D), value (B, Hkv, T, Dv). Query t sees the summaries of the blocks that
    end at or before it ((b + 1) block_size - 1 <= t); queries of the first block see none (zeros). Returns
    (out (B, H, T, Dv), probs (B, H, T, nB)), the probabilities NSA ranks blocks by. (The paper compresses with a
    learned MLP over overlapping blocks; the mean is its simplest instance.)
    """
    h, hkv, t = _check_self(query, key, value)
    g = h // hkv
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    work = _compute_dtype(query.dtype)
    kc = mean_pool_blocks(key.to(work), block_size).repeat_interleave(g, dim=1)  # (B, H, nB, D)
    vc = mean_pool_blocks(value.to(work), block_size).repeat_interleave(g, dim=1)  # (B, H, nB, Dv)
    nb = kc.shape[-2]
    done = (torch.arange(nb)[None, :] + 1) * block_size - 1 <= torch.arange(t)[:, None]  # (T, nB) finished blocks
    s = (query.to(work) @ kc.transpose(-2, -1) * scale).masked_fill(~done, _NEG_INF)  # (B, H, T, nB)
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))  # (B, H, T, nB), 0 where masked
    z = e.sum(-1, keepdim=True)
    probs = e / torch.where(z > 0, z, torch.ones_like(z))  # rows with no finished block: all zeros
    return (probs @ vc).to(value.dtype), probs  # (B, H, T, nB) @ (B, H, nB, Dv) -> (B, H, T, Dv)


def nsa_select(probs: torch.Tensor, n_kv_heads: int, top_n: int, block_size: int) -> torch.Tensor:
    """NSA's selection: (B, H, T, nB) compressed-attention probabilities -> (B, Hkv, T, nB) bool.

    The importance of a block is its probability summed over the G query heads of a GQA group (the paper's
    eq. 10), so the group shares one choice and loads one set of blocks. Each query keeps its own block (the
    local one, causal inside) and the ``top_n`` finished earlier blocks of highest importance.
    """
    _validate.tensor("probs", probs, min_rank=4, floating=True)
    _validate.positive_int("n_kv_heads", n_kv_heads)
    b, h, t, nb = probs.shape
    if h % n_kv_heads:
        raise ValueError(f"probs has {h} heads, not a multiple of n_kv_heads={n_kv_heads}: shape {tuple(probs.shape)}")
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise ValueError(f"top_n must be an int >= 0, got {top_n!r}")
    importance = probs.reshape(b, n_kv_heads, h // n_kv_heads, t, nb).sum(2)  # (B, Hkv, T, nB)
    own = _own_block(t, block_size, probs.device)
    past = torch.arange(nb, device=probs.device)[None, :] < own[:, None]  # (T, nB)
    selected = past.new_zeros(importance.shape)
    if top_n > 0 and nb > 1:
        idx = importance.masked_fill(~past, _NEG_INF).topk(min(top_n, nb - 1), dim=-1).indices
        selected.scatter_(-1, idx, True)
        selected &= past
    selected[..., torch.arange(t), own] = True
    return selected


class NSAOutput(NamedTuple):
    """out (B, H, T, Dv); the three branches (compressed, selected, window), each (B, H, T, Dv); the selection
    (B, Hkv, T, nB) and the tiles the selected branch visited."""

    out: torch.Tensor
    compressed: torch.Tensor
    selected: torch.Tensor
    window: torch.Tensor
    selection: torch.Tensor
    tiles: int


def nsa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, gates: torch.Tensor, block_size: int,
                  top_n: int, window: int, *, scale: float | None = None) -> NSAOutput:
    """Native Sparse Attention's three branches, mixed: out = g_cmp o_cmp + g_slc o_slc + g_win o_win.

    query (B, H, T, D), key (B, Hkv, T, D), value (B, Hkv, T, Dv); gates (B, H, T, 3) in [0, 1] (the paper's
    sigmoid of an MLP of the token; the caller computes them). The selection comes from the compressed branch's
    probabilities (:func:`nsa_select`; no gradient flows through the choice), the selected branch runs
    :func:`selected_attention` (one query per tile, the group's heads together), the window chapter 09's
    :func:`flash_attention` with ``window``.
    """
    h, hkv, t = _check_self(query, key, value)
    _validate.tensor("gates", gates, min_rank=4, floating=True)
    if tuple(gates.shape) != (*query.shape[:-1], 3):
        raise ValueError(f"gates must be (B, H, T, 3) = {(*query.shape[:-1], 3)}, got {tuple(gates.shape)}")
    o_cmp, probs = compressed_attention(query, key, value, block_size, scale=scale)
    selection = nsa_select(probs.detach(), hkv, top_n, block_size)
    o_slc, _, tiles, _ = selected_attention(query, key, value, selection, block_size, scale=scale)
    o_win = flash_attention(query, key, value, is_causal=True, window=window, scale=scale)
    g = gates.to(o_cmp.dtype)
    out = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win  # (B, H, T, Dv)
    return NSAOutput(out, o_cmp, o_slc, o_win, selection, tiles)


# ----------------------------------------------------------------------------- DeepSeek's lightning indexer


def indexer_scores(q_index: torch.Tensor, weights: torch.Tensor, k_index: torch.Tensor, *,
                   causal: bool = True) -> torch.Tensor:
    """The lightning indexer's scores :math:`I_{t,s} = \\sum_j w_{t,j} \\mathrm{ReLU}(q^I_{t,j} \\cdot k^I_s)`.

    q_index (B, HI, T, DI) (a few small indexer heads), weights (B, HI, T) (per query and head, from the token),
    k_index (B, S, DI) (one indexer key per token, shared by the heads) -> (B, T, S), -inf after the query when
    causal (query t at position t of the same sequence, T == S).
    """
    _validate.tensor("q_index", q_index, min_rank=4, floating=True)
    _validate.tensor("weights", weights, min_rank=3, floating=True)
    _validate.tensor("k_index", k_index, min_rank=3, floating=True)
    b, hi, t, di = q_index.shape
    if tuple(weights.shape) != (b, hi, t) or k_index.shape[0] != b or k_index.shape[-1] != di:
        raise ValueError(f"expected weights (B, HI, T) = {(b, hi, t)} and k_index (B, S, {di}), got weights "
                         f"{tuple(weights.shape)}, k_index {tuple(k_index.shape)}")
    s = k_index.shape[1]
    if causal and s != t:
        raise ValueError(f"causal indexer scores need S == T, got T={t}, S={s}")
    dots = torch.relu(q_index.float() @ k_index.float()[:, None].transpose(-2, -1))  # (B,HI,T,DI)@(B,1,DI,S)->(B,HI,T,S)
    scores = (weights.float()[..., None] * dots).sum(1)  # (B, T, S)
    if causal:
        scores = scores.masked_fill(torch.arange(s)[None, :] > torch.arange(t)[:, None], _NEG_INF)
    return scores


def top_k_tokens(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(..., T, S) scores -> (..., T, k) long: each query's k best keys, -1 where fewer than k are allowed."""
    _validate.tensor("scores", scores, min_rank=2, floating=True)
    _validate.positive_int("k", k)
    k_eff = min(k, scores.shape[-1])
    val, idx = scores.topk(k_eff, dim=-1)  # (..., T, k_eff)
    idx = idx.masked_fill(val == _NEG_INF, -1)
    if k_eff < k:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], k - k_eff), -1)], dim=-1)
    return idx


def token_select_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, indices: torch.Tensor, *,
                           scale: float | None = None) -> torch.Tensor:
    """Attention of each query over its own k keys only (DSA's sparse MLA in MQA mode: the heads share them).

    query (B, H, T, D), key (B, Hkv, S, D), value (B, Hkv, S, Dv), indices (B, T, k) long (-1: unused slot) ->
    (B, H, T, Dv). The k keys are gathered per query, so the work is T x k, not T x S. A query whose slots
    are all -1 gets zeros.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        _validate.tensor(name, x, min_rank=4, floating=True)
    _validate.tensor("indices", indices, min_rank=3)
    b, h, t, _ = query.shape
    hkv = key.shape[1]
    if key.shape[0] != b or value.shape[:3] != key.shape[:3] or key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key (B, Hkv, S, D) and value (B, Hkv, S, Dv) must fit query (B, H, T, D): got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if indices.dtype != torch.long or tuple(indices.shape[:2]) != (b, t) or h % hkv:
        raise ValueError(f"indices must be long (B, T, k) = ({b}, {t}, k) and H a multiple of Hkv, got "
                         f"{indices.dtype} {tuple(indices.shape)}, H={h}, Hkv={hkv}")
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    work = _compute_dtype(query.dtype)
    valid = indices >= 0  # (B, T, k)
    idx = indices.clamp(min=0)
    k_sel = torch.stack([key[i][:, idx[i]] for i in range(b)]).to(work)  # (B, Hkv, T, k, D) gathered keys
    v_sel = torch.stack([value[i][:, idx[i]] for i in range(b)]).to(work)  # (B, Hkv, T, k, Dv)
    q = query.to(work).reshape(b, hkv, h // hkv, t, 1, query.shape[-1])  # (B, Hkv, G, T, 1, D)
    s = (q @ k_sel[:, :, None].transpose(-2, -1)).squeeze(-2) * scale  # (B,Hkv,G,T,1,D)@(B,Hkv,1,T,D,k)->(B,Hkv,G,T,k)
    s = s.masked_fill(~valid[:, None, None], _NEG_INF)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    z = p.sum(-1, keepdim=True)
    p = p / torch.where(z > 0, z, torch.ones_like(z))  # (B, Hkv, G, T, k); zeros on rows with no key
    out = (p[..., None, :] @ v_sel[:, :, None]).squeeze(-2)  # (B,Hkv,G,T,1,k)@(B,Hkv,1,T,k,Dv)->(B,Hkv,G,T,Dv)
    return out.reshape(b, h, t, -1).to(value.dtype)


def indexer_kl_loss(scores: torch.Tensor, attn_weights: torch.Tensor,
                    selected: torch.Tensor | None = None) -> torch.Tensor:
    """DSA's indexer loss: :math:`\\sum_t \\mathrm{KL}(p_t \\,\\|\\, \\mathrm{softmax}(I_t))` averaged over queries.

    scores (B, T, S) indexer scores (-inf where masked); attn_weights (B, H, T, S) the main attention's
    probabilities, whose sum over heads, L1-normalised per query, is the target p_t (the paper's dense warm-up
    stage). With ``selected`` (B, T, k) token indices (-1 = none, as :func:`top_k_tokens` returns), the sparse
    training stage: both distributions are taken over each query's selected tokens only, each renormalised there.
    Keys the target gives zero weight add nothing; the target is not differentiated.
    """
    _validate.tensor("scores", scores, min_rank=3, floating=True)
    _validate.tensor("attn_weights", attn_weights, min_rank=4, floating=True)
    if attn_weights.shape[0] != scores.shape[0] or tuple(attn_weights.shape[2:]) != tuple(scores.shape[1:]):
        raise ValueError(f"attn_weights must be (B, H, T, S) for scores (B, T, S) = {tuple(scores.shape)}, got "
                         f"{tuple(attn_weights.shape)}")
    target = attn_weights.detach().float().sum(1)  # (B, T, S)
    if selected is not None:  # the sparse stage: only the selected tokens, in both distributions
        _validate.tensor("selected", selected, min_rank=3)
        if selected.dtype != torch.long or tuple(selected.shape[:2]) != tuple(scores.shape[:2]):
            raise ValueError(f"selected must be long (B, T, k) for scores {tuple(scores.shape)}, got {selected.dtype} "
                             f"{tuple(selected.shape)}")
        s = scores.shape[-1]
        keep = torch.zeros(*scores.shape[:-1], s + 1, dtype=torch.bool, device=scores.device).scatter_(
            -1, torch.where(selected >= 0, selected, s), True)[..., :s]  # (B, T, S); -1 lands on a dropped column
        scores, target = scores.masked_fill(~keep, _NEG_INF), target.masked_fill(~keep, 0.0)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    log_q = torch.log_softmax(scores.float(), dim=-1)  # (B, T, S)
    terms = torch.where(target > 0, target * (torch.log(target.clamp_min(1e-30)) - log_q), torch.zeros_like(target))
    return terms.sum(-1).mean()


def indexer_cost(context: int, *, n_heads: int = 128, qk_dim: int = 576, v_dim: int = 512, index_heads: int = 64,
                 index_dim: int = 128, top_k: int = 2048) -> dict[str, int]:
    """Multiply-adds per new query token of one layer at `context` earlier tokens (decode), DeepSeek-V3.2's sizes
    by default: MLA in MQA mode (128 heads, scores over 512 + 64 dimensions, values of 512), an indexer of 64 heads
    of 128 dimensions and top-2048 selection.

    Returns ``dense`` (every head over every key), ``indexer`` (``index_heads x index_dim`` per key, plus the
    weighted sum), ``sparse`` (the heads over min(top_k, context) keys) and ``dsa`` = indexer + sparse.
    """
    for name, x in (("context", context), ("n_heads", n_heads), ("qk_dim", qk_dim), ("v_dim", v_dim),
                    ("index_heads", index_heads), ("index_dim", index_dim), ("top_k", top_k)):
        _validate.positive_int(name, x)
    per_key = n_heads * (qk_dim + v_dim)  # scores and the weighted sum of values, every head
    dense = per_key * context
    indexer = (index_heads * index_dim + index_heads) * context  # q.k per head, then w_j * ReLU(.) summed
    sparse = per_key * min(top_k, context)
    return {"dense": dense, "indexer": indexer, "sparse": sparse, "dsa": indexer + sparse}

