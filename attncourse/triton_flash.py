r"""FlashAttention in Triton: the fused forward kernel, its launcher (autotuned on a GPU) and the autograd wrapper.

The algorithm is chapter 09's tiled attention, written as GPU programs, with the signature chapter 09's
:func:`attncourse.flash_attention` has: grouped KV heads, ``causal_align`` and ``window``. One program owns a
block of ``BLOCK_Q`` query rows of one (batch, query head) and loops over the keys ``BLOCK_K`` at a time, keeping
a running max ``m``, a running sum ``l`` and an unnormalised output in registers (chapter 08's online softmax),
so the (Tq, Tk) score matrix never reaches memory. It saves the log-sum-exp of every row, which lets the backward
(:mod:`attncourse.triton_flash_bwd`) rebuild the probabilities block by block instead of storing them.

- **Grouped heads**: query head ``h`` reads KV head ``h // (H / Hkv)`` through its pointer offset: K and V are
  never repeated in memory.
- **Causal alignment and windows**: a query row ``i`` sits at position ``p = i + offset`` (``offset = 0``
  top-left, ``Tk - Tq`` bottom-right) and sees keys ``j <= p``, with a window ``W`` only ``p - W < j <= p``.
  The loop runs only over the key tiles that hold a visible key (the others are *skipped* by the loop bounds,
  never loaded); inside it, *full* tiles (every pair allowed) skip the mask and only *partial* tiles pay for it.
- **Rows with no visible key** (bottom-right with Tq > Tk, or a window that falls past the last key) give zeros
  and an lse of ``-inf``, as :func:`attncourse.scaled_dot_product_attention` does.

Plain pointer arithmetic with masks is used throughout (no ``tl.make_block_ptr``, which Triton 3.9 removed), so
the kernels run on Triton 3.x releases old and new, on a GPU or under the interpreter (see
:mod:`attncourse.triton_common` for ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from . import triton_common as common
from .triton_common import LOG2E, TRITON_AVAILABLE, TRITON_VERSION, interpreted, tl, triton
from .triton_flash_bwd import triton_flash_attention_backward

__all__ = ["TRITON_AVAILABLE", "TRITON_VERSION", "attention_flops", "backward_flops", "forward_configs",
           "interpreted", "tile_states", "triton_flash_attention", "triton_flash_attention_backward",
           "triton_flash_attention_forward"]

LN2 = 0.6931471805599453

if TRITON_AVAILABLE:
    from .triton_common import _allowed, _key_range, _needs_mask

    @triton.jit
    def _flash_fwd_kernel(
        Q, K, V, O, LSE, STATS,  # q (N, H, Tq, D); k, v (N, Hkv, Tk, D); out (N, H, Tq, D); lse (N, H, Tq)
        stride_qn, stride_qh, stride_qt, stride_kn, stride_kh, stride_kt, stride_vn, stride_vh, stride_vt,
        H, GROUP, T_Q, T_K, OFFSET, WINDOW, qk_scale,  # qk_scale = scale * log2(e)
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
        IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, WITH_STATS: tl.constexpr,
    ):
        pid_q = tl.program_id(0)  # which block of query rows
        pid_nh = tl.program_id(1)  # which (batch, query head)
        n = pid_nh // H  # batch index
        h = pid_nh % H  # query head
        h_kv = h // GROUP  # the KV head it reads: GROUP consecutive query heads share one, no copy of K and V
        q_start = pid_q * BLOCK_Q
        rows = q_start + tl.arange(0, BLOCK_Q)  # (BLOCK_Q,) query rows of this program
        offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,) key columns within a key block
        offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,) head dims, padded to a power of two
        d_ok = offs_d < HEAD_DIM
        q_ptrs = Q + n * stride_qn + h * stride_qh + rows[:, None] * stride_qt + offs_d[None, :]
        q = tl.load(q_ptrs, mask=(rows[:, None] < T_Q) & d_ok[None, :], other=0.0)  # (BLOCK_Q, BLOCK_D)
        k_base = K + n * stride_kn + h_kv * stride_kh
        v_base = V + n * stride_vn + h_kv * stride_vh

        m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)  # running row max (log2 units)
        l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)  # running sum of exp2(s - m_i)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)  # running sum of exp2(s - m_i) @ V

        lo, hi = _key_range(q_start, T_Q, T_K, OFFSET, WINDOW, BLOCK_Q, BLOCK_K, IS_CAUSAL, HAS_WINDOW)
        for start in range(lo, hi, BLOCK_K):  # tiles outside [lo, hi) are skipped: never loaded
            cols = start + offs_k  # (BLOCK_K,)
            kt_ptrs = k_base + cols[None, :] * stride_kt + offs_d[:, None]  # (BLOCK_D, BLOCK_K): K^T by indexing
            kt = tl.load(kt_ptrs, mask=(cols[None, :] < T_K) & d_ok[:, None], other=0.0)
            s = tl.dot(q, kt) * qk_scale  # (BLOCK_Q, BLOCK_D) @ (BLOCK_D, BLOCK_K) -> (BLOCK_Q, BLOCK_K)
            partial = _needs_mask(q_start, start, T_Q, T_K, OFFSET, WINDOW, BLOCK_Q, BLOCK_K, IS_CAUSAL, HAS_WINDOW)
            if partial:  # only tiles that cut the band (or pass an end) pay for the mask
                keep = _allowed(rows[:, None], cols[None, :], T_Q, T_K, OFFSET, WINDOW, IS_CAUSAL, HAS_WINDOW)
                s = tl.where(keep, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_Q,)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet: keep l = acc = 0
            alpha = tl.exp2(m_i - m_ref)  # (BLOCK_Q,) rescales what was summed under the old max
            p = tl.exp2(s - m_ref[:, None])  # (BLOCK_Q, BLOCK_K)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_ptrs = v_base + cols[:, None] * stride_vt + offs_d[None, :]  # (BLOCK_K, BLOCK_D)
            v = tl.load(v_ptrs, mask=(cols[:, None] < T_K) & d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # (BLOCK_Q, BLOCK_K) @ (BLOCK_K, BLOCK_D)
            m_i = m_new
            if WITH_STATS:  # compiled out unless asked: 1 = masked tile, 2 = full tile (0 = never visited)
                n_kb = tl.cdiv(T_K, BLOCK_K)
                tl.store(STATS + (pid_nh * tl.num_programs(0) + pid_q) * n_kb + start // BLOCK_K,
                         tl.where(partial, 1, 2))

        l_safe = tl.where(l_i > 0, l_i, 1.0)  # a row that saw no key: out = 0, lse = -inf
        out = acc / l_safe[:, None]  # (BLOCK_Q, BLOCK_D)
        o_ptrs = O + (pid_nh * T_Q + rows[:, None]) * HEAD_DIM + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(rows[:, None] < T_Q) & d_ok[None, :])
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # natural log
        tl.store(LSE + pid_nh * T_Q + rows, lse, mask=rows < T_Q)


# ----------------------------------------------------------------------------- autotuning


def forward_configs(search: str | None = None) -> list:
    """The GPU search space of the forward: tile shapes, warps per program and pipeline stages (`search`:
    ``"full"``, the default, or ``"quick"``, two configs; see :func:`attncourse.triton_common.autotune_search`).

    ``BLOCK_Q x BLOCK_K`` sets how much work one program does per step (bigger tiles reuse each loaded byte more
    but need more registers and shared memory); ``num_warps`` is how many groups of 32 threads run one program;
    ``num_stages`` is how many key tiles the compiler keeps in flight (software pipelining: the loads of tile
    j + 1 overlap the math of tile j). The same space as Triton's fused-attention tutorial.
    """
    common.require_triton()
    if common.autotune_search(search) == "quick":
        return [triton.Config({"BLOCK_Q": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
                triton.Config({"BLOCK_Q": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3)]
    return [triton.Config({"BLOCK_Q": bq, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)
            for bq in (64, 128) for bk in (32, 64, 128) for stages in (2, 3, 4) for warps in (4, 8)]


def prune_configs(configs: list, named_args: dict, **kwargs) -> list:
    """Drop tiles far longer than the sequence and the largest tiles for big head dims (shared memory)."""
    t_q, head_dim = named_args["T_Q"], kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM", 64))
    kept = [c for c in configs if c.kwargs["BLOCK_Q"] <= max(64, triton.next_power_of_2(t_q))
            and not (head_dim > 128 and c.kwargs["BLOCK_Q"] * c.kwargs["BLOCK_K"] > 64 * 128)]
    return kept or configs[:1]


_TUNE_KEY = ["T_Q", "T_K", "HEAD_DIM", "IS_CAUSAL", "HAS_WINDOW"]
_FWD_TUNED = (triton.autotune(forward_configs(), key=_TUNE_KEY, prune_configs_by={"early_config_prune": prune_configs})
              (_flash_fwd_kernel) if TRITON_AVAILABLE else None)


def _launch_forward(p: common.Problem, stats: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(p.n, p.heads, p.t_q, p.head_dim, device=p.q.device, dtype=p.q.dtype)  # (N, H, Tq, D)
    lse = torch.empty(p.n, p.heads, p.t_q, device=p.q.device, dtype=torch.float32)  # (N, H, Tq)
    args = (p.q, p.k, p.v, out, lse, stats, *p.q.stride()[:3], *p.k.stride()[:3], *p.v.stride()[:3],
            p.heads, p.group, p.t_q, p.t_k, p.offset, p.window, p.scale * LOG2E)
    meta = dict(HEAD_DIM=p.head_dim, BLOCK_D=common.block_d(p.head_dim), IS_CAUSAL=p.is_causal,
                HAS_WINDOW=p.window > 0, WITH_STATS=stats is not None)
    if common.use_autotune(p.q.device, p.block_q, p.block_k) and stats is None:
        _FWD_TUNED[lambda cfg: (triton.cdiv(p.t_q, cfg["BLOCK_Q"]), p.n * p.heads)](*args, **meta)
    else:
        default_q, default_k = common.default_blocks(p.q.device)
        block_q, block_k = p.block_q or default_q, p.block_k or default_k
        grid = (triton.cdiv(p.t_q, block_q), p.n * p.heads)  # one program per (query block, batch * head)
        _flash_fwd_kernel[grid](*args, BLOCK_Q=block_q, BLOCK_K=block_k, num_warps=4, **meta)
    return out, lse


# ----------------------------------------------------------------------------- public functions


def triton_flash_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    causal_align: str = "top_left",
    window: int | None = None,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel: `query` (..., H, Tq, D), `key` and `value` (..., Hkv, Tk, D), Hkv dividing H.

    Returns ``(out, lse)``: out (..., H, Tq, D) in the input dtype; lse (..., H, Tq) in float32, the natural-log
    log-sum-exp of each scaled, masked score row (``-inf`` for a row that sees no key). ``is_causal`` aligns
    ``"top_left"`` (PyTorch's ``is_causal``) or ``"bottom_right"`` (the queries are the last Tq positions);
    ``window=W`` (needs ``is_causal``) keeps keys ``p - W < j <= p``. Rank-2 inputs (T, D) are one head. Any
    Tq, Tk >= 1. Block sizes are powers of two >= 16; with both None a GPU autotunes them
    (:func:`forward_configs`) and the interpreter uses 32 x 32. No autograd: see :func:`triton_flash_attention`.
    On a GPU, float32 inputs go through ``tl.dot``'s TF32 (errors near 1e-3); the interpreter is exact float32.
    """
    p = common.prepare(query, key, value, is_causal=is_causal, causal_align=causal_align, window=window,
                       scale=scale, block_q=block_q, block_k=block_k)
    out, lse = _launch_forward(p)
    return out.reshape(p.query_shape), lse.reshape(p.query_shape[:-1])


