r"""NSA's learned compression: one summary key (and value) per *overlapping* block, computed by an MLP.

Native Sparse Attention (Yuan et al. 2025, arXiv:2502.11089, section 3.3.1) compresses the keys of block i, the
tokens :math:`[i d, i d + l)` (block length l, stride d < l so blocks overlap), as
:math:`\tilde k_i = \varphi(k_{id : id + l})`, with :math:`\varphi` a learnable MLP that also sees each token's position
inside the block; the paper uses l = 32, d = 16. Chapter 14's :func:`attncourse.learned_sparse.compressed_attention`
uses the mean of non-overlapping blocks, the simplest :math:`\varphi`; :class:`BlockCompressor` with ``stride ==
block_len``, an identity activation and averaging weights is exactly that mean (the tests check it).

Query t may read summary i once its block has ended: :math:`i d + l - 1 \le t`.
"""

from __future__ import annotations

import torch
from torch import nn

from . import _validate


def block_starts(length: int, block_len: int, stride: int) -> torch.Tensor:
    """Start positions (nC,) of the complete blocks [s, s + block_len) with s = 0, stride, 2 stride, ...

    Raises:
        ValueError: if a size is not a positive int or stride > block_len (blocks must cover every token).
    """
    for name, x in (("length", length), ("block_len", block_len), ("stride", stride)):
        _validate.positive_int(name, x)
    if stride > block_len:
        raise ValueError(f"stride ({stride}) must not exceed block_len ({block_len}): tokens would be skipped")
    return torch.arange(0, max(length - block_len + 1, 0), stride)


