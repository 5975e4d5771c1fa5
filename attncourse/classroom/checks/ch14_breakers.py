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


# The given function of the find-the-bug exercise exactly as the exercise notebook shows it (tests/test_edits.py
# compares the two).
BUGGY_MOBA = '''\
def moba_attention(q, k, v, block_size, top_k):
    # q, k, v (H, T, D): each query attends to its own block (causally) and its top_k - 1 best earlier blocks
    h, t, d = q.shape
    nb = -(-t // block_size)
    means = torch.stack([k[:, i * block_size:(i + 1) * block_size].mean(1) for i in range(nb)], 1)  # (H, nB, D)
    gate = q @ means.transpose(-2, -1)  # (H, T, nB)
    own = torch.arange(t) // block_size
    earlier = torch.arange(nb)[None, :] < own[:, None]  # (T, nB)
    out = torch.empty(h, t, v.shape[-1], dtype=q.dtype)
    for hh in range(h):
        for i in range(t):
            chosen = {int(own[i])}
            if top_k > 1 and nb > 1:
                best = gate[hh, i].masked_fill(~earlier[i], -math.inf).topk(min(top_k - 1, nb - 1)).indices
                chosen |= set(best.tolist())
            m0 = q.new_full((1,), -math.inf)
            state = AttentionState(m0, torch.zeros_like(m0), q.new_zeros(1, v.shape[-1]))
            for b in sorted(chosen):
                k0, k1 = b * block_size, min((b + 1) * block_size, t)
                s = q[hh, i:i + 1] @ k[hh, k0:k1].transpose(-2, -1) / math.sqrt(d)  # (1, Bk)
                if b == own[i]:
                    s = s.masked_fill(torch.arange(k0, k1)[None, :] > i, -math.inf)
                state = online_attention_update(state, s, v[hh, k0:k1])
            out[hh, i] = finalize_attention_state(state)[0][0]
    return out
'''


def _breaker_rewrite_moba(q, k, v, block_size, top_k):
    """MoBA attention written afresh without reading the given code (the top blocks taken among the earlier ones
    only, block by block through the online softmax): right values and reads, refused as no edit of it."""
    h, t, d = q.shape
    nb = -(-t // block_size)
    means = torch.stack([k[:, j * block_size:(j + 1) * block_size].mean(1) for j in range(nb)], 1)  # (H, nB, D)
    gate = q @ means.transpose(-2, -1)  # (H, T, nB)
    out = torch.empty(h, t, v.shape[-1], dtype=q.dtype)
    for hh in range(h):
        for i in range(t):
            own = i // block_size
            picks = gate[hh, i, :own].topk(min(top_k - 1, own)).indices.tolist() if own and top_k > 1 else []
            state = AttentionState(q.new_full((1,), -math.inf), q.new_zeros(1), q.new_zeros(1, v.shape[-1]))
            for b in sorted(picks) + [own]:
                k0, k1 = b * block_size, min((b + 1) * block_size, t)
                s = q[hh, i:i + 1] @ k[hh, k0:k1].transpose(-2, -1) / math.sqrt(d)  # (1, Bk)
                if b == own:
                    s = s.masked_fill(torch.arange(k0, k1)[None, :] > i, -math.inf)
                state = online_attention_update(state, s, v[hh, k0:k1])
            out[hh, i] = finalize_attention_state(state)[0][0]
    return out
