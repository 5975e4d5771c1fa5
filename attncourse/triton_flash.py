r"""FlashAttention in Triton: a fused forward kernel, two backward kernels, a launcher and an autograd wrapper.

The algorithm is chapter 09's tiled attention, written as GPU programs. One program owns a block of
``BLOCK_Q`` query rows of one (batch, head) and loops over the keys ``BLOCK_K`` at a time, keeping a running
max ``m``, a running sum ``l`` and an unnormalised output in registers (the online softmax of chapter 08), so
the (T, T) score matrix never reaches memory. It saves the log-sum-exp of every score row, which lets the
backward kernels rebuild the probabilities block by block instead of storing them.

Plain pointer arithmetic with masks is used throughout (no ``tl.make_block_ptr``, which Triton 3.9 removed),
so the same kernels run on Triton 3.x releases old and new, on a GPU or under the interpreter.

**Running on a CPU.** Triton's interpreter runs the kernels in NumPy when ``TRITON_INTERPRET=1`` is in the
environment *before* this module (and so Triton) is imported; tensors then stay on the CPU. It is slow, but it
runs the same code, so tests and the chapter 10 lesson check the kernels without a GPU. This module is not
imported by ``import attncourse`` for that reason: import it explicitly, after setting the variable.

**Without Triton** the module still imports; calling a function raises ``ImportError`` saying what to install.
"""

from __future__ import annotations

import math

import torch

from . import _validate

try:  # Triton is optional (Linux wheels only): everything below checks TRITON_AVAILABLE before use.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

TRITON_AVAILABLE = triton is not None
TRITON_VERSION = triton.__version__ if TRITON_AVAILABLE else None
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634  # log2(e): the kernels use exp2, so scores are scaled by scale * log2(e)
MAX_HEAD_DIM = 256

__all__ = ["TRITON_AVAILABLE", "TRITON_VERSION", "interpreted", "triton_flash_attention",
           "triton_flash_attention_forward", "triton_flash_attention_backward", "attention_flops"]


