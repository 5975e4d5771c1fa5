r"""Split-KV decoding (flash-decoding) in Triton: one query token per head against a long KV cache.

With one query row per head, the forward kernel's grid has only one program per (batch, head): a decode step
at batch 1 with 32 heads runs 32 programs on a GPU with 132 SMs (an H100 SXM5), and each program streams the
whole cache alone. Split-KV decoding cuts the keys into ``num_splits`` chunks processed by separate programs,
each producing a *partial* result, then merges the partials:

- **Partial kernel**: one program per (split, batch, KV head). It serves the whole group of query heads that
  share the KV head at once (the group's queries are the rows of its tile, what FlashAttention-3's code calls
  "pack GQA"), so each K and V byte is read once per step, not once per query head. The tile has at least 16
  rows for ``tl.dot``, so small groups leave rows empty: a decode step is memory-bound, and that math is free. It stores, per query head and split,
  the normalised output ``o_s`` and the log-sum-exp ``lse_s`` of its chunk (``0`` and ``-inf`` for an empty
  chunk), in float32.
- **Merge kernel**: one program per (batch, query head) combines the splits as chapter 08 merges softmax
  states: ``lse = log sum_s exp(lse_s)`` and ``o = sum_s exp(lse_s - lse) o_s``. In chapter 08's terms a
  partial is the state ``(m, l, acc) = (lse_s, 1, o_s)``, so the merge equals
  :func:`attncourse.merge_attention_states` folded over the splits.

:func:`default_num_splits` picks the number of splits as FlashAttention's ``num_splits_heuristic`` does: no
split when the unsplit grid almost fills the GPU, else the fewest splits that fill its SMs in nearly whole waves.
"""

from __future__ import annotations

import math

import torch

from . import _validate
from . import triton_common as common
from .triton_common import LOG2E, TRITON_AVAILABLE, tl, triton

__all__ = ["decode_configs", "decode_work", "default_num_splits", "merge_split_kv", "split_kv_partials",
           "triton_flash_decode"]

H100_SMS = 132  # streaming multiprocessors of an H100 SXM5 (NVIDIA H100 whitepaper)

if TRITON_AVAILABLE:

    @triton.jit
    def _decode_partial_kernel(
        Q, K, V, O_PART, LSE_PART,  # q (N, H, 1, D); k, v (N, Hkv, Tk, D); o_part (N, H, S, D), lse_part (N, H, S)
        stride_qn, stride_qh, stride_kn, stride_kh, stride_kt, stride_vn, stride_vh, stride_vt,
        H_KV, GROUP, T_K, NUM_SPLITS, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        split = tl.program_id(0)  # which chunk of the keys
        pid_nk = tl.program_id(1)  # which (batch, KV head)
        n = pid_nk // H_KV
        h_kv = pid_nk % H_KV
        g = tl.arange(0, BLOCK_G)  # (BLOCK_G,) the group's query heads, one per tile row (padded to >= 16)
        heads = h_kv * GROUP + g  # query heads h_kv * GROUP .. h_kv * GROUP + GROUP - 1 read this KV head
        offs_k = tl.arange(0, BLOCK_K)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q_mask = (g[:, None] < GROUP) & d_ok[None, :]
        q = tl.load(Q + n * stride_qn + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)

        chunk = tl.cdiv(tl.cdiv(T_K, NUM_SPLITS), BLOCK_K) * BLOCK_K  # keys per split, whole key tiles
        lo = split * chunk
        hi = tl.minimum(lo + chunk, T_K)  # hi <= lo: an empty split (more splits than key tiles)
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        k_base = K + n * stride_kn + h_kv * stride_kh
        v_base = V + n * stride_vn + h_kv * stride_vh
        for start in range(lo, hi, BLOCK_K):
            cols = start + offs_k  # (BLOCK_K,)
            k_ok = cols < hi
            kt = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None], mask=k_ok[None, :] & d_ok[:, None],
                         other=0.0)  # (BLOCK_D, BLOCK_K)
            s = tl.dot(q, kt) * qk_scale  # (BLOCK_G, BLOCK_D) @ (BLOCK_D, BLOCK_K) -> (BLOCK_G, BLOCK_K)
            if start + BLOCK_K > hi:  # only the split's last tile can run past its end
                s = tl.where(k_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds at least one key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :],
                        other=0.0)  # (BLOCK_K, BLOCK_D)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        l_safe = tl.where(l_i > 0, l_i, 1.0)
        rows = (n * H_KV * GROUP + heads) * NUM_SPLITS + split  # (BLOCK_G,) row of (N * H * S)
        tl.store(O_PART + rows[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None], mask=q_mask)
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(LSE_PART + rows, lse, mask=g < GROUP)

    @triton.jit
    def _decode_merge_kernel(
        O_PART, LSE_PART, O, LSE,  # o_part (N * H, S, D), lse_part (N * H, S) float32; o (N * H, D), lse (N * H,)
        NUM_SPLITS,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        row = tl.program_id(0)  # which (batch, query head)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < NUM_SPLITS
        lse_s = tl.load(LSE_PART + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))  # (BLOCK_S,)
        m = tl.max(lse_s, 0)  # finite: split 0 always holds keys
        w = tl.exp(lse_s - m)  # (BLOCK_S,) each split's share, 0 for empty splits
        parts = tl.load(O_PART + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                        mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)  # (BLOCK_S, BLOCK_D)
        total = tl.sum(w, 0)
        out = tl.sum(w[:, None] * parts, 0) / total  # (BLOCK_D,)
        tl.store(O + row * HEAD_DIM + offs_d, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)
        tl.store(LSE + row, m + tl.log(total))


