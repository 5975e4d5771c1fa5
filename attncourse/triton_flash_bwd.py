r"""The backward of :mod:`attncourse.triton_flash`: two kernels, dK/dV then dQ, that rebuild the probabilities.

Nothing of size (Tq, Tk) was saved: each kernel recomputes the score tile :math:`S = QK^\top` and rebuilds
:math:`P = e^{S - \mathrm{lse}}` from the forward's log-sum-exp, with :math:`\delta = \mathrm{rowsum}(dO \circ O)`
(computed here in PyTorch, O(Tq D)) turning the softmax's Jacobian into :math:`dS = P \circ (dP - \delta)`.

- **dK/dV kernel**: one program per (key block, batch, KV head) loops over every query head of its group and
  over the query blocks that see its keys: :math:`dV \mathrel{+}= P^\top dO`, :math:`dP = dO V^\top`,
  :math:`dK \mathrel{+}= dS^\top Q`. Grouped heads sum into one dK, dV here, in registers.
- **dQ kernel**: one program per (query block, batch, query head) loops over the key blocks it sees, recomputing
  :math:`S` and :math:`dP` again: :math:`dQ \mathrel{+}= dS\,K`.

Each program owns the rows it writes, so no atomics are needed and the result is the same bit for bit on every
run. The price is recomputation: 7 matmuls of :math:`2 T_q T_k D` FLOPs instead of FlashAttention-2's 5, which
does one pass per key block and adds each dQ contribution to memory with atomic adds (see
:func:`attncourse.triton_flash.backward_flops`). Triton's fused-attention tutorial makes the same choice (its
two loops run in one launch).
"""

from __future__ import annotations

import torch

from . import triton_common as common
from .triton_common import TRITON_AVAILABLE, tl, triton

__all__ = ["backward_configs", "triton_flash_attention_backward"]

