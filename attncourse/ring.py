r"""Sequence parallelism on ``torch.distributed``: ring attention and Ulysses, with a local launcher.

**Ring attention** (Liu et al. 2023). Each of W ranks holds one block of the sequence: its queries and
its keys and values. In W steps every key/value block travels once around the ring (rank r sends to
r + 1 and receives from r - 1, the next transfer overlapping the current block's compute); each rank
folds the block it holds into an online-softmax state of its queries and merges it with
:func:`~attncourse.merge_attention_states` (chapter 08). No rank ever holds more than two key/value
blocks, and the result equals attention over the whole sequence. Under a causal mask a rank skips the
blocks that come after its own (it still forwards them). Bytes sent per rank: (W - 1) blocks of keys
and values, ``2 (W-1)/W * B * Hkv * T * D * bytes`` in total.

**Ulysses** (Jacobs et al. 2023): one all-to-all turns "my block of the sequence, all heads" into "the
whole sequence, H / W of the heads"; each rank runs ordinary attention on its heads; a second
all-to-all turns the output back. Bytes per rank: about ``4 (W-1)/W`` of the local q, k, v, out blocks.

:func:`run_distributed` starts W local processes with ``torch.multiprocessing`` joined in a gloo
process group (on 127.0.0.1, a free port chosen by the operating system), runs a function of this
package in each and returns what each rank returned. :func:`distributed_attention` is the whole
round trip: split, launch, gather.
"""

from __future__ import annotations

import datetime
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from . import _validate
from .flash import flash_attention
from .online_softmax import AttentionState, finalize_attention_state, merge_attention_states, online_attention_update
from .sdpa import _check_qkv

__all__ = ["RingOutput", "ring_attention", "ulysses_attention", "ring_bytes_per_rank", "ulysses_bytes_per_rank",
           "run_distributed", "distributed_attention"]


class RingOutput(NamedTuple):
    """What :func:`ring_attention` returns on each rank: the local output (..., Tq_r, Dv), its log-sum-exp
    (..., Tq_r), the bytes this rank sent, and how many key/value blocks it actually computed with."""

    out: torch.Tensor
    lse: torch.Tensor
    bytes_sent: int
    blocks_computed: int


