"""Chapter 11's ring-bytes prediction: the checker's expected values are *measured*, not written as a formula.

``ring_bytes_measured`` runs the package's own :class:`attncourse.ring.RingAttentionFunction`, forward then
backward, as one rank of a ring of `world_size`, and reads the bytes its ``_exchange`` counted at each
``dist.isend`` call, exactly as a real gloo run counts them (``tests/test_ring.py`` compares the two). Only what
does not decide what is sent is replaced, for the length of the call: the process group (a stand-in that starts
no transfer), the per-pair attention kernels (they return zeros of the right shapes), the merge and ``torch.cat``
(a shape-only one); the tensors live on the meta device, so a 131,072-token layer costs no memory and no time. A
learner cannot call this (the exercise refuses the checker's functions and the ring), and transcribing it needs
the ring itself: the count has to come from reading ``RingAttentionFunction`` and counting its sends.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from attncourse import ring as _ring

_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


class _Ctx:
    """What autograd hands a Function's forward and backward: saved tensors, settings, nothing else."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def set_materialize_grads(self, value):
        self.materialize_grads = value


def _group(world_size: int, rank: int) -> SimpleNamespace:
    """A stand-in for torch.distributed: the ring's calls are answered, no transfer is started."""

    def p2p(op, tensor, peer, group=None):
        return SimpleNamespace(op=op, tensor=tensor, peer=peer)

    return SimpleNamespace(get_world_size=lambda group=None: world_size, get_rank=lambda group=None: rank,
                           get_process_group_ranks=lambda group: list(range(world_size)),
                           isend=object(), irecv=object(), P2POp=p2p, batch_isend_irecv=lambda ops: [])


class _Torch:
    """torch as the ring module sees it, with a cat that only works out the shape: PyTorch's own cat on the meta
    device loads its reference implementations on first use (seconds), and only the shape matters here."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def cat(tensors, dim=0):
        shape = list(tensors[0].shape)
        shape[dim] = sum(t.shape[dim] for t in tensors)
        return torch.empty(shape, dtype=tensors[0].dtype, device=tensors[0].device)


@contextlib.contextmanager
def _stand_ins(world_size: int, rank: int):
    saved = {name: getattr(_ring, name) for name in ("dist", "flash_attention_forward", "flash_attention_backward",
                                                     "_merge", "torch")}
    fake = _group(world_size, rank)
    fake.isend, fake.irecv = saved["dist"].isend, saved["dist"].irecv  # _exchange tells sends by identity

    def forward(q, k, v, is_causal, scale):
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), q.new_zeros(q.shape[:-1])  # (N, c, Dv), (N, c)

    def backward(q, k, v, out, lse, d_out, grad_lse=None, is_causal=False, scale=None):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    try:
        _ring.dist, _ring.flash_attention_forward, _ring.flash_attention_backward = fake, forward, backward
        _ring._merge = lambda out_a, lse_a, out_b, lse_b: (out_a, lse_a)
        _ring.torch = _Torch()
        yield
    finally:
        for name, value in saved.items():
            setattr(_ring, name, value)


def ring_bytes_measured(batch, n_kv_heads, seq_len, head_dim, world_size, bytes_per_element,
                        grad_bytes: int | None = None, rank: int = 0) -> tuple[int, int]:
    """(forward bytes, backward bytes) that `rank` hands to ``dist.isend`` in one training step of ring attention
    (contiguous layout, causal; K and V of `bytes_per_element` bytes, dK and dV accumulated and sent in `grad_bytes`
    bytes, the same when None: 2 bfloat16, 4 float32, 8 float64)."""
    n, t_r = batch * n_kv_heads, seq_len // world_size
    q, k, v = (torch.empty(n, t_r, head_dim, dtype=_DTYPES[bytes_per_element], device="meta") for _ in range(3))
    grad_dtype = None if grad_bytes is None else _DTYPES[grad_bytes]
    stats: dict = {}
    ctx = _Ctx()
    with _stand_ins(world_size, rank):
        out, lse = _ring.RingAttentionFunction.forward(ctx, q, k, v, True, head_dim ** -0.5, "contiguous", None,
                                                       stats, True, grad_dtype)
        _ring.RingAttentionFunction.backward(ctx, torch.zeros_like(out), None)
    return stats["bytes_sent"], stats["bytes_sent_backward"]