def tile_states(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    causal_align: str = "top_left",
    window: int | None = None,
    block_q: int = 32,
    block_k: int = 32,
) -> torch.Tensor:
    """What the forward kernel did with each tile of the first (batch, head): (cdiv(Tq, block_q), cdiv(Tk, block_k))
    int tensor, 0 = skipped by the loop bounds (never loaded), 1 = loaded and masked, 2 = full (no mask).

    The kernel itself records it (a compile-time ``WITH_STATS`` switch), so this shows what ran, not a model.
    """
    p = common.prepare(query, key, value, is_causal=is_causal, causal_align=causal_align, window=window,
                       scale=None, block_q=block_q, block_k=block_k)
    n_qb, n_kb = triton.cdiv(p.t_q, block_q), triton.cdiv(p.t_k, block_k)
    stats = torch.zeros(p.n * p.heads, n_qb, n_kb, dtype=torch.int32, device=p.q.device)  # (N * H, QB, KB)
    _launch_forward(p, stats)
    return stats[0].cpu()


class _TritonFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, options):
        out, lse = triton_flash_attention_forward(query, key, value, **options)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = triton_flash_attention_backward(grad_out, query, key, value, out, lse, **ctx.options)
        return dq, dk, dv, None


def triton_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    causal_align: str = "top_left",
    window: int | None = None,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Differentiable FlashAttention in Triton: out (..., H, Tq, D), equal to ``scaled_dot_product_attention``
    with the equivalent boolean mask (and K, V repeated over each group of query heads).

    Same arguments as :func:`triton_flash_attention_forward`; gradients come from the two backward kernels
    (:func:`triton_flash_attention_backward`), never from autograd through the tiles. dK and dV have the
    key's shape: each sums over the query heads of its group.
    """
    options = dict(is_causal=is_causal, causal_align=causal_align, window=window, scale=scale, block_q=block_q,
                   block_k=block_k)
    return _TritonFlashAttention.apply(query, key, value, options)


def attention_flops(batch_heads: int, q_len: int, k_len: int, head_dim: int, *, is_causal: bool = False) -> int:
    """Matmul FLOPs of one attention forward: 2 matmuls of 2 * Tq * Tk * D each, per (batch, head).

    With ``is_causal`` only about half the score matrix is computed; by convention (FlashAttention's
    benchmarks, Triton's tutorial) the count is halved.
    """
    flops = 4 * batch_heads * q_len * k_len * head_dim
    return flops // 2 if is_causal else flops


# Matmuls of 2 * Tq * Tk * D FLOPs each, per (batch, head), by pass and backward scheme.
_MATMULS = {
    "forward": ("Q K^T", "P V"),
    "stored P": ("dV = P^T dO", "dP = dO V^T", "dQ = dS K", "dK = dS^T Q"),  # autograd keeps P: no recompute
    "one pass": ("S = Q K^T", "dV = P^T dO", "dP = dO V^T", "dQ = dS K", "dK = dS^T Q"),  # FA2, atomic dQ
    "two kernels": ("S = Q K^T", "dV = P^T dO", "dP = dO V^T", "dK = dS^T Q",  # kernel 1: dK, dV
                    "S = Q K^T", "dP = dO V^T", "dQ = dS K"),  # kernel 2 recomputes S and dP: dQ
}


def backward_flops(q_len: int, k_len: int, head_dim: int, scheme: str = "two kernels") -> dict:
    """``{"matmuls": [...], "flops": int}`` for one (batch, head) of a pass: ``"forward"``, or a backward scheme
    ``"stored P"`` (autograd through plain attention), ``"one pass"`` (FlashAttention-2: recompute S once, dQ
    accumulated with atomics) or ``"two kernels"`` (this module and Triton's tutorial: S and dP recomputed)."""
    if scheme not in _MATMULS:
        raise ValueError(f"scheme must be one of {tuple(_MATMULS)}, got {scheme!r}")
    names = _MATMULS[scheme]
    return {"matmuls": list(names), "flops": 2 * q_len * k_len * head_dim * len(names)}
