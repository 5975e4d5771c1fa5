"""NSA's selection shared by a GQA group, trained: does one choice per group cost accuracy, and what does it save?

NSA (Yuan et al. 2025, arXiv 2502.11089, eq. 10) sums each block's compressed-attention probability over the query
heads of a GQA group and lets the whole group read the same top-n blocks, so the KV blocks one group loads are
``top_n + 1`` per query however many heads it has. The alternative is a choice per head, whose *union* the group must
load. This module trains both on a task with two needles, where the heads of the group have reason to look at
different blocks:

* every position holds a (key id, value id) pair; two needle key ids ``a`` and ``b`` appear once each, in two
  different blocks before the last one; the last position holds both ids (``a`` through the key embedding, ``b``
  through a second embedding table) and must output both needles' value ids (two read-outs, ``n_values`` each);
* one layer, ``n_heads`` query heads sharing one KV head (one GQA group), no positions; the last query's heads mix
  NSA's compressed branch (mean-pooled blocks, :func:`attncourse.learned_sparse.compressed_attention`) and its
  selected branch by per-head sigmoid gates;
* ``select="shared"`` ranks blocks by the probabilities summed over the group, ``select="per_head"`` by each head's
  own (both :func:`attncourse.learned_sparse.nsa_select`; a group of one head is a per-head choice).

:func:`train_groups` returns held-out accuracy (both needles right), loss, the share of sequences whose loaded blocks
hold both needles, and the KV blocks the group loaded for the last query (its own block included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import _validate
from .learned_sparse import blocks_to_mask, compressed_attention, nsa_select
from .sdpa import scaled_dot_product_attention

__all__ = ["SELECTS", "GroupConfig", "two_needle_batch", "GroupModel", "train_groups"]

SELECTS = ("shared", "per_head")


@dataclass
class GroupConfig:
    seq_len: int = 64
    block_size: int = 8
    n_heads: int = 4  # query heads in the one GQA group
    head_dim: int = 16
    n_keys: int = 24
    n_values: int = 8
    d_model: int = 32
    steps: int = 600
    batch: int = 64
    lr: float = 3e-3


def two_needle_batch(cfg: GroupConfig, batch: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """keys, values (B, T) long; ``pos`` (B, 2) the two needles' positions (in different blocks, before the last
    block); ``ids`` (B, 2) their key ids; ``answer`` (B, 2) their value ids. The last position's value id is
    n_values (a blank)."""
    t, blk = cfg.seq_len, cfg.block_size
    if t % blk:
        raise ValueError(f"seq_len={t} must be a multiple of block_size={blk}")
    nb_before = t // blk - 1  # blocks before the last query's own block
    if nb_before < 2:
        raise ValueError(f"seq_len={t} and block_size={blk} leave {nb_before} earlier block(s); two needles need 2")
    ids = torch.stack([torch.randperm(cfg.n_keys, generator=gen)[:2] for _ in range(batch)])  # (B, 2) distinct
    keys = torch.randint(0, cfg.n_keys - 2, (batch, t), generator=gen)
    lo, hi = ids.min(1, keepdim=True).values, ids.max(1, keepdim=True).values
    keys = keys + (keys >= lo).long()
    keys = keys + (keys >= hi).long()  # every other key id differs from both needles
    values = torch.randint(0, cfg.n_values, (batch, t), generator=gen)
    blocks = torch.stack([torch.randperm(nb_before, generator=gen)[:2] for _ in range(batch)])  # (B, 2) distinct
    pos = blocks * blk + torch.randint(0, blk, (batch, 2), generator=gen)
    rows = torch.arange(batch)[:, None]
    keys[rows, pos] = ids
    keys[:, -1] = ids[:, 0]
    values[:, -1] = cfg.n_values
    return {"keys": keys, "values": values, "pos": pos, "ids": ids, "answer": values[rows, pos]}


class GroupModel(nn.Module):
    """One GQA group (n_heads query heads, one KV head) read at the last position; NSA's compressed and selected
    branches mixed per head by sigmoid gates; two linear read-outs."""

    def __init__(self, cfg: GroupConfig, select: str, top_n: int):
        super().__init__()
        if select not in SELECTS:
            raise ValueError(f"select must be one of {SELECTS}, got {select!r}")
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
            raise ValueError(f"top_n must be an int >= 1, got {top_n!r}")
        self.cfg, self.select, self.top_n = cfg, select, top_n
        d, h, dh = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.key_emb = nn.Embedding(cfg.n_keys, d)
        self.second_emb = nn.Embedding(cfg.n_keys, d)  # the second needle's id, at the last position only
        self.val_emb = nn.Embedding(cfg.n_values + 1, d)
        self.wq, self.wk, self.wv = nn.Linear(d, h * dh, bias=False), nn.Linear(d, dh, bias=False), nn.Linear(d, dh, bias=False)
        self.gate = nn.Linear(d, 2 * h)  # per head: compressed and selected branch
        self.out = nn.Linear(h * dh, 2 * cfg.n_values)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (B, 2, n_values), read (B, H, T) bool: the keys each head of the last query read)."""
        cfg, keys = self.cfg, batch["keys"]
        b, t = keys.shape
        h, dh = cfg.n_heads, cfg.head_dim
        x = self.key_emb(keys) + self.val_emb(batch["values"])  # (B, T, d)
        x = torch.cat([x[:, :-1], x[:, -1:] + self.second_emb(batch["ids"][:, 1])[:, None]], 1)
        q = self.wq(x).view(b, t, h, dh).transpose(1, 2)  # (B, H, T, dh)
        k, v = self.wk(x)[:, None], self.wv(x)[:, None]  # (B, 1, T, dh): one KV head for the group
        o_cmp, probs = compressed_attention(q, k, v, cfg.block_size)  # (B, H, T, dh), (B, H, T, nB)
        with torch.no_grad():  # the choice carries no gradient
            groups = 1 if self.select == "shared" else h
            sel = nsa_select(probs, groups, self.top_n, cfg.block_size)  # (B, 1 or H, T, nB)
        read = blocks_to_mask(sel[:, :, -1:], cfg.block_size, t, causal=False).expand(b, h, 1, t)  # (B, H, 1, T)
        o_slc = scaled_dot_product_attention(q[:, :, -1:], k.expand(b, h, t, dh), v.expand(b, h, t, dh), read)
        g = torch.sigmoid(self.gate(x[:, -1])).view(b, h, 2, 1)  # (B, H, 2, 1)
        out = g[:, :, 0] * o_cmp[:, :, -1] + g[:, :, 1] * o_slc[:, :, 0]  # (B, H, dh)
        return self.out(out.reshape(b, h * dh)).view(b, 2, cfg.n_values), read[:, :, 0]


