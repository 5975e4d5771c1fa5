r"""Chapter 14's methods as character language models on *Coriolanus*, every query at the same budget of keys.

Section 6's retrieval task plants one needle and asks for it; text is different: most of what predicts the next
character is in the last few dozen, and the rest (a speaker's name, a repeated word) is somewhere earlier. This
module trains one small model per selection rule on :func:`attncourse.char_lm.shakespeare_chars` (the first 90% of
the play; the last 10% held out), windows of :data:`CONTEXT` characters, and lets every query ``t`` read at most
:data:`BUDGET` keys (blocks of :data:`BLOCK`), chosen by

* ``dense``: every key ``s <= t`` (the reference, no budget);
* ``window``: the last ``BUDGET`` keys;
* ``fixed``: the first block (a sink) and the ``BUDGET / BLOCK - 1`` most recent blocks, its own included;
* ``moba``: its own block and the top earlier blocks by :math:`q_t \cdot \bar k_b` (:func:`learned_sparse.moba_gate`);
* ``nsa``: NSA-style: the compressed branch (one mean-pooled key and value per finished block) plus a selected
  branch of its own block, the block before it (NSA's forced local blocks) and the top earlier blocks by the
  compressed probabilities (:func:`learned_sparse.nsa_select`), mixed by learned sigmoid gates per head; no window
  branch (NSA's would read keys beyond the budget);
* ``nsa_win`` (not in :data:`METHODS`; the control for ``nsa``): NSA with its window branch at the same budget: a
  window branch over the last ``BUDGET / 2`` keys, a selected branch of its own block (inside the window) and the
  ``BUDGET / (2 BLOCK)`` best earlier blocks by the compressed probabilities, and the compressed branch, mixed by
  three sigmoid gates per head; the distinct keys a query reads stay at most ``BUDGET``;
* ``dsa``: the ``BUDGET`` single tokens with the best lightning-indexer scores (:func:`learned_sparse.indexer_scores`,
  :data:`INDEX_HEADS` heads of :data:`INDEX_DIM`, with RoPE, on the layer's input *detached*; one choice shared by
  the heads, as in DSA's MQA mode), the indexer trained only by :func:`learned_sparse.indexer_kl_loss` toward the
  layer's dense attention (summed over heads), added to the language-model loss.

No gradient flows through any top-k choice. The sparse methods run as dense attention under each query's token
mask (the lesson checks that this equals the tile loop that does only the selected work). Every model is
``embedding -> N_LAYERS pre-norm blocks (RMSNorm, attention with RoPE, RMSNorm, SiLU MLP) -> RMSNorm -> head`` and
every method sees the same batches for a seed. ``FULL=1 python -m attncourse.sparse_lm`` trains 6 methods x 3 seeds
and writes ``notebooks/results/ch14_sparse_lm_full.json`` (:func:`main`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _validate
from .char_lm import shakespeare_chars, windows
from .learned_sparse import blocks_to_mask, compressed_attention, indexer_kl_loss, indexer_scores, moba_gate, \
    nsa_select, top_k_tokens
from .positions import apply_rope
from .sdpa import scaled_dot_product_attention

__all__ = ["METHODS", "SparseLM", "token_mask", "train", "main"]

METHODS = ("dense", "window", "fixed", "moba", "nsa", "dsa")
ALL_METHODS = METHODS + ("nsa_win",)  # nsa_win: NSA-style with its window branch (a stored control)
CONTEXT, BLOCK, BUDGET = 256, 8, 32  # characters per window; key block; keys a query may read (4 blocks)
D_MODEL, N_HEADS, HEAD_DIM, N_LAYERS, D_FF = 32, 2, 16, 2, 128
INDEX_HEADS, INDEX_DIM = 4, 16
STEPS, BATCH, LR = 300, 8, 1e-2
EVAL_WINDOWS, FAR = 32, 128  # held-out windows; "far" loss: positions t >= FAR, where dense reads >= 4x the budget
DATA = Path(__file__).resolve().parents[1] / "notebooks/data/shakespeare/coriolanus.txt"


def _causal(t: int) -> torch.Tensor:
    return torch.arange(t)[None, :] <= torch.arange(t)[:, None]  # (T, T)


def token_mask(method: str, t: int, block: int = BLOCK, budget: int = BUDGET) -> torch.Tensor:
    """(T, T) bool: the keys each query reads under a rule fixed before the data (``dense``, ``window``, ``fixed``)."""
    pos, causal = torch.arange(t), _causal(t)
    if method == "dense":
        return causal
    if method == "window":
        return causal & (pos[None, :] > pos[:, None] - budget)
    if method == "fixed":
        own = pos // block
        recent = (pos[None, :] // block) > own[:, None] - (budget // block - 1)  # own and the blocks just before it
        return causal & ((pos[None, :] < block) | recent)
    raise ValueError(f"token_mask takes 'dense', 'window' or 'fixed', got {method!r}")


class SparseAttention(nn.Module):
    """One causal attention layer whose queries read keys chosen by `method`; (B, T, d) -> (B, T, d)."""

    def __init__(self, method: str, d_model: int = D_MODEL, n_heads: int = N_HEADS, head_dim: int = HEAD_DIM,
                 block: int = BLOCK, budget: int = BUDGET) -> None:
        super().__init__()
        if method not in ALL_METHODS:
            raise ValueError(f"method must be one of {ALL_METHODS}, got {method!r}")
        if budget % block or budget < 2 * block:
            raise ValueError(f"budget ({budget}) must be a multiple of block ({block}) and at least two blocks")
        self.method, self.h, self.hd, self.block, self.budget = method, n_heads, head_dim, block, budget
        self.qkv = nn.Linear(d_model, 3 * n_heads * head_dim, bias=False)
        self.out = nn.Linear(n_heads * head_dim, d_model, bias=False)
        if method in ("nsa", "nsa_win"):  # per head: compressed, selected (and window)
            self.gate = nn.Linear(d_model, (2 + (method == "nsa_win")) * n_heads)
        if method == "dsa":
            self.idx_q = nn.Linear(d_model, INDEX_HEADS * INDEX_DIM, bias=False)
            self.idx_k = nn.Linear(d_model, INDEX_DIM, bias=False)
            self.idx_w = nn.Linear(d_model, INDEX_HEADS, bias=False)
        self.aux_loss: torch.Tensor | None = None  # dsa: the indexer's KL loss of the last forward
        self.keys_read: torch.Tensor | None = None  # (T,) mean keys read per query position, last forward

    def _mask(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """(B, H or 1, T, T) bool: the keys each query reads."""
        t, n_sel = x.shape[1], self.budget // self.block
        if self.method in ("dense", "window", "fixed"):
            return token_mask(self.method, t, self.block, self.budget)[None, None]
        with torch.no_grad():  # the choice carries no gradient
            if self.method == "moba":
                return blocks_to_mask(moba_gate(q, k, self.block, n_sel), self.block, t)
            if self.method == "nsa":
                probs = compressed_attention(q, k, k, self.block)[1]  # (B, H, T, nB)
                own = torch.arange(t) // self.block
                prev = torch.arange(probs.shape[-1])[None, :] == own[:, None] - 1  # (T, nB) the block before
                sel = nsa_select(probs + 10.0 * prev, self.h, n_sel - 1, self.block)  # forced, then top n_sel - 2
                return blocks_to_mask(sel, self.block, t)
            if self.method == "nsa_win":  # own block (inside the window) and the best budget / (2 block) earlier
                probs = compressed_attention(q, k, k, self.block)[1]
                sel = nsa_select(probs, self.h, self.budget // (2 * self.block), self.block)
                return blocks_to_mask(sel, self.block, t)
        b = x.shape[0]  # dsa
        xi = x.detach()  # the indexer reads the layer's input detached, as in DeepSeek-V3.2
        qi = apply_rope(self.idx_q(xi).view(b, t, INDEX_HEADS, INDEX_DIM).transpose(1, 2))  # (B, HI, T, DI)
        scores = indexer_scores(qi, self.idx_w(xi).transpose(1, 2), apply_rope(self.idx_k(xi)))  # (B, T, T)
        chosen = top_k_tokens(scores.detach(), self.budget)  # (B, T, budget), -1 where fewer exist
        mask = torch.zeros(b, t, t + 1, dtype=torch.bool).scatter_(-1, torch.where(chosen >= 0, chosen, t), True)
        with torch.no_grad():  # the target: this layer's dense causal attention
            s = (q @ k.transpose(-2, -1)) / self.hd ** 0.5
            dense = torch.softmax(s.masked_fill(~_causal(t), float("-inf")), -1)  # (B, H, T, T)
        self.aux_loss = indexer_kl_loss(scores, dense)
        return mask[:, None, :, :t]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.reshape(b, t, self.h, self.hd).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        q, k = apply_rope(q), apply_rope(k)  # (B, H, T, hd)
        mask = self._mask(x, q, k)
        win = token_mask("window", t, self.block, self.budget // 2)[None, None] if self.method == "nsa_win" else None
        read = mask if win is None else mask | win  # the distinct keys a query reads
        self.keys_read = read.float().sum(-1).mean(dim=(0, 1)) if read.dim() == 4 else None  # (T,)
        o = scaled_dot_product_attention(q, k, v, mask)  # (B, H, T, hd)
        if self.method in ("nsa", "nsa_win"):
            o_cmp = compressed_attention(q, k, v, self.block)[0]  # (B, H, T, hd)
            g = torch.sigmoid(self.gate(x)).view(b, t, self.h, -1).transpose(1, 2)  # (B, H, T, 2 or 3)
            o = g[..., :1] * o_cmp + g[..., 1:2] * o
            if win is not None:
                o = o + g[..., 2:] * scaled_dot_product_attention(q, k, v, win)
        return self.out(o.transpose(1, 2).reshape(b, t, -1))


class SparseLM(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab): pre-norm blocks whose attention reads keys chosen by `method`."""

    def __init__(self, vocab_size: int, method: str, n_layers: int = N_LAYERS, d_model: int = D_MODEL,
                 d_ff: int = D_FF) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("n_layers", n_layers), ("d_ff", d_ff)):
            _validate.positive_int(name, value)
        self.tok = nn.Embedding(vocab_size, d_model)
        self.attn = nn.ModuleList(SparseAttention(method, d_model) for _ in range(n_layers))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d_model, d_ff), nn.SiLU(), nn.Linear(d_ff, d_model))
                                  for _ in range(n_layers))
        self.norms = nn.ModuleList(nn.RMSNorm(d_model) for _ in range(2 * n_layers + 1))
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _validate.tensor("tokens", tokens, min_rank=2)
        if tokens.dim() != 2 or tokens.is_floating_point():
            raise ValueError(f"tokens must be integer ids (B, T), got shape {tuple(tokens.shape)}")
        x = self.tok(tokens)
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlps)):
            x = x + attn(self.norms[2 * i](x))
            x = x + mlp(self.norms[2 * i + 1](x))
        return self.head(self.norms[-1](x))

    def aux_loss(self) -> torch.Tensor | float:
        return sum(a.aux_loss for a in self.attn if a.aux_loss is not None) or 0.0


