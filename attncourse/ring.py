r"""Sequence parallelism on ``torch.distributed``: ring attention (forward and backward) and Ulysses.

**Ring attention** (Liu et al. 2023). The sequence is cut into equal chunks and each of W ranks holds some of
them: its queries, keys and values. In W steps every key/value block travels once around the ring (rank r
sends to r + 1 and receives from r - 1, the next transfer started before the current block's compute). Each
block pair is one call of FlashAttention's forward, returning ``(out, lse)``, and the partial results of a
query chunk are merged by their log-sum-exps (chapter 08's rule in its normalised form). Under a causal mask a
pair whose keys all come after its queries is skipped (the block is still passed on); a diagonal pair uses
the causal tile loop. Bytes sent per rank: W - 1 blocks of keys and values, ``2 (W-1) B Hkv (T/W) D`` elements
(the 2 is K and V; that is (W-1)/W of the whole K and V).

**Backward ring.** The gradient needs, for each block pair, the block's probabilities ``exp(s - lse)`` with the
*final* lse and ``D = rowsum(dO * O)`` of the final output, which every rank holds for its own queries. So the
backward runs the same ring again: the key/value blocks travel and two accumulators dK and dV follow them one
step behind; each rank adds its queries' contribution to the block it holds (FlashAttention's backward per
pair) and to its own dQ. As in ring-flash-attention, the next K, V block is sent before the step's compute and
the block's (dK, dV) after it, so both transfers run beside compute. After W steps each dK, dV block has
visited every rank; the last send brings it home. Bytes are counted at the communication call.
:class:`RingAttentionFunction` ties both passes into autograd, so a training step on W processes gives the
single-process gradients.

**Layouts.** ``"contiguous"``: rank r holds chunk r of W. Under a causal mask rank r then scores r + 1/2 blocks'
worth of pairs and the last rank does about 2W - 1 times the work of the first. ``"zigzag"`` (as in Megatron's
context parallelism and zigzag ring attention): 2W chunks, rank r holds chunks r and 2W - 1 - r (one early, one
late), and every rank scores the same number of pairs. Striped Attention (Brandon et al. 2023) balances differently,
giving token t to rank t mod W; it is not implemented here.

**Ulysses** (Jacobs et al. 2023): one all-to-all turns "my block of the sequence, all heads" into "the
whole sequence, H / W of the heads"; each rank runs ordinary attention on its heads; a second
all-to-all turns the output back. Each rank sends (W-1)/W of its local q, k, v and output blocks: with GQA the
k and v blocks are Hkv/H as large, and W may not exceed Hkv unless KV heads are replicated.

:func:`~attncourse.distributed.run_distributed` (re-exported here) starts W local processes with ``torch.multiprocessing`` joined in a gloo
process group (on 127.0.0.1, a free port chosen by the operating system), runs a function of this
package in each and returns what each rank returned. :func:`distributed_attention` and
:func:`distributed_training_step` are whole round trips: split, launch, gather.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import _validate
from .distributed import run_distributed
from .flash import flash_attention, flash_attention_backward, flash_attention_forward
from .sdpa import _check_qkv
from .sdpa import compute_dtype as _compute_dtype

__all__ = ["RingOutput", "ring_attention", "RingAttentionFunction", "ring_chunks", "ring_pair_work",
           "ulysses_attention", "ring_bytes_per_rank", "ulysses_bytes_per_rank", "run_distributed",
           "distributed_attention", "distributed_training_step", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")
_NEG_INF = float("-inf")


class RingOutput(NamedTuple):
    """What :func:`ring_attention` returns on each rank: the local output (..., T_r, Dv) and its log-sum-exp
    (..., T_r) (both differentiable), the bytes this rank sent in the forward (counted at ``dist.isend``), the
    (query, key) pairs it scored (its share of the work), and `traffic`, a dict the backward keeps filling
    (``bytes_sent_backward``, ``wait_s``, ``wait_s_backward``)."""

    out: torch.Tensor
    lse: torch.Tensor
    bytes_sent: int
    pairs_scored: int
    traffic: dict


def ring_chunks(world_size: int, layout: str = "contiguous") -> list[list[int]]:
    """The sequence chunks each rank holds, in order: W chunks (one each) or 2W (rank r: r and 2W - 1 - r)."""
    _validate.positive_int("world_size", world_size)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "contiguous":
        return [[r] for r in range(world_size)]
    return [[r, 2 * world_size - 1 - r] for r in range(world_size)]


def _pairs(mine: list[int], theirs: list[int], is_causal: bool):
    """(my local chunk index, their local chunk index, causal?) for every pair with at least one visible key."""
    for i, qc in enumerate(mine):
        for j, kc in enumerate(theirs):
            if not is_causal or kc < qc:
                yield i, j, False
            elif kc == qc:
                yield i, j, True


def ring_pair_work(seq_len: int, world_size: int, *, is_causal: bool = True, layout: str = "contiguous") -> list[int]:
    """(query, key) pairs each rank scores in one ring pass (causal diagonal pairs count their lower triangle)."""
    chunks = ring_chunks(world_size, layout)
    n_chunks = sum(len(c) for c in chunks)
    _validate.positive_int("seq_len", seq_len)
    if seq_len % n_chunks:
        raise ValueError(f"seq_len={seq_len} must be divisible by the {n_chunks} chunks of layout {layout!r}")
    c = seq_len // n_chunks
    return [sum(c * (c + 1) // 2 if diag else c * c for src in chunks for _, _, diag in _pairs(mine, src, is_causal))
            for mine in chunks]


def _merge(out_a, lse_a, out_b, lse_b):
    """Two normalised partial results over disjoint keys -> the result over both (zeros, -inf when both empty)."""
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(lse_a - ref)[..., None] * out_a + torch.exp(lse_b - ref)[..., None] * out_b, lse


def _exchange(tensor: torch.Tensor, rank: int, world: int, ranks: list[int], group: Any, stats: dict, key: str):
    """Start sending `tensor` to the next rank and receiving the same shape from the previous one.

    The bytes are counted at the call, from the tensors handed to ``dist.isend`` (``stats[key]`` grows by
    them), not from a formula."""
    incoming = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, ranks[(rank + 1) % world], group),
           dist.P2POp(dist.irecv, incoming, ranks[(rank - 1) % world], group)]
    stats[key] = stats.get(key, 0) + sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                                         if op.op is dist.isend)
    return incoming, dist.batch_isend_irecv(ops)


def _wait(requests, stats: dict, key: str = "wait_s") -> None:
    """Wait for the transfers; the seconds spent blocked here are added to ``stats[key]``."""
    start = time.perf_counter()
    for request in requests:
        request.wait()
    stats[key] = stats.get(key, 0.0) + time.perf_counter() - start


class RingAttentionFunction(torch.autograd.Function):
    """Autograd node of ring attention: the forward ring, and a backward ring where dK and dV travel after their
    blocks. ``apply(q, k, v, is_causal, scale, layout, group, stats, overlap, grad_dtype)`` with q, k, v (N, T_r, D)
    in the compute dtype, a float scale, a dict `stats` that both passes fill (bytes sent, counted at the call; pairs
    scored; seconds blocked waiting for transfers), `overlap`: start each transfer before the compute that
    can run beside it (True), or wait for it at once (False, the serial baseline), and `grad_dtype`: the dtype dK and
    dV are accumulated and sent in (None: the blocks' own; ring-flash-attention uses float32 for bfloat16 blocks,
    so that the gradient sums are not rounded at every hop). Half-precision blocks are sent as they are; each rank's
    output, lse and dQ are summed in float32, as ring-flash-attention does. dK and dV are returned in K's and V's
    dtype."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, layout, group, stats, overlap=True, grad_dtype=None):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        chunks = ring_chunks(world, layout)
        mine, c, d = chunks[rank], q.shape[1] // len(chunks[rank]), k.shape[-1]
        work = _compute_dtype(q.dtype)  # half-precision blocks travel as they are; the sums are kept in float32
        outs = [q.new_zeros(q.shape[0], c, v.shape[-1], dtype=work) for _ in mine]  # per local query chunk (N, c, Dv)
        lses = [q.new_full((q.shape[0], c), _NEG_INF, dtype=work) for _ in mine]  # (N, c)
        kv = torch.cat([k, v], dim=-1).contiguous()  # (N, T_r, D + Dv): one message per step
        pairs = 0
        for step in range(world):
            src = (rank - step) % world  # whose keys I hold now
            if step < world - 1:  # pass them on while computing with them
                incoming, requests = _exchange(kv, rank, world, ranks, group, stats, "bytes_sent")
                if not overlap:
                    _wait(requests, stats)
            k_blk, v_blk = kv[..., :d], kv[..., d:]
            for i, j, diag in _pairs(mine, chunks[src], is_causal):
                qs, ks = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                o, lse = flash_attention_forward(q[:, qs], k_blk[:, ks], v_blk[:, ks], is_causal=diag, scale=scale)
                outs[i], lses[i] = _merge(outs[i], lses[i], o, lse)
                pairs += c * (c + 1) // 2 if diag else c * c
            if step < world - 1:
                if overlap:  # a gloo request must be waited for once only
                    _wait(requests, stats)
                kv = incoming
        out, lse = torch.cat(outs, dim=1).to(q.dtype), torch.cat(lses, dim=1)  # (N, T_r, Dv), (N, T_r) in float32
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (is_causal, scale, layout, group, stats, overlap, grad_dtype)
        ctx.set_materialize_grads(False)
        stats.setdefault("bytes_sent", 0)
        stats["pairs_scored"] = pairs
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        # As ring-flash-attention's backward: K and V for the next step are sent *before* this step's compute
        # (they do not change), and the (dK, dV) accumulated for the block held now are sent *after* it, so that
        # transfer runs beside the next step's compute. The block I hold at step s belongs to rank - s; its
        # gradients reach rank - s + 1, which holds that block at step s + 1 and adds its share on arrival.
        q, k, v, out, lse = ctx.saved_tensors
        is_causal, scale, layout, group, stats, overlap, grad_dtype = ctx.config
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        chunks = ring_chunks(world, layout)
        mine, c, d = chunks[rank], q.shape[1] // len(chunks[rank]), k.shape[-1]
        d_out = torch.zeros_like(out) if d_out is None else d_out.to(out.dtype)
        dq = torch.zeros_like(q, dtype=_compute_dtype(q.dtype))
        kv = torch.cat([k, v], dim=-1).contiguous()  # (N, T_r, D + Dv)
        dkv_in = dkv_requests = None  # the gradients on their way to me, and their transfer
        for step in range(world):
            src = (rank - step) % world
            if step < world - 1:
                kv_in, kv_requests = _exchange(kv, rank, world, ranks, group, stats, "bytes_sent_backward")
                if not overlap:
                    _wait(kv_requests, stats, "wait_s_backward")
            k_blk, v_blk = kv[..., :d], kv[..., d:]
            dkv = torch.zeros_like(kv, dtype=grad_dtype or kv.dtype)  # (N, T_r, D + Dv): my queries' share of dK, dV
            for i, j, diag in _pairs(mine, chunks[src], is_causal):
                qs, ks = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                g = flash_attention_backward(q[:, qs], k_blk[:, ks], v_blk[:, ks], out[:, qs], lse[:, qs], d_out[:, qs],
                                             grad_lse=None if d_lse is None else d_lse[:, qs], is_causal=diag,
                                             scale=scale)  # this pair's dQ share, dK, dV with the final out, lse
                dq[:, qs] += g[0]
                dkv[:, ks, :d] += g[1]
                dkv[:, ks, d:] += g[2]
            if step > 0:  # the earlier ranks' shares of the same block, sent one step ago
                if dkv_requests is not None:
                    _wait(dkv_requests, stats, "wait_s_backward")
                dkv += dkv_in
            dkv_in, dkv_requests = _exchange(dkv, rank, world, ranks, group, stats, "bytes_sent_backward")
            if not overlap:
                _wait(dkv_requests, stats, "wait_s_backward")
                dkv_requests = None
            if step < world - 1:
                if overlap:
                    _wait(kv_requests, stats, "wait_s_backward")
                kv = kv_in
        if dkv_requests is not None:  # the last send brings each block's gradients home
            _wait(dkv_requests, stats, "wait_s_backward")
        return (dq.to(q.dtype), dkv_in[..., :d].to(k.dtype), dkv_in[..., d:].to(v.dtype), None, None, None, None, None,
                None, None)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool = False,
                   scale: float | None = None, layout: str = "contiguous", group: Any = None,
                   overlap: bool = True, grad_dtype: torch.dtype | None = None) -> RingOutput:
    """Attention over the whole sequence when each rank of `group` holds its chunks of it; differentiable.

    Call on every rank with its part: query, key (..., T_r, D), value (..., T_r, Dv), equal T_r on every rank,
    made of the chunks :func:`ring_chunks` gives the rank for `layout`, in that order. ``is_causal`` masks keys
    after each query's own position (in the whole sequence). The backward runs the backward ring.
    ``overlap=False`` waits for every transfer as soon as it starts (the serial baseline of the timing in
    chapter 11); the results are the same. K and V travel in their own dtype (bfloat16 stays 2 bytes an element);
    `grad_dtype` is the dtype dK and dV are summed and sent in on the backward ring (None: K's; ring-flash-attention
    uses float32 for bfloat16 blocks). The returned ``traffic`` dict is filled by both rings: bytes sent in
    the forward (``"bytes_sent"``) and, after ``backward()``, in the backward (``"bytes_sent_backward"``), both
    counted from the tensors handed to ``dist.isend``, and the seconds blocked waiting for transfers
    (``"wait_s"``, ``"wait_s_backward"``).
    Raises ValueError/TypeError for blocks that do not match, a bad layout or flag, RuntimeError without a
    process group.
    """
    _check_qkv(query, key, value)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {type(overlap).__name__}")
    if query.shape[-2] != key.shape[-2] or query.shape[:-2] != key.shape[:-2] or key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"each rank's query, key and value blocks must cover the same positions and heads, got "
                         f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if grad_dtype is not None and not (isinstance(grad_dtype, torch.dtype) and grad_dtype.is_floating_point):
        raise TypeError(f"grad_dtype must be None or a floating torch.dtype, got {grad_dtype!r}")
    if not dist.is_initialized():
        raise RuntimeError("ring_attention needs an initialised process group (see run_distributed)")
    world = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([key.shape[-2]]), group=group)
    per_rank = len(ring_chunks(world, layout)[0])
    if len({int(n) for n in lengths}) != 1 or key.shape[-2] % per_rank:
        raise ValueError(f"every rank must hold the same number of positions, divisible by {per_rank} chunks "
                         f"(layout {layout!r}), got {[int(n) for n in lengths]}")
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    lead = query.shape[:-2]
    q, k, v = (x.reshape(-1, *x.shape[-2:]) for x in (query, key, value))  # (N, T_r, D), sent in their own dtype
    stats: dict = {}
    out, lse = RingAttentionFunction.apply(q, k, v, is_causal, scale, layout, group, stats, overlap, grad_dtype)
    return RingOutput(out.reshape(*lead, *out.shape[-2:]).to(value.dtype), lse.reshape(*lead, lse.shape[-1]),
                      stats["bytes_sent"], stats["pairs_scored"], stats)


