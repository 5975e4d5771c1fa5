"""A training step of attention on W real processes: ring attention's forward and backward rings, whose gradients
must equal the single-process ones (see :mod:`attncourse.ring`)."""

from __future__ import annotations

import torch

from . import _validate
from .ring import _split, _unsplit, ring_attention, ring_chunks, run_distributed
from .sdpa import _check_qkv

__all__ = ["distributed_training_step"]


def _training_worker(rank: int, world_size: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     grad_out: torch.Tensor, is_causal: bool, layouts: tuple[str, ...]) -> dict:
    """One rank, for each layout: its part of q, k, v as leaves, ring forward, ``(out * grad_out).sum()``
    backward (the backward ring), and what it holds afterwards."""
    results = {}
    for layout in layouts:
        q, k, v = (_split(x, rank, world_size, layout).clone().requires_grad_(True) for x in (query, key, value))
        result = ring_attention(q, k, v, is_causal=is_causal, layout=layout)
        (result.out * _split(grad_out, rank, world_size, layout)).sum().backward()
        results[layout] = (result.out.detach(), q.grad, k.grad, v.grad, result.pairs_scored, result.bytes_sent)
    return results


def distributed_training_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grad_out: torch.Tensor,
                              world_size: int, *, is_causal: bool = False,
                              layout: str | tuple[str, ...] = "contiguous", timeout: float = 120.0) -> dict:
    """Forward and backward of ring attention over `world_size` gloo processes.

    q, k (B, H, T, D), value (B, H, T, Dv), grad_out (B, H, T, Dv) the gradient arriving at the output. Returns
    ``{"out", "dq", "dk", "dv"}`` reassembled in sequence order, ``"pairs"``: the (query, key) pairs each rank
    scored in the forward, and ``"bytes"``: what each rank sent in the forward. A tuple of layouts runs each in
    the same launch and returns ``{layout: that dict}``.
    """
    layouts = (layout,) if isinstance(layout, str) else tuple(layout)
    _check_qkv(query, key, value)
    _validate.positive_int("world_size", world_size)
    _validate.tensor("grad_out", grad_out, min_rank=2, floating=True)
    n_chunks = max(sum(len(c) for c in ring_chunks(world_size, lay)) for lay in layouts)
    if query.shape[-2] != key.shape[-2] or query.shape[-2] % n_chunks or grad_out.shape != value.shape[:-2] + (
            query.shape[-2], value.shape[-1]):
        raise ValueError(f"self-attention with T divisible by {n_chunks} chunks and grad_out shaped like the output "
                         f"needed, got query {tuple(query.shape)}, key {tuple(key.shape)}, grad_out "
                         f"{tuple(grad_out.shape)}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    ranks = run_distributed(_training_worker, world_size, query, key, value, grad_out, is_causal, layouts,
                            timeout=timeout)
    got = {}
    for lay in layouts:
        got[lay] = {name: _unsplit([r[lay][i] for r in ranks], lay) for i, name in enumerate(("out", "dq", "dk", "dv"))}
        got[lay]["pairs"], got[lay]["bytes"] = [r[lay][4] for r in ranks], [r[lay][5] for r in ranks]
    return got[layout] if isinstance(layout, str) else got
