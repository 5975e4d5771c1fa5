"""MQAR in Zoology's format (each key and each value its own token) and the short convolution's role.

Zoology (Arora et al. 2023, arXiv:2312.04927) lays out multi-query associative recall as ``k1 v1 k2 v2 ... kN vN``
then the queries. A layer that reads value ``v_i`` at its own position cannot know which key it belongs to: the key
sits one token earlier. Softmax attention with positions can learn to look one token back; a linear-attention layer
gets it from a short causal convolution over the last few tokens, which DeltaNet and Gated DeltaNet put on q, k and v
(kernel 4 in flash-linear-attention's layers). :class:`ZoologyModel` builds the same two-layer models as
:mod:`attncourse.recall` over these tokens, with or without that convolution, so the ablation can be measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate
from .recall import Mixer


def zoology_batch(gen: torch.Generator, batch_size: int, n_pairs: int,
                  vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, 3N): keys are ids [0, vocab), values ids [vocab, 2 vocab); N pairs ``k v`` then the N keys in a
    random order. Targets (B, N): the value (0..vocab-1) of each query's key.

    Raises:
        ValueError: for sizes that are not positive ints, or n_pairs > vocab (keys are distinct).
    """
    for name, x in (("batch_size", batch_size), ("n_pairs", n_pairs), ("vocab", vocab)):
        _validate.positive_int(name, x)
    if n_pairs > vocab:
        raise ValueError(f"n_pairs ({n_pairs}) cannot exceed vocab ({vocab}): keys are distinct")
    keys = torch.rand(batch_size, vocab, generator=gen).argsort(-1)[:, :n_pairs]  # (B, N) distinct
    values = torch.randint(0, vocab, (batch_size, n_pairs), generator=gen)  # (B, N)
    order = torch.rand(batch_size, n_pairs, generator=gen).argsort(-1)  # (B, N)
    pairs = torch.stack([keys, values + vocab], dim=-1).flatten(1)  # (B, 2N): k1 v1 k2 v2 ...
    return torch.cat([pairs, keys.gather(1, order)], dim=1), values.gather(1, order)


class ShortConv(nn.Module):
    """Causal depthwise convolution over time plus SiLU, (B, T, C) -> (B, T, C): token t sees tokens t-K+1..t."""

    def __init__(self, channels: int, kernel: int = 4):
        super().__init__()
        _validate.positive_int("kernel", kernel)
        self.conv = nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        return F.silu(self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2))  # drop the right padding: causal


class ZoologyModel(nn.Module):
    """Token embedding, ``n_layers`` pre-norm residual mixers of one kind, a read-out over values.

    Args:
        kind: a :class:`attncourse.recall.Mixer` kind ("softmax", "linear", "deltanet", "gated_deltanet", ...).
        short_conv: put a :class:`ShortConv` (kernel 4) on the mixer's q, k and v, as DeltaNet's layer does.
    """

    def __init__(self, kind: str, short_conv: bool, d_model: int = 32, n_heads: int = 2, n_layers: int = 2,
                 vocab: int = 64):
        super().__init__()
        self.embed = nn.Embedding(2 * vocab, d_model)
        self.mixers = nn.ModuleList(Mixer(kind, d_model, n_heads) for _ in range(n_layers))
        if short_conv:
            for m in self.mixers:  # the projection, then the convolution over time (Mixer.forward calls self.qkv)
                m.qkv = nn.Sequential(m.qkv, ShortConv(3 * d_model))
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layers))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, d)
        for norm, mixer in zip(self.norms, self.mixers):
            x = x + mixer(norm(x))
        return self.head(x)  # (B, T, vocab)


def fit_queries(model: nn.Module, batches, steps: int, lr: float, n_context: int, seed: int) -> None:
    """Train `model` in place on the queries of `steps` batches: ``batches(gen)`` returns (tokens (B, T), targets
    (B, T - n_context)) and the loss is cross-entropy at the positions after the first `n_context` tokens. AdamW
    (no weight decay), one-cycle schedule to `lr`, gradient clipping at 1, batches drawn from a generator seeded
    ``10_000 + seed``: the recipe of every MQAR run in chapter 13."""
    _validate.positive_int("steps", steps)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(10_000 + seed)
    for _ in range(steps):
        tokens, targets = batches(gen)[:2]
        logits = model(tokens)[:, n_context:]  # (B, queries, vocab) the query positions
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()


def train_zoology(kind: str, short_conv: bool, n_pairs: int, seed: int, steps: int = 400, batch_size: int = 32,
                  lr: float = 1e-2, vocab: int = 64, d_model: int = 32) -> float:
    """Train a :class:`ZoologyModel` from `seed`; held-out accuracy over 256 sequences' queries."""
    _validate.positive_int("steps", steps)
    torch.manual_seed(seed)
    model = ZoologyModel(kind, short_conv, d_model=d_model, vocab=vocab)
    fit_queries(model, lambda gen: zoology_batch(gen, batch_size, n_pairs, vocab), steps, lr, 2 * n_pairs, seed)
    with torch.no_grad():
        tokens, targets = zoology_batch(torch.Generator().manual_seed(20_000 + seed), 256, n_pairs, vocab)
        return float((model(tokens)[:, 2 * n_pairs:].argmax(-1) == targets).float().mean())


def zoology_sweep(kinds: tuple[str, ...], n_pairs: int, seeds: tuple[int, ...],
                  **train_kwargs) -> dict[str, list[float]]:
    """Held-out accuracy of every kind with and without the short convolution, one entry per seed:
    "<kind>" and "<kind> + conv" -> [accuracy per seed]. Keyword arguments go to :func:`train_zoology`."""
    return {f"{kind}{' + conv' if conv else ''}": [train_zoology(kind, conv, n_pairs, s, **train_kwargs) for s in seeds]
            for kind in kinds for conv in (False, True)}


def zoology_lr_sweep(kinds: tuple[str, ...], n_pairs: int, seeds: tuple[int, ...], lrs: tuple[float, ...],
                     short_conv: bool = True, **train_kwargs) -> dict[str, dict[str, list[float]]]:
    """Zoology's protocol: every kind trained at every learning rate, one accuracy per seed:
    kind -> {str(lr) -> [accuracy per seed]}. Keyword arguments go to :func:`train_zoology`."""
    for lr in lrs:
        if not isinstance(lr, float) or not lr > 0:
            raise ValueError(f"lrs must be positive floats, got {lrs!r}")
    return {kind: {str(lr): [train_zoology(kind, short_conv, n_pairs, s, lr=lr, **train_kwargs) for s in seeds]
                   for lr in lrs} for kind in kinds}


def best_lr(sweep: dict[str, list[float]]) -> str:
    """The learning rate (a key of `sweep`, lr -> [accuracy per seed]) with the best mean accuracy over seeds."""
    if not sweep:
        raise ValueError("sweep must hold at least one learning rate")
    return max(sweep, key=lambda lr: sum(sweep[lr]) / len(sweep[lr]))