if TRITON_AVAILABLE:

    @triton.jit
    def _flash_fwd_kernel(
        Q, K, V, O, LSE,  # pointers: q (BH, Tq, D), k and v (BH, Tk, D), out (BH, Tq, D), lse (BH, Tq)
        stride_qh, stride_qt, stride_kh, stride_kt, stride_vh, stride_vt, stride_oh, stride_ot,
        T_Q, T_K, qk_scale,  # qk_scale = scale * log2(e)
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
        IS_CAUSAL: tl.constexpr,
    ):
        pid_q = tl.program_id(0)  # which block of query rows
        pid_bh = tl.program_id(1)  # which (batch, head)
        offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BLOCK_Q,) query rows of this program
        offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,) key columns within a key block
        offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,) head dims, padded to a power of two
        q_ok = offs_q < T_Q  # rows past the end of the sequence (last block) are masked
        d_ok = offs_d < HEAD_DIM

        q_ptrs = Q + pid_bh * stride_qh + offs_q[:, None] * stride_qt + offs_d[None, :]  # (BLOCK_Q, BLOCK_D)
        q = tl.load(q_ptrs, mask=q_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)  # running row max (log2 units)
        l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)  # running sum of exp2(s - m_i)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)  # running sum of exp2(s - m_i) @ V

        # Causal (top-left aligned): row i sees keys 0..i, so this block needs only the keys before its last
        # real row, min((pid_q + 1) * BLOCK_Q, T_Q); key blocks above the diagonal are skipped, not masked.
        hi = T_K
        if IS_CAUSAL:
            hi = tl.minimum(T_K, tl.minimum(T_Q, (pid_q + 1) * BLOCK_Q))
        for start in range(0, hi, BLOCK_K):
            cols = start + offs_k  # (BLOCK_K,)
            k_ok = cols < T_K
            kt_ptrs = K + pid_bh * stride_kh + cols[None, :] * stride_kt + offs_d[:, None]  # (BLOCK_D, BLOCK_K)
            kt = tl.load(kt_ptrs, mask=d_ok[:, None] & k_ok[None, :], other=0.0)
            s = tl.dot(q, kt) * qk_scale  # (BLOCK_Q, BLOCK_D) @ (BLOCK_D, BLOCK_K) -> (BLOCK_Q, BLOCK_K)
            keep = k_ok[None, :]  # (1, BLOCK_K): keys past the end never count
            if IS_CAUSAL:
                keep = keep & (offs_q[:, None] >= cols[None, :])  # (BLOCK_Q, BLOCK_K)
            s = tl.where(keep, s, float("-inf"))

            # Online softmax: key 0 is visible to every row, so m_new is finite from the first block on.
            m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_Q,)
            alpha = tl.exp2(m_i - m_new)  # (BLOCK_Q,) rescales what was summed under the old max
            p = tl.exp2(s - m_new[:, None])  # (BLOCK_Q, BLOCK_K)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_ptrs = V + pid_bh * stride_vh + cols[:, None] * stride_vt + offs_d[None, :]  # (BLOCK_K, BLOCK_D)
            v = tl.load(v_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # (BLOCK_Q, BLOCK_K) @ (BLOCK_K, BLOCK_D)
            m_i = m_new

        out = acc / l_i[:, None]  # (BLOCK_Q, BLOCK_D)
        o_ptrs = O + pid_bh * stride_oh + offs_q[:, None] * stride_ot + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=q_ok[:, None] & d_ok[None, :])
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # back to natural log: ln(sum_j exp(scale * q.k_j))
        tl.store(LSE + pid_bh * T_Q + offs_q, lse, mask=q_ok)

    @triton.jit
    def _flash_bwd_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV,  # q, do (BH, Tq, D); k, v, dk, dv (BH, Tk, D); lse, delta (BH, Tq)
        stride_qh, stride_qt, stride_kh, stride_kt, stride_vh, stride_vt,
        T_Q, T_K, scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
        IS_CAUSAL: tl.constexpr,
    ):
        pid_k = tl.program_id(0)  # which block of keys: this program owns dK and dV of those rows
        pid_bh = tl.program_id(1)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        offs_q = tl.arange(0, BLOCK_Q)  # (BLOCK_Q,)
        offs_d = tl.arange(0, BLOCK_D)
        k_ok = offs_k < T_K
        d_ok = offs_d < HEAD_DIM
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(K + pid_bh * stride_kh + offs_k[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + pid_bh * stride_vh + offs_k[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)

        lo = 0
        if IS_CAUSAL:  # queries above this key block's first key never see it
            lo = (pid_k * BLOCK_K // BLOCK_Q) * BLOCK_Q
        for start in range(lo, T_Q, BLOCK_Q):
            rows = start + offs_q  # (BLOCK_Q,)
            q_ok = rows < T_Q
            q_mask = q_ok[:, None] & d_ok[None, :]
            q = tl.load(Q + pid_bh * stride_qh + rows[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(DO + pid_bh * stride_qh + rows[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
            lse = tl.load(LSE + pid_bh * T_Q + rows, mask=q_ok, other=0.0)  # (BLOCK_Q,)
            delta = tl.load(DELTA + pid_bh * T_Q + rows, mask=q_ok, other=0.0)  # (BLOCK_Q,) rowsum(dO * O)
            # Scores transposed, keys on rows: (BLOCK_K, BLOCK_D) @ (BLOCK_D, BLOCK_Q) -> (BLOCK_K, BLOCK_Q)
            st = tl.dot(k, tl.trans(q)) * scale
            keep = k_ok[:, None] & q_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (rows[None, :] >= offs_k[:, None])
            pt = tl.where(keep, tl.exp2((st - lse[None, :]) * 1.4426950408889634), 0.0)  # P^T, rebuilt from lse
            dv += tl.dot(pt.to(do.dtype), do)  # (BLOCK_K, BLOCK_Q) @ (BLOCK_Q, BLOCK_D)
            dpt = tl.dot(v, tl.trans(do))  # (BLOCK_K, BLOCK_D) @ (BLOCK_D, BLOCK_Q): (dO V^T)^T
            dst = pt * (dpt - delta[None, :])  # (BLOCK_K, BLOCK_Q): dS^T = P^T * (dP^T - delta)
            dk += tl.dot(dst.to(q.dtype), q)  # (BLOCK_K, BLOCK_Q) @ (BLOCK_Q, BLOCK_D)

        dk_ptrs = DK + pid_bh * stride_kh + offs_k[:, None] * stride_kt + offs_d[None, :]
        dv_ptrs = DV + pid_bh * stride_vh + offs_k[:, None] * stride_vt + offs_d[None, :]
        tl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _flash_bwd_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ,
        stride_qh, stride_qt, stride_kh, stride_kt, stride_vh, stride_vt,
        T_Q, T_K, scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
        IS_CAUSAL: tl.constexpr,
    ):
        pid_q = tl.program_id(0)  # which block of queries: this program owns dQ of those rows
        pid_bh = tl.program_id(1)
        offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
        offs_k = tl.arange(0, BLOCK_K)
        offs_d = tl.arange(0, BLOCK_D)
        q_ok = offs_q < T_Q
        d_ok = offs_d < HEAD_DIM
        q_mask = q_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + pid_bh * stride_qh + offs_q[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
        do = tl.load(DO + pid_bh * stride_qh + offs_q[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
        lse = tl.load(LSE + pid_bh * T_Q + offs_q, mask=q_ok, other=0.0)
        delta = tl.load(DELTA + pid_bh * T_Q + offs_q, mask=q_ok, other=0.0)
        dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)

        hi = T_K
        if IS_CAUSAL:  # the same skip as the forward
            hi = tl.minimum(T_K, tl.minimum(T_Q, (pid_q + 1) * BLOCK_Q))
        for start in range(0, hi, BLOCK_K):
            cols = start + offs_k
            k_ok = cols < T_K
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(K + pid_bh * stride_kh + cols[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V + pid_bh * stride_vh + cols[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # (BLOCK_Q, BLOCK_D) @ (BLOCK_D, BLOCK_K) -> (BLOCK_Q, BLOCK_K)
            keep = q_ok[:, None] & k_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (offs_q[:, None] >= cols[None, :])
            p = tl.where(keep, tl.exp2((s - lse[:, None]) * 1.4426950408889634), 0.0)
            dp = tl.dot(do, tl.trans(v))  # (BLOCK_Q, BLOCK_D) @ (BLOCK_D, BLOCK_K) -> (BLOCK_Q, BLOCK_K)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)  # (BLOCK_Q, BLOCK_K) @ (BLOCK_K, BLOCK_D)

        dq_ptrs = DQ + pid_bh * stride_qh + offs_q[:, None] * stride_qt + offs_d[None, :]
        tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


# ----------------------------------------------------------------------------- launchers


def interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    return TRITON_AVAILABLE and type(_flash_fwd_kernel).__name__ == "InterpretedFunction"


def _require_triton() -> None:
    if not TRITON_AVAILABLE:
        raise ImportError(
            "attncourse.triton_flash needs Triton, which is not installed: run "
            "`pip install 'attncourse[triton]'` (or `pip install triton`; Linux wheels only). Without a GPU, "
            "also set TRITON_INTERPRET=1 in the environment before importing this module.")


def _default_blocks(device: torch.device) -> tuple[int, int]:
    # GPU: 64 x 64 tiles fit any head dim up to 256 in shared memory. Interpreter: every program is run one
    # after another in NumPy, so bigger tiles (fewer programs) are faster.
    return (64, 64) if device.type == "cuda" else (32, 32)


def _block(name: str, value: object) -> int:
    value = _validate.positive_int(name, value)
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.arange and tl.dot need it), got {value}")
    return value


def _prepare(query, key, value, scale, block_q, block_k):
    """Validate; return (q, k, v) as contiguous (BH, T, D) views, the lead shape, scale and block sizes."""
    _require_triton()
    for name, x in (("query", query), ("key", key), ("value", value)):
        _validate.tensor(name, x, min_rank=2, floating=True)
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"query, key and value must have the same rank, got {shapes}")
    if not (query.shape[:-2] == key.shape[:-2] == value.shape[:-2]):
        raise ValueError(f"query, key and value must have the same leading (batch, head) dims, got {shapes}")
    if not (query.shape[-1] == key.shape[-1] == value.shape[-1]):
        raise ValueError(f"query, key and value must share the head dim (dim -1), got {shapes}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must have the same length (dim -2), got {shapes}")
    if min(query.shape[-2], key.shape[-2], query.shape[-1]) == 0 or query.numel() == 0:
        raise ValueError(f"query, key and value must not be empty, got {shapes}")
    if query.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head dim must be at most {MAX_HEAD_DIM}, got {shapes}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of {SUPPORTED_DTYPES}, got {query.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key and value must be on one device, got {query.device}, {key.device}, "
                         f"{value.device}")
    if query.device.type == "cpu" and not interpreted():
        raise RuntimeError("the tensors are on the CPU but the Triton kernels were compiled for a GPU: set "
                           "TRITON_INTERPRET=1 in the environment before importing attncourse.triton_flash "
                           "(or Triton) to run them in the interpreter, or move the tensors to a GPU")
    if query.dtype == torch.bfloat16 and interpreted():
        raise TypeError("bfloat16 does not run in Triton's interpreter (NumPy has no bfloat16): use float16 or "
                        "float32 on the CPU, or bfloat16 on a GPU")
    default_q, default_k = _default_blocks(query.device)
    block_q = default_q if block_q is None else _block("block_q", block_q)
    block_k = default_k if block_k is None else _block("block_k", block_k)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    lead = tuple(query.shape[:-2])
    q, k, v = (x.reshape(-1, x.shape[-2], x.shape[-1]).contiguous() for x in (query, key, value))  # (BH, T, D)
    return q, k, v, lead, float(scale), block_q, block_k


def _launch_config(head_dim: int) -> dict:
    # BLOCK_D pads the head dim to a power of two (>= 16 for tl.dot); masks hide the padding.
    return {"HEAD_DIM": head_dim, "BLOCK_D": max(16, triton.next_power_of_2(head_dim)), "num_warps": 4}


def triton_flash_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel: `query` (..., Tq, D), `key` and `value` (..., Tk, D), same leading dims.

    Returns ``(out, lse)``: out (..., Tq, D) in the input dtype, lse (..., Tq) in float32, the natural-log
    log-sum-exp of each scaled, masked score row. ``is_causal`` is top-left aligned, as in PyTorch. Any
    Tq, Tk >= 1 (not only block multiples). Block sizes are powers of two >= 16; None picks a default for the
    device (64 on a GPU, 32 in the interpreter). No autograd: see :func:`triton_flash_attention`.
    On a GPU, float32 inputs go through ``tl.dot``'s default TF32 precision (errors near 1e-3); the
    interpreter multiplies in full float32.
    """
    q, k, v, lead, scale, block_q, block_k = _prepare(query, key, value, scale, block_q, block_k)
    bh, t_q, d = q.shape
    t_k = k.shape[1]
    out = torch.empty_like(q)  # (BH, Tq, D)
    lse = torch.empty(bh, t_q, device=q.device, dtype=torch.float32)  # (BH, Tq)
    grid = (triton.cdiv(t_q, block_q), bh)  # one program per (query block, batch * head)
    _flash_fwd_kernel[grid](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        t_q, t_k, scale * LOG2E,
        BLOCK_Q=block_q, BLOCK_K=block_k, IS_CAUSAL=bool(is_causal), **_launch_config(d),
    )
    return out.reshape(*lead, t_q, d), lse.reshape(*lead, t_q)


def triton_flash_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dQ, dK, dV) from the forward's `out` and `lse`, by the two backward kernels.

    Probabilities are rebuilt block by block as ``exp(scale * q.k - lse)``; ``delta = rowsum(dO * O)``
    (computed here in PyTorch, O(T D)) turns the softmax's Jacobian into ``dS = P * (dP - delta)``.
    One kernel loops over query blocks for each key block (dK, dV), the other over key blocks for each
    query block (dQ), so no two programs ever write the same rows.
    """
    q, k, v, lead, scale, block_q, block_k = _prepare(query, key, value, scale, block_q, block_k)
    bh, t_q, d = q.shape
    t_k = k.shape[1]
    if grad_out.shape != query.shape or out.shape != query.shape or lse.shape != query.shape[:-1]:
        raise ValueError(f"grad_out and out must have the query's shape {tuple(query.shape)} and lse "
                         f"{tuple(query.shape[:-1])}, got grad_out {tuple(grad_out.shape)}, out {tuple(out.shape)}, "
                         f"lse {tuple(lse.shape)}")
    do = grad_out.reshape(bh, t_q, d).to(q.dtype).contiguous()  # (BH, Tq, D)
    delta = (do.float() * out.reshape(bh, t_q, d).float()).sum(-1)  # (BH, Tq, D) -> (BH, Tq)
    lse = lse.reshape(bh, t_q).float().contiguous()  # (BH, Tq)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    meta = dict(BLOCK_Q=block_q, BLOCK_K=block_k, IS_CAUSAL=bool(is_causal), **_launch_config(d))
    _flash_bwd_dkdv_kernel[(triton.cdiv(t_k, block_k), bh)](
        q, k, v, do, lse, delta, dk, dv, *strides, t_q, t_k, scale, **meta)
    _flash_bwd_dq_kernel[(triton.cdiv(t_q, block_q), bh)](
        q, k, v, do, lse, delta, dq, *strides, t_q, t_k, scale, **meta)
    return dq.reshape(query.shape), dk.reshape(key.shape), dv.reshape(value.shape)


class _TritonFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, is_causal, scale, block_q, block_k):
        out, lse = triton_flash_attention_forward(query, key, value, is_causal=is_causal, scale=scale,
                                                  block_q=block_q, block_k=block_k)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.options = dict(is_causal=is_causal, scale=scale, block_q=block_q, block_k=block_k)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = triton_flash_attention_backward(grad_out, query, key, value, out, lse, **ctx.options)
        return dq, dk, dv, None, None, None, None


def triton_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Differentiable FlashAttention in Triton: out (..., Tq, D), equal to ``scaled_dot_product_attention``.

    Same arguments as :func:`triton_flash_attention_forward`; gradients come from the Triton backward kernels
    (:func:`triton_flash_attention_backward`), never from autograd through the tiles.
    """
    return _TritonFlashAttention.apply(query, key, value, is_causal, scale, block_q, block_k)


def attention_flops(batch_heads: int, q_len: int, k_len: int, head_dim: int, *, is_causal: bool = False) -> int:
    """Matmul FLOPs of one attention forward: 2 matmuls of 2 * Tq * Tk * D each, per (batch, head).

    With ``is_causal`` only about half the score matrix is computed; by convention (FlashAttention's
    benchmarks, Triton's tutorial) the count is halved.
    """
    flops = 4 * batch_heads * q_len * k_len * head_dim
    return flops // 2 if is_causal else flops