def decode_configs(search: str | None = None) -> list:
    """GPU search space of the partial kernel: key tile, warps, pipeline stages (the query tile is the group;
    `search` as in :func:`attncourse.triton_flash.forward_configs`)."""
    common.require_triton()
    if common.autotune_search(search) == "quick":
        return [triton.Config({"BLOCK_K": 64}, num_warps=4, num_stages=3)]
    return [triton.Config({"BLOCK_K": bk}, num_warps=warps, num_stages=stages)
            for bk in (32, 64, 128) for stages in (2, 3, 4) for warps in (2, 4)]


_PARTIAL_TUNED = (triton.autotune(decode_configs(), key=["T_K", "NUM_SPLITS", "HEAD_DIM", "GROUP"])(
    _decode_partial_kernel) if TRITON_AVAILABLE else None)


def default_num_splits(batch_kv_heads: int, k_len: int, *, sm_count: int = H100_SMS, block_k: int = 64,
                       max_splits: int = 128) -> int:
    """Number of key splits for a decode step with `batch_kv_heads` programs before splitting.

    FlashAttention's ``num_splits_heuristic``: 1 when the programs already fill 80% of the SMs; otherwise, among
    split counts up to min(max_splits, SMs, key tiles) that change the tiles per split, the fewest whose wave
    efficiency (waves / ceil(waves)) reaches 85% of the best.
    """
    for name, v in (("batch_kv_heads", batch_kv_heads), ("k_len", k_len), ("sm_count", sm_count),
                    ("block_k", block_k), ("max_splits", max_splits)):
        _validate.positive_int(name, v)
    if batch_kv_heads >= 0.8 * sm_count:
        return 1
    n_blocks = math.ceil(k_len / block_k)
    limit = min(max_splits, sm_count, n_blocks)
    eligible = [s for s in range(1, limit + 1)
                if s == 1 or math.ceil(n_blocks / s) != math.ceil(n_blocks / (s - 1))]
    waves = {s: batch_kv_heads * s / sm_count for s in eligible}  # programs / SMs: 1.5 waves leaves half idle
    efficiency = {s: w / math.ceil(w) for s, w in waves.items()}
    best = max(efficiency.values())
    return min(s for s, e in efficiency.items() if e >= 0.85 * best)


def decode_work(batch: int, heads: int, kv_heads: int, k_len: int, head_dim: int, *, num_splits: int = 1,
                pack_gqa: bool = True, bytes_per_element: int = 2) -> dict:
    """Programs launched, keys each streams (ceil(Tk / num_splits), before the kernel rounds chunks up to whole
    key tiles), and K and V bytes read by one decode step.

    ``pack_gqa=True`` is this module's grid (one program per KV head serves its group); ``False`` is the plain
    grid with one program per query head, which reads each KV head once per query head of its group.
    """
    for name, v in (("batch", batch), ("heads", heads), ("kv_heads", kv_heads), ("k_len", k_len),
                    ("head_dim", head_dim), ("num_splits", num_splits), ("bytes_per_element", bytes_per_element)):
        _validate.positive_int(name, v)
    if heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide heads={heads}")
    readers = batch * (kv_heads if pack_gqa else heads)  # programs per split, each reading one KV head
    return {"programs": readers * num_splits, "keys_per_program": math.ceil(k_len / num_splits),
            "kv_bytes": 2 * readers * k_len * head_dim * bytes_per_element}


def _check_decode(query, key, value, num_splits, scale, block_k):
    common.check_inputs(query, key, value)
    if query.dim() != 4 or query.shape[-2] != 1:
        raise ValueError(f"query must be (B, H, 1, D), one token per head, got query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}, value {tuple(value.shape)}")
    if num_splits is not None:
        _validate.positive_int("num_splits", num_splits)
    if block_k is not None:
        common.check_block("block_k", block_k)
    return common.check_scale(scale, query.shape[-1])