if TRITON_AVAILABLE:
    from .triton_common import _allowed, _key_range, _needs_mask, _query_range

    @triton.jit
    def _flash_bwd_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV,  # q, do (N, H, Tq, D); k, v, dk, dv (N, Hkv, Tk, D); lse, delta (N, H, Tq)
        stride_kn, stride_kh, stride_kt, stride_vn, stride_vh, stride_vt,
        H, GROUP, T_Q, T_K, OFFSET, WINDOW, scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
        IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    ):
        pid_k = tl.program_id(0)  # which block of keys: this program owns dK and dV of those rows
        pid_nk = tl.program_id(1)  # which (batch, KV head)
        n = pid_nk // (H // GROUP)
        h_kv = pid_nk % (H // GROUP)
        k_start = pid_k * BLOCK_K
        cols = k_start + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        offs_q = tl.arange(0, BLOCK_Q)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        kv_mask = (cols[:, None] < T_K) & d_ok[None, :]
        k = tl.load(K + n * stride_kn + h_kv * stride_kh + cols[:, None] * stride_kt + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # (BLOCK_K, BLOCK_D)
        v = tl.load(V + n * stride_vn + h_kv * stride_vh + cols[:, None] * stride_vt + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
        qk_scale = scale * 1.4426950408889634  # exp2 units

        lo, hi = _query_range(k_start, T_Q, T_K, OFFSET, WINDOW, BLOCK_Q, BLOCK_K, IS_CAUSAL, HAS_WINDOW)
        for g in range(0, GROUP):  # every query head that reads this KV head adds to its dK and dV
            nh = n * H + h_kv * GROUP + g  # row of q, do, lse, delta
            for start in range(lo, hi, BLOCK_Q):
                rows = start + offs_q  # (BLOCK_Q,)
                q_mask = (rows[:, None] < T_Q) & d_ok[None, :]
                q = tl.load(Q + (nh * T_Q + rows[:, None]) * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
                do = tl.load(DO + (nh * T_Q + rows[:, None]) * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
                lse = tl.load(LSE + nh * T_Q + rows, mask=rows < T_Q, other=0.0) * 1.4426950408889634
                lse = tl.where(lse == float("-inf"), float("inf"), lse)  # a row that saw no key: P = 0
                delta = tl.load(DELTA + nh * T_Q + rows, mask=rows < T_Q, other=0.0)  # (BLOCK_Q,) rowsum(dO * O)
                st = tl.dot(k, tl.trans(q)) * qk_scale  # (BLOCK_K, BLOCK_D) @ (BLOCK_D, BLOCK_Q): S^T
                if _needs_mask(start, k_start, T_Q, T_K, OFFSET, WINDOW, BLOCK_Q, BLOCK_K, IS_CAUSAL, HAS_WINDOW):
                    keep = _allowed(rows[None, :], cols[:, None], T_Q, T_K, OFFSET, WINDOW, IS_CAUSAL, HAS_WINDOW)
                    st = tl.where(keep, st, float("-inf"))
                pt = tl.exp2(st - lse[None, :])  # (BLOCK_K, BLOCK_Q): P^T, rebuilt from lse
                dv += tl.dot(pt.to(do.dtype), do)  # (BLOCK_K, BLOCK_Q) @ (BLOCK_Q, BLOCK_D)
                dpt = tl.dot(v, tl.trans(do))  # (BLOCK_K, BLOCK_D) @ (BLOCK_D, BLOCK_Q): (dO V^T)^T
                dst = pt * (dpt - delta[None, :])  # (BLOCK_K, BLOCK_Q): dS^T = P^T * (dP^T - delta)
                dk += tl.dot(dst.to(q.dtype), q)  # (BLOCK_K, BLOCK_Q) @ (BLOCK_Q, BLOCK_D)

        out_ptrs = (pid_nk * T_K + cols[:, None]) * HEAD_DIM + offs_d[None, :]  # dk, dv are contiguous
        tl.store(DK + out_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + out_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _flash_bwd_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ,
        stride_kn, stride_kh, stride_kt, stride_vn, stride_vh, stride_vt,
        H, GROUP, T_Q, T_K, OFFSET, WINDOW, scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
        IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    ):
        pid_q = tl.program_id(0)  # which block of queries: this program owns dQ of those rows
        pid_nh = tl.program_id(1)  # which (batch, query head)
        n = pid_nh // H
        h_kv = (pid_nh % H) // GROUP
        q_start = pid_q * BLOCK_Q
        rows = q_start + tl.arange(0, BLOCK_Q)
        offs_k = tl.arange(0, BLOCK_K)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q_mask = (rows[:, None] < T_Q) & d_ok[None, :]
        q = tl.load(Q + (pid_nh * T_Q + rows[:, None]) * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
        do = tl.load(DO + (pid_nh * T_Q + rows[:, None]) * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
        lse = tl.load(LSE + pid_nh * T_Q + rows, mask=rows < T_Q, other=0.0) * 1.4426950408889634
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        delta = tl.load(DELTA + pid_nh * T_Q + rows, mask=rows < T_Q, other=0.0)
        dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
        qk_scale = scale * 1.4426950408889634

        lo, hi = _key_range(q_start, T_Q, T_K, OFFSET, WINDOW, BLOCK_Q, BLOCK_K, IS_CAUSAL, HAS_WINDOW)
        for start in range(lo, hi, BLOCK_K):  # the forward's loop, the same tiles skipped
            cols = start + offs_k
            kv_mask = (cols[:, None] < T_K) & d_ok[None, :]
            k = tl.load(K + n * stride_kn + h_kv * stride_kh + cols[:, None] * stride_kt + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(V + n * stride_vn + h_kv * stride_vh + cols[:, None] * stride_vt + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_Q, BLOCK_D) @ (BLOCK_D, BLOCK_K) -> (BLOCK_Q, BLOCK_K)
            if _needs_mask(q_start, start, T_Q, T_K, OFFSET, WINDOW, BLOCK_Q, BLOCK_K, IS_CAUSAL, HAS_WINDOW):
                keep = _allowed(rows[:, None], cols[None, :], T_Q, T_K, OFFSET, WINDOW, IS_CAUSAL, HAS_WINDOW)
                s = tl.where(keep, s, float("-inf"))
            p = tl.exp2(s - lse[:, None])
            dp = tl.dot(do, tl.trans(v))  # (BLOCK_Q, BLOCK_D) @ (BLOCK_D, BLOCK_K) -> (BLOCK_Q, BLOCK_K)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)  # (BLOCK_Q, BLOCK_K) @ (BLOCK_K, BLOCK_D)

        tl.store(DQ + (pid_nh * T_Q + rows[:, None]) * HEAD_DIM + offs_d[None, :],
                 (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


def backward_configs(search: str | None = None) -> list:
    """The GPU search space of both backward kernels (see :func:`attncourse.triton_flash.forward_configs`)."""
    common.require_triton()
    if common.autotune_search(search) == "quick":
        return [triton.Config({"BLOCK_Q": 64, "BLOCK_K": 64}, num_warps=4, num_stages=2)]
    return [triton.Config({"BLOCK_Q": bq, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)
            for bq, bk in ((32, 64), (64, 64), (64, 128), (128, 64)) for stages in (2, 3) for warps in (4, 8)]


_KEY = ["T_Q", "T_K", "HEAD_DIM", "IS_CAUSAL", "HAS_WINDOW"]
_DKDV_TUNED = triton.autotune(backward_configs(), key=_KEY)(_flash_bwd_dkdv_kernel) if TRITON_AVAILABLE else None
_DQ_TUNED = triton.autotune(backward_configs(), key=_KEY)(_flash_bwd_dq_kernel) if TRITON_AVAILABLE else None


def triton_flash_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    is_causal: bool = False,
    causal_align: str = "top_left",
    window: int | None = None,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dQ, dK, dV) from the forward's `out` and `lse`, by the dK/dV kernel and then the dQ kernel.

    Same keyword arguments as :func:`attncourse.triton_flash.triton_flash_attention_forward`; dK and dV have the
    key's shape (grouped heads summed). Deterministic: no atomics, so two runs give identical bits.
    """
    p = common.prepare(query, key, value, is_causal=is_causal, causal_align=causal_align, window=window,
                       scale=scale, block_q=block_q, block_k=block_k)
    if grad_out.shape != query.shape or out.shape != query.shape or lse.shape != query.shape[:-1]:
        raise ValueError(f"grad_out and out must have the query's shape {tuple(query.shape)} and lse "
                         f"{tuple(query.shape[:-1])}, got grad_out {tuple(grad_out.shape)}, out {tuple(out.shape)}, "
                         f"lse {tuple(lse.shape)}")
    shape_q = (p.n, p.heads, p.t_q, p.head_dim)
    q = p.q.contiguous()  # (N, H, Tq, D): q and dO share one layout
    do = grad_out.reshape(shape_q).to(p.q.dtype).contiguous()  # (N, H, Tq, D)
    delta = (do.float() * out.reshape(shape_q).float()).sum(-1)  # (N, H, Tq, D) -> (N, H, Tq)
    lse = lse.reshape(shape_q[:-1]).float().contiguous()  # (N, H, Tq)
    dq = torch.empty_like(q)
    dk = torch.empty(p.n, p.kv_heads, p.t_k, p.head_dim, device=q.device, dtype=q.dtype)  # (N, Hkv, Tk, D)
    dv = torch.empty_like(dk)
    strides = (*p.k.stride()[:3], *p.v.stride()[:3])
    sizes = (p.heads, p.group, p.t_q, p.t_k, p.offset, p.window, p.scale)
    meta = dict(HEAD_DIM=p.head_dim, BLOCK_D=common.block_d(p.head_dim), IS_CAUSAL=p.is_causal,
                HAS_WINDOW=p.window > 0)
    kv_programs, q_programs = p.n * p.kv_heads, p.n * p.heads
    if common.use_autotune(q.device, p.block_q, p.block_k):
        _DKDV_TUNED[lambda c: (triton.cdiv(p.t_k, c["BLOCK_K"]), kv_programs)](
            q, p.k, p.v, do, lse, delta, dk, dv, *strides, *sizes, **meta)
        _DQ_TUNED[lambda c: (triton.cdiv(p.t_q, c["BLOCK_Q"]), q_programs)](
            q, p.k, p.v, do, lse, delta, dq, *strides, *sizes, **meta)
    else:
        default_q, default_k = common.default_blocks(q.device)
        blocks = dict(BLOCK_Q=p.block_q or default_q, BLOCK_K=p.block_k or default_k)
        _flash_bwd_dkdv_kernel[(triton.cdiv(p.t_k, blocks["BLOCK_K"]), kv_programs)](
            q, p.k, p.v, do, lse, delta, dk, dv, *strides, *sizes, **blocks, **meta, num_warps=4)
        _flash_bwd_dq_kernel[(triton.cdiv(p.t_q, blocks["BLOCK_Q"]), q_programs)](
            q, p.k, p.v, do, lse, delta, dq, *strides, *sizes, **blocks, **meta, num_warps=4)
    return dq.reshape(query.shape), dk.reshape(key.shape), dv.reshape(value.shape)