@torch.no_grad()
def evaluate(model: SparseLM, batch: torch.Tensor) -> dict[str, float]:
    """Held-out next-character loss (nats) on `batch` (n, T + 1): over all positions, and over positions >= FAR;
    plus the mean keys a query reads at positions >= FAR (first layer)."""
    model.eval()
    logits = model(batch[:, :-1])
    model.train()
    ce = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")  # (n, T)
    return {"loss": round(ce.mean().item(), 5), "far_loss": round(ce[:, FAR:].mean().item(), 5),
            "far_keys_read": round(model.attn[0].keys_read[FAR:].mean().item(), 3)}


def train(method: str, seed: int, data: tuple[torch.Tensor, torch.Tensor, str] | None = None, steps: int = STEPS,
          stop: int | None = None, lr: float = LR) -> dict:
    """Train `method` from `seed` (AdamW, one-cycle to `lr`, clipping at 1, batch :data:`BATCH`); returns the training
    loss per step and the held-out scores of :func:`evaluate`. `stop`: end after that many steps of the same run
    (a slice of a stored run, re-measured; no evaluation)."""
    if method not in ALL_METHODS:
        raise ValueError(f"method must be one of {ALL_METHODS}, got {method!r}")
    _validate.positive_int("steps", steps)
    if stop is not None and not (isinstance(stop, int) and 0 < stop <= steps):
        raise ValueError(f"stop must be an int in 1..steps={steps}, got {stop!r}")
    train_ids, held, vocab = data if data is not None else shakespeare_chars(DATA)
    torch.manual_seed(seed)
    model = SparseLM(len(vocab), method)
    gen = torch.Generator().manual_seed(3000 + seed)  # the same batches for every method
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    out: dict = {"train": []}
    for _ in range(stop or steps):
        batch = windows(train_ids, BATCH, CONTEXT, gen)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        (loss + model.aux_loss()).backward()  # the indexer's KL reaches only the indexer (its input is detached)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        out["train"].append(round(loss.item(), 5))
    if stop is None:
        starts = torch.linspace(0, len(held) - CONTEXT - 2, EVAL_WINDOWS).long().tolist()
        out.update(evaluate(model, torch.stack([held[s:s + CONTEXT + 1] for s in starts])))
    return out