def split_kv_partials(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, num_splits: int,
                      scale: float | None = None, block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial kernel alone: ``(o_part (B, H, S, D), lse_part (B, H, S))`` in float32, S = num_splits.

    `query` (B, H, 1, D); `key`, `value` (B, Hkv, Tk, D) with Hkv dividing H. Split s covers keys
    ``[s * c, (s + 1) * c)`` with ``c = ceil(ceil(Tk / S) / block_k) * block_k``; a split past the end is empty
    (``o = 0``, ``lse = -inf``). On a GPU with ``block_k=None`` the key tile is autotuned; else 32 by default.
    """
    scale = _check_decode(query, key, value, num_splits, scale, block_k)
    (b, h, _, d), (h_kv, t_k) = query.shape, key.shape[1:3]
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    o_part = torch.empty(b, h, num_splits, d, device=query.device, dtype=torch.float32)  # (B, H, S, D)
    lse_part = torch.empty(b, h, num_splits, device=query.device, dtype=torch.float32)  # (B, H, S)
    group = h // h_kv
    args = (query, key, value, o_part, lse_part, query.stride(0), query.stride(1), *key.stride()[:3],
            *value.stride()[:3], h_kv, group, t_k, num_splits, scale * LOG2E)
    meta = dict(HEAD_DIM=d, BLOCK_D=common.block_d(d), BLOCK_G=max(16, triton.next_power_of_2(group)))
    if common.use_autotune(query.device, None, block_k):
        _PARTIAL_TUNED[(num_splits, b * h_kv)](*args, **meta)
    else:
        _decode_partial_kernel[(num_splits, b * h_kv)](*args, BLOCK_K=block_k or 32, num_warps=4, **meta)
    return o_part, lse_part


def merge_split_kv(o_part: torch.Tensor, lse_part: torch.Tensor, dtype: torch.dtype | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge kernel alone: partials (B, H, S, D) and (B, H, S) -> ``(out (B, H, 1, D), lse (B, H, 1))``.

    Split 0 must hold keys (as :func:`split_kv_partials` guarantees); `dtype` is the output's (default float32).
    """
    common.require_triton()
    _validate.tensor("o_part", o_part, min_rank=4, floating=True)
    _validate.tensor("lse_part", lse_part, min_rank=3, floating=True)
    if o_part.dim() != 4 or lse_part.shape != o_part.shape[:-1] or o_part.dtype != torch.float32 \
            or lse_part.dtype != torch.float32:
        raise ValueError(f"o_part must be float32 (B, H, S, D) and lse_part float32 (B, H, S), got o_part "
                         f"{tuple(o_part.shape)} {o_part.dtype}, lse_part {tuple(lse_part.shape)} {lse_part.dtype}")
    b, h, splits, d = o_part.shape
    out = torch.empty(b, h, 1, d, device=o_part.device, dtype=dtype or torch.float32)  # (B, H, 1, D)
    lse = torch.empty(b, h, 1, device=o_part.device, dtype=torch.float32)  # (B, H, 1)
    _decode_merge_kernel[(b * h,)](o_part.contiguous(), lse_part.contiguous(), out, lse, splits, HEAD_DIM=d,
                                   BLOCK_D=common.block_d(d), BLOCK_S=max(2, triton.next_power_of_2(splits)))
    return out, lse


def triton_flash_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                        num_splits: int | None = None, scale: float | None = None,
                        block_k: int | None = None) -> torch.Tensor:
    """One decode step: `query` (B, H, 1, D) against the cache `key`, `value` (B, Hkv, Tk, D), Hkv dividing H.

    Returns out (B, H, 1, D) in the query's dtype, equal to attention of each query over all Tk keys (the query
    is the newest position: no mask is needed). ``num_splits=None`` picks :func:`default_num_splits` for this
    GPU's SM count (an H100's 132 in the interpreter); ``num_splits=1`` is the unsplit kernel, with no merge.
    """
    scale = _check_decode(query, key, value, num_splits, scale, block_k)
    b, h_kv, t_k = key.shape[:3]
    if num_splits is None:
        sms = (torch.cuda.get_device_properties(query.device).multi_processor_count
               if query.device.type == "cuda" else H100_SMS)
        num_splits = default_num_splits(b * h_kv, t_k, sm_count=sms)
    o_part, lse_part = split_kv_partials(query, key, value, num_splits=num_splits, scale=scale, block_k=block_k)
    if num_splits == 1:
        return o_part.to(query.dtype)  # (B, H, 1, D): one split is already the answer
    return merge_split_kv(o_part, lse_part, query.dtype)[0]