def _all_to_all(x: torch.Tensor, group: Any) -> tuple[torch.Tensor, int]:
    """x (W, ...): part w goes to rank w; returns ((W, ...) whose part w came from rank w, the bytes this rank
    sent: those of the tensor handed to the call less its own part, which never leaves the process)."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous like x (empty_like keeps a permuted input's strides)
    dist.all_to_all_single(out, x, group=group)
    mine = x[dist.get_rank(group)]
    return out, x.numel() * x.element_size() - mine.numel() * mine.element_size()


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool = False,
                      scale: float | None = None, group: Any = None) -> tuple[torch.Tensor, int]:
    """DeepSpeed-Ulysses: all-to-all from sequence blocks to head groups, attention, all-to-all back.

    Every rank passes its sequence block (B, H, T_r, D) of queries, keys and values (equal T_r on all
    ranks, H and Hkv divisible by the world size). Returns (its output block (B, H, T_r, Dv), bytes sent), the
    bytes counted from the tensors handed to each ``all_to_all_single`` less the part that stays on this rank.
    Not differentiable (forward only).
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
        got, nbytes = _all_to_all(parts, group)  # (W, B, H/W, T_r, D): part w is rank w's sequence block
        sent += nbytes
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * t, d)  # (B, H/W, W*T_r, D)

    q, k, v = to_heads(query), to_heads(key), to_heads(value)
    out = flash_attention(q, k, v, is_causal=is_causal, scale=scale)  # (B, H/W, T, Dv)
    b, hw, t, dv = out.shape
    parts = out.reshape(b, hw, world, t // world, dv).permute(2, 0, 1, 3, 4)  # (W, B, H/W, T_r, Dv)
    got, nbytes = _all_to_all(parts, group)  # (W, B, H/W, T_r, Dv): part w holds head group w
    sent += nbytes
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
                           bytes_per_element: int = 4, *, n_kv_heads: int | None = None) -> int:
    """Bytes each rank sends in Ulysses: its local q and output blocks (H heads) and k and v blocks (Hkv heads,
    H when None) each cross one all-to-all, which keeps 1/W of every block at home:
    ``(W-1)/W * B (2 H + 2 Hkv) (T/W) D`` elements. Per rank that is about 1/W of q, k, v and output together."""
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    for name, x in (("batch", batch), ("n_heads", n_heads), ("seq_len", seq_len), ("head_dim", head_dim),
                    ("world_size", world_size), ("bytes_per_element", bytes_per_element), ("n_kv_heads", n_kv_heads)):
        _validate.positive_int(name, x)
    if seq_len % world_size or n_heads % world_size or n_kv_heads % world_size:
        raise ValueError(f"seq_len={seq_len}, n_heads={n_heads} and n_kv_heads={n_kv_heads} must be divisible by "
                         f"world_size={world_size}")
    rows = batch * (2 * n_heads + 2 * n_kv_heads) * (seq_len // world_size) * head_dim * bytes_per_element
    return rows * (world_size - 1) // world_size


def _split(x: torch.Tensor, rank: int, world_size: int, layout: str) -> torch.Tensor:
    """The rank's part of x (..., T, D) along T: its chunks for `layout`, in order."""
    chunks = ring_chunks(world_size, layout)
    parts = torch.tensor_split(x, sum(len(c) for c in chunks), dim=-2)
    return torch.cat([parts[c] for c in chunks[rank]], dim=-2)


def _unsplit(parts: list[torch.Tensor], layout: str) -> torch.Tensor:
    """Inverse of :func:`_split`: every rank's part (..., T_r, D) -> the whole (..., T, D) in sequence order."""
    chunks = ring_chunks(len(parts), layout)
    pieces = {c: p for cs, part in zip(chunks, parts) for c, p in zip(cs, part.chunk(len(cs), dim=-2))}
    return torch.cat([pieces[c] for c in sorted(pieces)], dim=-2)


def _attention_worker(rank: int, world_size: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      methods: tuple[str, ...], causal: tuple[bool, ...], layout: str = "contiguous") -> dict:
    """One rank of :func:`distributed_attention`: its part of the sequence through every method and mask."""
    results = {}
    for method in methods:
        for is_causal in causal:
            if method == "ring":
                blocks = [_split(x, rank, world_size, layout) for x in (query, key, value)]  # (..., T_r, D)
                r = ring_attention(*blocks, is_causal=is_causal, layout=layout)
                results[method, is_causal] = (r.out, r.bytes_sent, r.pairs_scored)
            else:
                blocks = [_split(x, rank, world_size, "contiguous") for x in (query, key, value)]
                out, sent = ulysses_attention(*blocks, is_causal=is_causal)
                results[method, is_causal] = (out, sent, None)
    return results


def distributed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, world_size: int, *,
                          methods: tuple[str, ...] = ("ring",), causal: tuple[bool, ...] = (False, True),
                          layout: str = "contiguous", timeout: float = 120.0) -> dict:
    """Split q, k, v (B, H, T, D) along T over `world_size` processes (ring: chunks by `layout`) and run each
    method ("ring", "ulysses") with each causal flag, all in one launch. Returns ``{(method, is_causal): (out
    (B, H, T, Dv), [bytes sent by each rank], [pairs each rank scored (ring) or None])}``."""
    _check_qkv(query, key, value)
    _validate.positive_int("world_size", world_size)
    if query.shape[-2] != key.shape[-2] or query.shape[-2] < world_size:
        raise ValueError(f"self-attention over at least world_size={world_size} positions needed, got query "
                         f"{tuple(query.shape)} and key {tuple(key.shape)}")
    bad = set(methods) - {"ring", "ulysses"}
    if bad or not methods:
        raise ValueError(f"methods must be a non-empty tuple of 'ring' and 'ulysses', got {methods!r}")
    ring_chunks(world_size, layout)  # validates the layout here, before any process starts
    ranks = run_distributed(_attention_worker, world_size, query, key, value, tuple(methods), tuple(causal), layout,
                            timeout=timeout)
    return {name: (_unsplit([r[name][0] for r in ranks], layout if name[0] == "ring" else "contiguous"),
                   [r[name][1] for r in ranks], [r[name][2] for r in ranks]) for name in ranks[0]}
