"""A small trained comparison for chapter 14: which keys does a query reach when it may read only a few?

The task (associative recall with one needle): every position holds a (key id, value id) pair; the needle's key id
appears once, somewhere before the last block; the last position holds that key id again and must output the
needle's value id. Every other key id differs from it, so only the needle answers. One attention layer (one head,
no positions: the needle can be anywhere) reads the sequence; the last query may read ``budget`` full-resolution
keys, chosen by

* ``dense``: every key (the reference: no budget);
* ``window``: the last ``budget`` keys;
* ``fixed``: the first block and the query's own block (a fixed block pattern: sink + local);
* ``moba``: its own block and the top blocks by :math:`q \\cdot \\bar k_b` (:func:`attncourse.learned_sparse.moba_gate`);
* ``nsa``: its own block and the top blocks by the compressed branch's probabilities, plus that compressed branch
  itself, mixed by learned sigmoid gates (:func:`attncourse.learned_sparse.nsa_select`); no window branch (the
  needle is never local) and none of NSA's forced initial and local blocks beyond the query's own block;
* ``dsa``: the ``budget`` single tokens with the best lightning-indexer scores
  (:func:`attncourse.learned_sparse.indexer_scores`, :data:`INDEX_HEADS` heads of :data:`INDEX_DIM`, on the token
  vectors *detached* as in DeepSeek-V3.2), the indexer trained only by :func:`attncourse.learned_sparse.indexer_kl_loss`
  toward the main head's dense attention row at the last query (DSA's warm-up target, used at every step because
  nothing here is pretrained), added to the task's loss.

The sparse methods are computed as dense attention under the selection's token mask (the lesson and the tests show
it equals the tile loop), and no gradient flows through a top-k choice. :func:`train_recall` returns accuracy and
the selection's recall: how often the chosen keys contain the needle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import _validate
from .learned_sparse import (blocks_to_mask, compressed_attention, indexer_kl_loss, indexer_scores, moba_gate, n_blocks,
                             nsa_select, top_k_tokens)
from .sdpa import scaled_dot_product_attention

__all__ = ["METHODS", "RecallConfig", "recall_batch", "RecallModel", "train_recall"]

METHODS = ("dense", "window", "fixed", "moba", "nsa", "dsa")
INDEX_HEADS, INDEX_DIM = 4, 16  # the dsa method's indexer: 4 small heads sharing one 16-dim key per token


@dataclass
class RecallConfig:
    seq_len: int = 64
    block_size: int = 8
    budget: int = 16  # full-resolution keys the last query may read (a multiple of block_size)
    n_keys: int = 24  # key ids; values are drawn from n_values ids
    n_values: int = 16
    d_model: int = 32
    steps: int = 300
    batch: int = 64
    lr: float = 3e-3


def recall_batch(cfg: RecallConfig, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """(keys (B, T), values (B, T), needle position (B,), answer (B,)) long tensors; the last position holds the
    queried key id and value id n_values (a "blank")."""
    t = cfg.seq_len
    query_key = torch.randint(0, cfg.n_keys, (batch,), generator=gen)
    keys = torch.randint(0, cfg.n_keys - 1, (batch, t), generator=gen)
    keys = keys + (keys >= query_key[:, None]).long()  # every other key id differs from the queried one
    values = torch.randint(0, cfg.n_values, (batch, t), generator=gen)
    pos = torch.randint(0, t - cfg.block_size, (batch,), generator=gen)  # before the query's own block
    rows = torch.arange(batch)
    keys[rows, pos] = query_key
    keys[:, -1] = query_key
    values[:, -1] = cfg.n_values
    return keys, values, pos, values[rows, pos]


class RecallModel(nn.Module):
    """Embeddings of (key id, value id), one attention head read at the last position, a linear read-out."""

    def __init__(self, cfg: RecallConfig, method: str):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if cfg.budget % cfg.block_size or cfg.budget < cfg.block_size:
            raise ValueError(f"budget ({cfg.budget}) must be a positive multiple of block_size ({cfg.block_size})")
        self.cfg, self.method = cfg, method
        d = cfg.d_model
        self.key_emb = nn.Embedding(cfg.n_keys, d)
        self.val_emb = nn.Embedding(cfg.n_values + 1, d)
        self.wq, self.wk, self.wv = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.gate = nn.Linear(d, 2)  # nsa: sigmoid gates of the compressed and the selected branch
        if method == "dsa":  # the lightning indexer: its own query heads, one shared key per token, a weight per head
            self.idx_q = nn.Linear(d, INDEX_HEADS * INDEX_DIM)
            self.idx_k = nn.Linear(d, INDEX_DIM)
            self.idx_w = nn.Linear(d, INDEX_HEADS)
        self.aux_loss = None  # dsa: the indexer's KL loss of the last forward, added to the task loss in training
        self.out = nn.Linear(d, cfg.n_values)

    def forward(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (B, n_values) at the last position, allowed (B, T) bool: the keys the last query read)."""
        cfg, t = self.cfg, keys.shape[1]
        x = self.key_emb(keys) + self.val_emb(values)  # (B, T, d)
        q, k, v = (w(x)[:, None] for w in (self.wq, self.wk, self.wv))  # (B, 1, T, d) one head
        own = (t - 1) // cfg.block_size
        n_sel = cfg.budget // cfg.block_size  # blocks of budget, the own block included
        pos = torch.arange(t)
        if self.method == "dense":
            allowed = torch.ones(keys.shape[0], t, dtype=torch.bool)
        elif self.method == "window":
            allowed = (pos >= t - cfg.budget).expand(keys.shape[0], t)
        elif self.method == "fixed":
            first = pos < (n_sel - 1) * cfg.block_size
            allowed = (first | (pos >= own * cfg.block_size)).expand(keys.shape[0], t)
        elif self.method == "dsa":
            b, xi = keys.shape[0], x.detach()  # the indexer's input is detached from the model, as in DSA
            q_idx = self.idx_q(xi[:, -1:]).view(b, 1, INDEX_HEADS, INDEX_DIM).transpose(1, 2)  # (B, HI, 1, DI)
            scores = indexer_scores(q_idx, self.idx_w(xi[:, -1:]).transpose(1, 2), self.idx_k(xi),
                                    causal=False)  # (B, 1, T): the last query may read every earlier token
            chosen = top_k_tokens(scores.detach(), cfg.budget)[:, 0]  # (B, budget) token indices; no gradient
            allowed = torch.zeros(b, t, dtype=torch.bool).scatter_(1, chosen, True)
            with torch.no_grad():  # the target: the main head's dense attention row at the last query
                dense_row = torch.softmax(q[:, :, -1:] @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, -1)  # (B, 1, 1, T)
            self.aux_loss = indexer_kl_loss(scores, dense_row)
        else:
            with torch.no_grad():  # the choice carries no gradient
                if self.method == "moba":
                    sel = moba_gate(q, k, cfg.block_size, n_sel)  # (B, 1, T, nB)
                else:
                    sel = nsa_select(compressed_attention(q, k, v, cfg.block_size)[1], 1, n_sel - 1, cfg.block_size)
            allowed = blocks_to_mask(sel, cfg.block_size, t)[:, 0, -1]  # (B, T): the last query's keys
        out = scaled_dot_product_attention(q[..., -1:, :], k, v, allowed[:, None, None, :])[:, 0, 0]  # (B, d)
        if self.method == "nsa":
            o_cmp = compressed_attention(q, k, v, cfg.block_size)[0][:, 0, -1]  # (B, d)
            g = torch.sigmoid(self.gate(x[:, -1]))  # (B, 2)
            out = g[:, :1] * o_cmp + g[:, 1:] * out
        return self.out(out), allowed