def main(path: str | Path = "notebooks/results/ch14_sparse_lm_full.json", seeds: tuple[int, ...] = (0, 1, 2),
         steps: int = STEPS, lr: float = LR) -> dict:
    """Train every method on every seed for `steps`; write the results to `path` (JSON). ``METHOD`` in the
    environment restricts one process to some methods, comma-separated (parallel jobs; merge the files by hand).
    The lesson's longer control: ``FULL=1 METHOD=dense,window STEPS=600
    OUT=notebooks/results/ch14_sparse_lm_long_full.json python -m attncourse.sparse_lm``; NSA with its window
    branch: ``FULL=1 METHOD=nsa_win OUT=notebooks/results/ch14_sparse_lm_nsawin_full.json``; a second learning rate:
    ``LR=3e-3`` (``OUT=notebooks/results/ch14_sparse_lm_lr3e-3_full.json``)."""
    torch.set_num_threads(1)
    data = shakespeare_chars(DATA)
    result = {"config": {"context": CONTEXT, "block": BLOCK, "budget": BUDGET, "d_model": D_MODEL, "n_heads": N_HEADS,
                         "n_layers": N_LAYERS, "steps": steps, "batch": BATCH, "lr": lr, "far": FAR,
                         "eval_windows": EVAL_WINDOWS, "seeds": list(seeds)}, "runs": {}}
    only = os.environ.get("METHOD")
    for method in ALL_METHODS if only else METHODS:
        if only and method not in only.split(","):
            continue
        result["runs"][method] = {}
        for seed in seeds:
            run = train(method, seed, data, steps, lr=lr)
            result["runs"][method][str(seed)] = run
            print(method, seed, {k: v for k, v in run.items() if k != "train"}, file=sys.stderr, flush=True)
            Path(path).write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    if os.environ.get("FULL") != "1":
        raise SystemExit("set FULL=1 to train 6 methods x 3 seeds (tens of CPU minutes)")
    main(os.environ.get("OUT", "notebooks/results/ch14_sparse_lm_full.json"), steps=int(os.environ.get("STEPS", STEPS)),
         lr=float(os.environ.get("LR", LR)))