class BlockCompressor(nn.Module):
    """(B, H, T, D) -> (B, H, nC, D): an MLP over each block's ``block_len`` rows plus a learned intra-block
    position embedding. ``act`` defaults to GELU; ``nn.Identity()`` makes it linear.

    Args:
        dim: D. block_len: l. stride: d (<= l). hidden: width of the MLP's hidden layer.
    Raises:
        ValueError: for sizes that are not positive ints or stride > block_len.
    """

    def __init__(self, dim: int, block_len: int, stride: int, hidden: int = 64, act: nn.Module | None = None,
                 mean_skip: bool = False):
        super().__init__()
        self.mean_skip = mean_skip
        block_starts(block_len, block_len, stride)  # validates the sizes
        _validate.positive_int("dim", dim)
        _validate.positive_int("hidden", hidden)
        self.block_len, self.stride = block_len, stride
        self.pos = nn.Parameter(torch.zeros(block_len, dim))  # intra-block position embedding
        self.mlp = nn.Sequential(nn.Linear(block_len * dim, hidden), act or nn.GELU(), nn.Linear(hidden, dim))
        if mean_skip:  # start as the mean pool: the MLP learns a correction from zero
            nn.init.zeros_(self.mlp[-1].weight)
            nn.init.zeros_(self.mlp[-1].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _validate.tensor("x", x, min_rank=2, floating=True)
        starts = block_starts(x.shape[-2], self.block_len, self.stride)  # (nC,)
        idx = starts[:, None] + torch.arange(self.block_len)  # (nC, l) the token of each slot
        blocks = x[..., idx, :] + self.pos  # (..., nC, l, D)
        out = self.mlp(blocks.flatten(-2))  # (..., nC, D)
        return out + x[..., idx, :].mean(-2) if self.mean_skip else out


def compressed_attention_learned(query: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, block_len: int,
                                 stride: int, *, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over the compressed blocks that have ended (i stride + block_len - 1 <= t).

    Args:
        query: (B, H, T, D); k_cmp: (B, H, nC, D); v_cmp: (B, H, nC, Dv), from :class:`BlockCompressor`.
    Returns:
        (out (B, H, T, Dv), probs (B, H, T, nC)); rows with no finished block are zeros. Scores and softmax in
        float32 at least.
    Raises:
        TypeError, ValueError: for non-tensors, or nC that does not match T, block_len and stride.
    """
    for name, x in (("query", query), ("k_cmp", k_cmp), ("v_cmp", v_cmp)):
        _validate.tensor(name, x, min_rank=4, floating=True)
    starts = block_starts(query.shape[-2], block_len, stride)
    if k_cmp.shape[-2] != starts.numel() or v_cmp.shape[-2] != starts.numel() or k_cmp.shape[:2] != query.shape[:2]:
        raise ValueError(f"k_cmp and v_cmp must be (B, H, nC, D) with nC = {starts.numel()} blocks for T = "
                         f"{query.shape[-2]}, got k_cmp {tuple(k_cmp.shape)}, v_cmp {tuple(v_cmp.shape)}")
    work = torch.promote_types(query.dtype, torch.float32)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    done = (starts + block_len - 1)[None, :] <= torch.arange(query.shape[-2])[:, None]  # (T, nC)
    s = (query.to(work) @ k_cmp.to(work).transpose(-2, -1) * scale).masked_fill(~done, float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))  # 0 where masked
    z = e.sum(-1, keepdim=True)
    probs = e / torch.where(z > 0, z, torch.ones_like(z))
    return (probs @ v_cmp.to(work)).to(v_cmp.dtype), probs


# ----------------------------------------------------------------------------- trained: mean pool against the MLP


def selection_importance(probs: torch.Tensor, n_blocks: int, block_len: int, stride: int) -> torch.Tensor:
    """(..., T, nC) compressed probabilities -> (..., T, n_blocks) importance of the selection blocks of ``stride``
    tokens: the sum of the probabilities of every compressed block that overlaps it (NSA's eq. 9 for l' = d)."""
    _validate.tensor("probs", probs, min_rank=1, floating=True)
    block_starts(block_len, block_len, stride)  # validates the sizes
    starts = torch.arange(probs.shape[-1]) * stride  # (nC,) compressed block i covers [i stride, i stride + block_len)
    sel = torch.arange(n_blocks)[:, None]  # (nB, 1)
    overlap = (starts[None, :] < (sel + 1) * stride) & (starts[None, :] + block_len > sel * stride)  # (nB, nC)
    return probs @ overlap.to(probs.dtype).T  # (..., T, nB)


def train_learned_nsa(seed: int, cfg=None, *, compress: str = "mlp", mean_skip: bool = False, overlap: bool = True,
                      eval_batch: int = 512) -> dict[str, float]:
    """Chapter 14's NSA-style recall model (:mod:`attncourse.sparse_recall`, method ``"nsa"``) with its compressed
    keys and values made by :class:`BlockCompressor` over blocks of 2 x block_size at stride block_size
    (``compress="mlp"``) or by the mean of each block (``"mean"``, the chapter's default). Returns the dict of
    :func:`attncourse.sparse_recall.train_recall` (accuracy, recall, keys_read, entries_read)."""
    from .learned_sparse import blocks_to_mask, nsa_select
    from .sparse_recall import RecallConfig, RecallModel, fit_and_evaluate
    from .sdpa import scaled_dot_product_attention

    if compress not in ("mlp", "mean"):
        raise ValueError(f"compress must be 'mlp' or 'mean', got {compress!r}")
    cfg = cfg or RecallConfig()
    bs = cfg.block_size
    l, d = (2 * bs, bs) if compress == "mlp" and overlap else (bs, bs)
    torch.manual_seed(seed)
    model = RecallModel(cfg, "nsa")
    model.ck, model.cv = (BlockCompressor(cfg.d_model, l, d, hidden=2 * cfg.d_model, mean_skip=mean_skip)
                          for _ in range(2))
    if compress == "mean":  # fixed averaging weights: exactly the mean pool (no trained compression)
        for c in (model.ck, model.cv):
            c.mlp = nn.Sequential(nn.Linear(l * cfg.d_model, cfg.d_model, bias=False))
            with torch.no_grad():
                c.mlp[0].weight.copy_(torch.cat([torch.eye(cfg.d_model)] * l, 1) / l)
            c.requires_grad_(False)

    def forward(keys, values):
        x = model.key_emb(keys) + model.val_emb(values)  # (B, T, d)
        q, k, v = (w(x)[:, None] for w in (model.wq, model.wk, model.wv))  # (B, 1, T, d)
        t = keys.shape[1]
        o_cmp, probs = compressed_attention_learned(q, model.ck(k), model.cv(v), l, d)
        with torch.no_grad():  # the choice carries no gradient
            imp = selection_importance(probs, t // bs, l, d)  # (B, 1, T, nB)
            sel = nsa_select(imp, 1, cfg.budget // bs - 1, bs)
        allowed = blocks_to_mask(sel, bs, t)[:, 0, -1]  # (B, T)
        out = scaled_dot_product_attention(q[..., -1:, :], k, v, allowed[:, None, None, :])[:, 0, 0]
        g = torch.sigmoid(model.gate(x[:, -1]))  # (B, 2)
        return model.out(g[:, :1] * o_cmp[:, 0, -1] + g[:, 1:] * out), allowed

    gen = torch.Generator().manual_seed(1000 + seed)
    scores = fit_and_evaluate(forward, [p for p in model.parameters() if p.requires_grad], cfg, gen, seed, eval_batch)
    return {**scores, "entries_read": scores["keys_read"] + block_starts(cfg.seq_len, l, d).numel()}