def _empty_state(q: torch.Tensor, dv: int) -> AttentionState:
    m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)  # (..., Tq)
    return AttentionState(m, torch.zeros_like(m), torch.zeros(*q.shape[:-1], dv, dtype=q.dtype, device=q.device))


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool = False,
                   scale: float | None = None, group: Any = None) -> RingOutput:
    """Attention over the whole sequence when each rank of `group` holds one block of it.

    Call on every rank with its block: query (..., T_r, D), key (..., T_r, D), value (..., T_r, Dv), blocks
    in rank order (rank 0 holds positions 0 .. T_0 - 1, and so on; block lengths may differ). Queries and
    keys of a rank cover the same positions. ``is_causal`` masks keys after each query's own position.
    """
    _check_qkv(query, key, value)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if query.shape[-2] != key.shape[-2]:
        raise ValueError(f"each rank's query and key blocks must cover the same positions, got query "
                         f"{tuple(query.shape)} and key {tuple(key.shape)}")
    if not dist.is_initialized():
        raise RuntimeError("ring_attention needs an initialised process group (see run_distributed)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    lengths = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([key.shape[-2]]), group=group)  # every block's length
    starts = [0, *torch.cumsum(torch.cat(lengths), 0).tolist()]  # block r covers starts[r] .. starts[r+1]-1
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q, d = query.to(dtype), key.shape[-1]
    q_pos = torch.arange(starts[rank], starts[rank + 1])  # (T_r,) absolute positions of my queries
    kv = torch.cat([key, value], dim=-1).contiguous()  # (..., T_r, D + Dv): one message per step
    state, sent, computed = _empty_state(q, value.shape[-1]), 0, 0
    for step in range(world):
        src = (rank - step) % world  # the rank whose keys I hold now
        if step < world - 1:  # start passing them on before computing with them
            incoming = torch.empty(*kv.shape[:-2], int(lengths[(src - 1) % world]), kv.shape[-1], dtype=kv.dtype)
            ops = [dist.P2POp(dist.isend, kv, ranks[(rank + 1) % world], group),
                   dist.P2POp(dist.irecv, incoming, ranks[(rank - 1) % world], group)]
            requests = dist.batch_isend_irecv(ops)
            sent += kv.numel() * kv.element_size()
        if not (is_causal and starts[src] > q_pos[-1]):  # causal: blocks after mine are fully masked
            k_blk, v_blk = kv.to(dtype).split([d, kv.shape[-1] - d], dim=-1)  # (..., T_src, D), (..., T_src, Dv)
            scores = (q @ k_blk.transpose(-2, -1)) * scale  # (..., T_r, D) @ (..., D, T_src) -> (..., T_r, T_src)
            if is_causal:
                k_pos = torch.arange(starts[src], starts[src + 1])  # (T_src,)
                scores = scores.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
            partial = online_attention_update(_empty_state(q, v_blk.shape[-1]), scores, v_blk)
            state = merge_attention_states(state, partial)  # chapter 08's merge rule
            computed += 1
        if step < world - 1:
            for request in requests:
                request.wait()
            kv = incoming
    out, lse = finalize_attention_state(state)
    return RingOutput(out.to(value.dtype), lse, sent, computed)


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """x (W, ...): part w goes to rank w; returns (W, ...) whose part w came from rank w."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous like x (empty_like keeps a permuted input's strides)
    dist.all_to_all_single(out, x, group=group)
    return out


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool = False,
                      scale: float | None = None, group: Any = None) -> tuple[torch.Tensor, int]:
    """DeepSpeed-Ulysses: all-to-all from sequence blocks to head groups, attention, all-to-all back.

    Every rank passes its sequence block (B, H, T_r, D) of queries, keys and values (equal T_r on all
    ranks, H and Hkv divisible by the world size). Returns (its output block (B, H, T_r, Dv), bytes sent).
    """
    _check_qkv(query, key, value)
    world = dist.get_world_size(group)
    if query.dim() != 4 or query.shape[1] % world or key.shape[1] % world or key.shape[-2] != query.shape[-2]:
        raise ValueError(f"query, key and value must be (B, H, T_r, D) with heads divisible by the world size "
                         f"{world}, got query {tuple(query.shape)}, key {tuple(key.shape)}")
    sent = 0

    def to_heads(x: torch.Tensor) -> torch.Tensor:  # (B, H, T_r, D) -> (B, H/W, T, D)
        nonlocal sent
        b, h, t, d = x.shape
        parts = x.reshape(b, world, h // world, t, d).transpose(0, 1)  # (W, B, H/W, T_r, D): part w to rank w
        sent += parts.numel() // world * (world - 1) * x.element_size()
        got = _all_to_all(parts, group)  # (W, B, H/W, T_r, D): part w is rank w's sequence block
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * t, d)  # (B, H/W, W*T_r, D)

    q, k, v = to_heads(query), to_heads(key), to_heads(value)
    out = flash_attention(q, k, v, is_causal=is_causal, scale=scale)  # (B, H/W, T, Dv)
    b, hw, t, dv = out.shape
    parts = out.reshape(b, hw, world, t // world, dv).permute(2, 0, 1, 3, 4)  # (W, B, H/W, T_r, Dv)
    sent += parts.numel() // world * (world - 1) * out.element_size()
    got = _all_to_all(parts, group)  # (W, B, H/W, T_r, Dv): part w holds head group w
    return got.transpose(0, 1).reshape(b, world * hw, t // world, dv), sent  # (B, H, T_r, Dv)


def ring_bytes_per_rank(batch: int, n_kv_heads: int, seq_len: int, head_dim: int, world_size: int,
                        bytes_per_element: int = 4) -> int:
    """Bytes each rank sends in ring attention with equal blocks: W - 1 steps of one key block and one value
    block of T / W positions each, i.e. ``2 (W-1) B Hkv (T/W) D bytes``."""
    for name, x in (("batch", batch), ("n_kv_heads", n_kv_heads), ("seq_len", seq_len), ("head_dim", head_dim),
                    ("world_size", world_size), ("bytes_per_element", bytes_per_element)):
        _validate.positive_int(name, x)
    if seq_len % world_size:
        raise ValueError(f"seq_len={seq_len} must be divisible by world_size={world_size}")
    return 2 * (world_size - 1) * batch * n_kv_heads * (seq_len // world_size) * head_dim * bytes_per_element


def ulysses_bytes_per_rank(batch: int, n_heads: int, seq_len: int, head_dim: int, world_size: int,
                           bytes_per_element: int = 4) -> int:
    """Bytes each rank sends in Ulysses (H query and key/value heads): q, k, v and the output each cross one
    all-to-all, keeping 1/W of the local block: ``4 (W-1)/W * B H (T/W) D bytes``."""
    for name, x in (("batch", batch), ("n_heads", n_heads), ("seq_len", seq_len), ("head_dim", head_dim),
                    ("world_size", world_size), ("bytes_per_element", bytes_per_element)):
        _validate.positive_int(name, x)
    if seq_len % world_size or n_heads % world_size:
        raise ValueError(f"seq_len={seq_len} and n_heads={n_heads} must be divisible by world_size={world_size}")
    block = batch * n_heads * (seq_len // world_size) * head_dim * bytes_per_element
    return 4 * block * (world_size - 1) // world_size


# ----------------------------------------------------------------------------- launching processes


def _entry(rank: int, fn: Callable, world_size: int, port: int, folder: str, timeout: float, args: tuple) -> None:
    torch.set_num_threads(1)  # W processes share the machine's cores
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
        dist.barrier()  # nobody leaves while a peer may still be receiving from it
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
                    start_method: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in `world_size` local processes joined in a gloo group.

    `fn` must be importable by the children (a module-level function of a package, not one defined in a
    notebook). Returns the list of what each rank returned. The rendezvous store lives in this process on a
    port the OS picks, so parallel launches never collide. `start_method` defaults to "forkserver" where
    available (one server imports torch once and forks the workers) and "spawn" elsewhere. A child that
    raises makes this raise; past `timeout` seconds the children are terminated and TimeoutError is raised.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    _validate.positive_int("world_size", world_size)
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn))
    if module in (None, "__main__", "__mp_main__") or "<" in name:  # a notebook's function, a lambda, a closure
        raise ValueError(f"fn must be importable by the child processes: {name} in {module} is not; define it "
                         f"at the top level of a module")
    methods = multiprocessing.get_all_start_methods()
    start_method = start_method or ("forkserver" if "forkserver" in methods else "spawn")
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", __name__])
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    with tempfile.TemporaryDirectory(prefix="attncourse_ring_") as folder:
        context = torch.multiprocessing.start_processes(
            _entry, args=(fn, world_size, store.port, folder, timeout, args), nprocs=world_size,
            join=False, start_method=start_method)
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} processes running {fn.__qualname__} did not finish "
                                       f"in {timeout} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
                    process.join(5)
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _attention_worker(rank: int, world_size: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      methods: tuple[str, ...], causal: tuple[bool, ...]) -> dict:
    """One rank of :func:`distributed_attention`: its slice of the sequence through every method and mask."""
    blocks = [torch.tensor_split(x, world_size, dim=-2)[rank] for x in (query, key, value)]  # (..., T_r, D)
    results = {}
    for method in methods:
        for is_causal in causal:
            if method == "ring":
                r = ring_attention(*blocks, is_causal=is_causal)
                results[method, is_causal] = (r.out, r.bytes_sent, r.blocks_computed)
            else:
                out, sent = ulysses_attention(*blocks, is_causal=is_causal)
                results[method, is_causal] = (out, sent, 1)
    return results


def distributed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, world_size: int, *,
                          methods: tuple[str, ...] = ("ring",), causal: tuple[bool, ...] = (False, True),
                          timeout: float = 120.0) -> dict:
    """Split q, k, v (B, H, T, D) along T over `world_size` processes and run each method ("ring",
    "ulysses") with each causal flag, all in one launch. Returns ``{(method, is_causal): (out (B, H, T, Dv),
    [bytes sent by each rank], [key/value blocks each rank computed with])}``."""
    _check_qkv(query, key, value)
    _validate.positive_int("world_size", world_size)
    if query.shape[-2] != key.shape[-2] or query.shape[-2] < world_size:
        raise ValueError(f"self-attention over at least world_size={world_size} positions needed, got query "
                         f"{tuple(query.shape)} and key {tuple(key.shape)}")
    bad = set(methods) - {"ring", "ulysses"}
    if bad or not methods:
        raise ValueError(f"methods must be a non-empty tuple of 'ring' and 'ulysses', got {methods!r}")
    ranks = run_distributed(_attention_worker, world_size, query, key, value, tuple(methods), tuple(causal),
                            timeout=timeout)
    return {name: (torch.cat([r[name][0] for r in ranks], dim=-2),  # (B, H, T, Dv)
                   [r[name][1] for r in ranks], [r[name][2] for r in ranks]) for name in ranks[0]}


def _main() -> None:  # pragma: no cover - a demo: python -m attncourse.ring
    from attncourse import ring  # the package's module, not __main__: children import their function from it
    from attncourse.sdpa import scaled_dot_product_attention

    q, k, v = torch.randn(3, 1, 4, 64, 16).unbind(0)  # (B, H, T, D) each
    for world in (2, 4):
        got = ring.distributed_attention(q, k, v, world, methods=("ring", "ulysses"))
        for (method, is_causal), (out, sent, _) in got.items():
            err = (out - scaled_dot_product_attention(q, k, v, is_causal=is_causal)).abs().max().item()
            print(f"W={world} {method:8} causal={is_causal!s:5} max error {err:.1e}  bytes sent per rank {sent}")


if __name__ == "__main__":  # pragma: no cover
    _main()
