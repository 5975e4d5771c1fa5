"""Chapter 14's breakers: right outputs computed the wrong way, which the properties in ch14.py must refuse."""

from __future__ import annotations

import math

import torch

from attncourse import AttentionState, finalize_attention_state, online_attention_update


def _breaker_token_scores(query, key, block_size, top_k):
    """Every query-key score, then averaged per block: the same gate values, Tq x S work (refused by the property)."""
    h, t, s_len = query.shape[1], query.shape[2], key.shape[2]
    nb = -(-s_len // block_size)
    s = query @ key.repeat_interleave(h // key.shape[1], dim=1).transpose(-2, -1)  # (B, H, Tq, S)
    gate = torch.stack([s[..., i * block_size:(i + 1) * block_size].mean(-1) for i in range(nb)], -1)  # (B, H, Tq, nB)
    own, blocks = (s_len - t + torch.arange(t))[:, None] // block_size, torch.arange(nb)[None, :]
    rank = gate.masked_fill(blocks >= own, -math.inf).argsort(-1, descending=True).argsort(-1)
    sel = (rank < top_k - 1) & (blocks < own) | (blocks == own)
    order = torch.cat([torch.where(sel, blocks, nb).sort(-1).values, sel.new_full((*sel.shape[:-1], top_k), nb, dtype=torch.long)], -1)
    return order[..., :top_k].masked_fill(order[..., :top_k] == nb, -1)


def _breaker_row_scores(query, key, block_size, top_k):
    """Every query-key score, one query row at a time (no tensor is Tq x S), then block means: Tq x S work in all."""
    h, t, s_len = query.shape[1], query.shape[2], key.shape[2]
    nb = -(-s_len // block_size)
    kr = key.repeat_interleave(h // key.shape[1], dim=1)
    rows = []
    for i in range(t):
        s = (kr * query[:, :, i:i + 1, :]).sum(-1)  # (B, H, S): query i against every key
        rows.append(torch.stack([s[..., j * block_size:(j + 1) * block_size].mean(-1) for j in range(nb)], -1))
    gate = torch.stack(rows, 2)  # (B, H, Tq, nB)
    own, blocks = (s_len - t + torch.arange(t))[:, None] // block_size, torch.arange(nb)[None, :]
    rank = gate.masked_fill(blocks >= own, -math.inf).argsort(-1, descending=True).argsort(-1)
    sel = (rank < top_k - 1) & (blocks < own) | (blocks == own)
    order = torch.cat([torch.where(sel, blocks, nb).sort(-1).values, sel.new_full((*sel.shape[:-1], top_k), nb, dtype=torch.long)], -1)
    return order[..., :top_k].masked_fill(order[..., :top_k] == nb, -1)


def _breaker_dense(q, k, v, block, top_k):
    """Dense attention under the selection's token mask: right output, every key read at once."""
    h, t, d = q.shape
    nb = -(-t // block)
    gate = q @ torch.stack([k[:, i * block:(i + 1) * block].mean(1) for i in range(nb)], 1).transpose(-2, -1)
    own, blocks = torch.arange(t)[:, None] // block, torch.arange(nb)[None, :]
    rank = gate.masked_fill(blocks >= own, -math.inf).argsort(-1, descending=True).argsort(-1)  # (H, T, nB)
    sel = (rank < top_k - 1) & (blocks < own) | (blocks == own)
    allowed = sel.repeat_interleave(block, dim=-1)[..., :t] & torch.ones(t, t, dtype=torch.bool).tril()
    s = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill(~allowed, -math.inf)  # (H, T, T)
    m0 = q.new_full((h, t), -math.inf)
    state = online_attention_update(AttentionState(m0, torch.zeros_like(m0), q.new_zeros(h, t, v.shape[-1])), s, v)
    return finalize_attention_state(state)[0]