def train_groups(select: str, top_n: int, seed: int, cfg: GroupConfig | None = None, *,
                 eval_batch: int = 512) -> dict[str, float]:
    """Train one group model from `seed` with Adam; on `eval_batch` held-out sequences return ``accuracy`` (both
    needles right), ``needle_accuracy`` (each needle right, averaged), ``loss`` (mean cross-entropy per needle),
    ``recall`` (both needles inside the blocks the group loaded) and ``blocks_loaded`` (mean KV blocks the group
    loaded for the last query: the union over its heads' choices, the own block included)."""
    cfg = cfg or GroupConfig()
    _validate.positive_int("eval_batch", eval_batch)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(2000 + seed)
    model = GroupModel(cfg, select, top_n)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    for _ in range(cfg.steps):
        batch = two_needle_batch(cfg, cfg.batch, gen)
        logits = model(batch)[0]
        loss = nn.functional.cross_entropy(logits.reshape(-1, cfg.n_values), batch["answer"].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        batch = two_needle_batch(cfg, eval_batch, torch.Generator().manual_seed(20_000 + seed))
        logits, read = model(batch)
        right = logits.argmax(-1) == batch["answer"]  # (B, 2)
        loaded = read.any(1)  # (B, T): keys of the blocks any head of the group read
        held = loaded.gather(1, batch["pos"])  # (B, 2)
        loss = nn.functional.cross_entropy(logits.reshape(-1, cfg.n_values), batch["answer"].reshape(-1))
    blocks = loaded.view(eval_batch, -1, cfg.block_size).any(-1).sum(-1).float()  # (B,) blocks loaded
    return {"accuracy": float(right.all(1).float().mean()), "needle_accuracy": float(right.float().mean()),
            "loss": float(loss), "recall": float(held.all(1).float().mean()), "blocks_loaded": float(blocks.mean())}
