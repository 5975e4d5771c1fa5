"""A training step of attention on W real processes: ring attention's forward and backward rings, whose gradients
must equal the single-process ones (see :mod:`attncourse.ring`)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import _validate
from .ring import _split, _unsplit, ring_attention, ring_chunks, run_distributed
from .sdpa import _check_qkv

__all__ = ["distributed_training_step", "ring_overlap_timing", "ring_training_record"]


def _training_worker(rank: int, world_size: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     grad_out: torch.Tensor, is_causal: bool, layouts: tuple[str, ...], overlap: bool = True,
                     grad_dtype: torch.dtype | None = None) -> dict:
    """One rank, for each layout: its part of q, k, v as leaves, ring forward, ``(out * grad_out).sum()``
    backward (the backward ring), and what it holds afterwards."""
    results = {}
    for layout in layouts:
        q, k, v = (_split(x, rank, world_size, layout).clone().requires_grad_(True) for x in (query, key, value))
        result = ring_attention(q, k, v, is_causal=is_causal, layout=layout, overlap=overlap, grad_dtype=grad_dtype)
        (result.out * _split(grad_out, rank, world_size, layout)).sum().backward()
        results[layout] = (result.out.detach(), q.grad, k.grad, v.grad, result.pairs_scored, result.bytes_sent,
                           result.traffic["bytes_sent_backward"])
    return results


def distributed_training_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grad_out: torch.Tensor,
                              world_size: int, *, is_causal: bool = False,
                              layout: str | tuple[str, ...] = "contiguous", timeout: float = 120.0,
                              overlap: bool = True, grad_dtype: torch.dtype | None = None) -> dict:
    """Forward and backward of ring attention over `world_size` gloo processes.

    q, k (B, H, T, D), value (B, H, T, Dv), grad_out (B, H, T, Dv) the gradient arriving at the output. Returns
    ``{"out", "dq", "dk", "dv"}`` reassembled in sequence order, ``"pairs"``: the (query, key) pairs each rank
    scored in the forward, ``"bytes"`` and ``"bytes_backward"``: what each rank sent in the forward and in the
    backward ring, counted from the tensors handed to ``dist.isend``. A tuple of layouts runs each in the same
    launch and returns ``{layout: that dict}``. ``overlap=False`` runs the serial baseline of
    :func:`~attncourse.ring.ring_attention` (same results); `grad_dtype` is its dtype for dK and dV on the backward
    ring (None: K's). Raises ValueError/TypeError for shapes that do not split.
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
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {type(overlap).__name__}")
    if grad_dtype is not None and not (isinstance(grad_dtype, torch.dtype) and grad_dtype.is_floating_point):
        raise TypeError(f"grad_dtype must be None or a floating torch.dtype, got {grad_dtype!r}")
    ranks = run_distributed(_training_worker, world_size, query, key, value, grad_out, is_causal, layouts, overlap,
                            grad_dtype, timeout=timeout)
    got = {}
    for lay in layouts:
        got[lay] = {name: _unsplit([r[lay][i] for r in ranks], lay) for i, name in enumerate(("out", "dq", "dk", "dv"))}
        got[lay]["pairs"], got[lay]["bytes"] = [r[lay][4] for r in ranks], [r[lay][5] for r in ranks]
        got[lay]["bytes_backward"] = [r[lay][6] for r in ranks]
    return got[layout] if isinstance(layout, str) else got


def _timing_worker(rank: int, world_size: int, n_heads: int, seq_len: int, head_dim: int, repeats: int,
                   is_causal: bool) -> dict:
    """One rank of :func:`ring_overlap_timing`: forward + backward of ring attention on its block, timed from a
    barrier to the end of its backward, with overlap on and off in alternating order (one warm-up each)."""
    gen = torch.Generator().manual_seed(rank)
    t_r = seq_len // world_size
    q, k, v = (torch.randn(1, n_heads, t_r, head_dim, generator=gen).requires_grad_(True) for _ in range(3))
    times = {True: [], False: []}
    waits = {True: [], False: []}
    for rep in range(repeats + 1):
        for overlap in ((True, False) if rep % 2 else (False, True)):
            dist.barrier()
            start = time.perf_counter()
            r = ring_attention(q, k, v, is_causal=is_causal, overlap=overlap)
            r.out.sum().backward()
            elapsed = time.perf_counter() - start
            if rep > 0:  # the first round warms up
                times[overlap].append(elapsed)
                waits[overlap].append(r.traffic["wait_s"] + r.traffic["wait_s_backward"])
    return {"times": times, "waits": waits}


def ring_overlap_timing(world_size: int, *, seq_len: int = 4096, n_heads: int = 8, head_dim: int = 64,
                        repeats: int = 3, is_causal: bool = False, timeout: float = 600.0) -> dict:
    """Time a training step (forward and backward ring) of ring attention on `world_size` gloo processes, with
    the transfers overlapped with compute and serialised (each waited for as soon as it starts).

    Every rank holds (1, n_heads, seq_len / W, head_dim) float32 blocks. Each repeat runs both modes (order
    alternating, after a warm-up). Returns ``{"overlap": [...], "serial": [...]}``: per repeat, the step time in
    seconds of the slowest rank (the ring waits for it), and ``{"overlap_wait": [...], "serial_wait": [...]}``:
    per repeat, the seconds the slowest rank spent blocked waiting for transfers. Raises ValueError for
    non-positive sizes or a length that does not split.
    """
    for name, x in (("world_size", world_size), ("seq_len", seq_len), ("n_heads", n_heads),
                    ("head_dim", head_dim), ("repeats", repeats)):
        _validate.positive_int(name, x)
    if seq_len % world_size:
        raise ValueError(f"seq_len={seq_len} must be divisible by world_size={world_size}")
    ranks = run_distributed(_timing_worker, world_size, n_heads, seq_len, head_dim, repeats, is_causal,
                            timeout=timeout)
    got = {}
    for overlap, name in ((True, "overlap"), (False, "serial")):
        got[name] = [max(r["times"][overlap][i] for r in ranks) for i in range(repeats)]
        got[name + "_wait"] = [max(r["waits"][overlap][i] for r in ranks) for i in range(repeats)]
    return got


def ring_training_record(world_size: int, *, seed: int = 0, batch: int = 1, n_heads: int = 4, seq_len: int = 48,
                         head_dim: int = 16) -> dict:
    """One causal ring training step on `world_size` gloo processes, both layouts, as plain numbers: what the
    lesson stores from a ``FULL=1`` run and a test re-derives.

    q, k, v and the output gradient are (batch, n_heads, seq_len, head_dim) float64, drawn in that order from
    ``torch.Generator().manual_seed(seed)``. Returns ``{"world_size", "seed", "shape", "layouts": {layout: {"pairs",
    "bytes", "bytes_backward", "max_err"}}}``: the pairs each rank scored, the bytes each rank handed to
    ``dist.isend`` in the forward and in the backward ring, and the largest absolute difference of the output and
    of dQ, dK, dV from single-process autograd over :func:`~attncourse.sdpa.scaled_dot_product_attention`.
    Raises ValueError for sizes that do not split into 2 W chunks.
    """
    from .sdpa import scaled_dot_product_attention

    for name, x in (("world_size", world_size), ("batch", batch), ("n_heads", n_heads), ("seq_len", seq_len),
                    ("head_dim", head_dim)):
        _validate.positive_int(name, x)
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, n_heads, seq_len, head_dim)
    q, k, v, g = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
    runs = distributed_training_step(q, k, v, g, world_size, is_causal=True, layout=("contiguous", "zigzag"))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    single = scaled_dot_product_attention(*leaves, is_causal=True)
    (single * g).sum().backward()
    reference = {"out": single.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    layouts = {}
    for layout, got in runs.items():
        layouts[layout] = {"pairs": got["pairs"], "bytes": got["bytes"], "bytes_backward": got["bytes_backward"],
                           "max_err": {name: float((got[name] - ref).abs().max()) for name, ref in reference.items()}}
    return {"world_size": world_size, "seed": seed, "shape": list(shape), "layouts": layouts}