def train_recall(method: str, seed: int, cfg: RecallConfig | None = None, *, eval_batch: int = 512) -> dict[str, float]:
    """Train `method` from `seed`; return ``accuracy`` and ``recall`` (share of held-out sequences whose read keys
    hold the needle) on `eval_batch` fresh sequences, ``keys_read`` (mean full-resolution keys the last query
    read) and ``entries_read`` (those plus, for ``nsa``, the compressed entries its compressed branch reads: one per
    finished block; for ``dsa``, the indexer keys it scores: one per token)."""
    cfg = cfg or RecallConfig()
    _validate.positive_int("eval_batch", eval_batch)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    model = RecallModel(cfg, method)
    scores = fit_and_evaluate(model, model.parameters(), cfg, gen, seed, eval_batch)
    return {**scores, "blocks": n_blocks(cfg.seq_len, cfg.block_size),
            "entries_read": scores["keys_read"] + {"nsa": cfg.seq_len // cfg.block_size, "dsa": cfg.seq_len}.get(method, 0)}


def fit_and_evaluate(forward, params, cfg: RecallConfig, gen: torch.Generator, seed: int,
                     eval_batch: int) -> dict[str, float]:
    """Train `forward` ((keys, values) -> (logits (B, vocab), allowed (B, T) bool)) with Adam on `params` for
    `cfg.steps` batches drawn from `gen`; return ``accuracy``, ``recall`` and ``keys_read`` on `eval_batch` fresh
    held-out sequences (seeded by `seed`)."""
    opt = torch.optim.Adam(list(params), lr=cfg.lr)
    for _ in range(cfg.steps):
        keys, values, _, answer = recall_batch(cfg, cfg.batch, gen)
        loss = nn.functional.cross_entropy(forward(keys, values)[0], answer)
        if getattr(forward, "aux_loss", None) is not None:  # dsa: the indexer's KL (it reaches the indexer only)
            loss = loss + forward.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        keys, values, pos, answer = recall_batch(cfg, eval_batch, torch.Generator().manual_seed(10_000 + seed))
        logits, allowed = forward(keys, values)
    return {"accuracy": float((logits.argmax(-1) == answer).float().mean()),
            "recall": float(allowed[torch.arange(eval_batch), pos].float().mean()),
            "keys_read": float(allowed.sum(-1).float().mean())}
