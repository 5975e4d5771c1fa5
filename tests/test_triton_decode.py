"""Tests of split-KV decoding in Triton (attncourse.triton_decode), under the interpreter without a GPU.

The reference is the course's oracle over K and V repeated per query head; the merge is checked against
chapter 08's `merge_attention_states`, folded over the splits.
"""

from __future__ import annotations

import math

import pytest
import torch

from attncourse import (AttentionState, finalize_attention_state, merge_attention_states, repeat_kv,
                        scaled_dot_product_attention)
from attncourse import triton_common as common

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    common.enable_interpreter()

from attncourse import triton_decode as td  # noqa: E402

needs_triton = pytest.mark.skipif(not common.TRITON_AVAILABLE, reason="Triton is not installed")
needs_cuda = pytest.mark.skipif(not (common.TRITON_AVAILABLE and HAS_CUDA), reason="needs Triton and a CUDA GPU")
DEVICE = "cuda" if HAS_CUDA else "cpu"
F32 = common.tolerance(torch.float32, DEVICE)  # the helper the notebooks use


def decode_inputs(batch, heads, kv_heads, t_k, d, *, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, d, generator=gen)
    k = torch.randn(batch, kv_heads, t_k, d, generator=gen)
    v = torch.randn(batch, kv_heads, t_k, d, generator=gen)
    return (x.to(device=DEVICE, dtype=dtype) for x in (q, k, v))


def oracle(q, k, v):
    n_rep = q.shape[1] // k.shape[1]
    return scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))


# (B, H, Hkv, Tk, D, num_splits): GQA, MQA, MHA; one key; splits that do not divide the tiles; more splits than
# key tiles (empty splits); one split (no merge); the default heuristic (None)
CASES = [(1, 4, 2, 300, 32, 4), (2, 6, 6, 77, 16, 3), (1, 8, 1, 45, 24, 2), (1, 3, 3, 1, 16, 5),
         (1, 4, 2, 100, 16, 16), (2, 4, 4, 64, 16, 1), (1, 8, 2, 333, 16, None)]


@needs_triton
@pytest.mark.parametrize("b,h,h_kv,t_k,d,splits", CASES, ids=[f"B{c[0]}-H{c[1]}-Hkv{c[2]}-T{c[3]}-S{c[5]}" for c in CASES])
def test_decode_matches_the_oracle(b, h, h_kv, t_k, d, splits):
    q, k, v = decode_inputs(b, h, h_kv, t_k, d, seed=t_k)
    out = td.triton_flash_decode(q, k, v, num_splits=splits)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, oracle(q, k, v), **F32)


@needs_triton
@pytest.mark.parametrize("splits", [2, 5, 40])
def test_merge_kernel_equals_chapter_08_merge(splits):
    q, k, v = decode_inputs(2, 4, 2, 150, 16, seed=splits)
    o_part, lse_part = td.split_kv_partials(q, k, v, num_splits=splits, block_k=16)
    assert o_part.shape == (2, 4, splits, 16) and lse_part.shape == (2, 4, splits)
    n_tiles = math.ceil(150 / 16)
    empty = max(0, splits - math.ceil(n_tiles / math.ceil(n_tiles / splits)))
    assert torch.isneginf(lse_part).sum().item() == 2 * 4 * empty  # splits past the last key hold nothing
    # A partial (o_s, lse_s) is chapter 08's state (m, l, acc) = (lse_s, 1, o_s); an empty one is (-inf, 0, 0).
    states = [AttentionState(lse_part[..., s], torch.isfinite(lse_part[..., s]).float(), o_part[..., s, :])
              for s in range(splits)]
    merged = states[0]
    for state in states[1:]:
        merged = merge_attention_states(merged, state)
    out_08, lse_08 = finalize_attention_state(merged)  # (B, H, D), (B, H)
    out, lse = td.merge_split_kv(o_part, lse_part)
    torch.testing.assert_close(out[:, :, 0], out_08, **F32)
    torch.testing.assert_close(lse[:, :, 0], lse_08, **F32)
    torch.testing.assert_close(out, oracle(q, k, v), **F32)
    scores = (q @ repeat_kv(k, 2).transpose(-2, -1)) / 4.0  # (B, H, 1, D) @ (B, H, D, Tk) -> (B, H, 1, Tk)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), **F32)


@needs_triton
def test_each_split_covers_its_own_keys():
    q, k, v = decode_inputs(1, 2, 1, 100, 16, seed=3)
    o_part, lse_part = td.split_kv_partials(q, k, v, num_splits=3, block_k=16)  # chunks of 48: 0-47, 48-95, 96-99
    for s, (lo, hi) in enumerate([(0, 48), (48, 96), (96, 100)]):
        torch.testing.assert_close(o_part[:, :, s:s + 1], oracle(q, k[:, :, lo:hi], v[:, :, lo:hi]), **F32)


@needs_triton
def test_float16_decode():
    q, k, v = decode_inputs(1, 8, 2, 200, 32, dtype=torch.float16, seed=4)
    out = td.triton_flash_decode(q, k, v, num_splits=4)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), oracle(q.float(), k.float(), v.float()),
                               **common.tolerance(torch.float16, DEVICE))


def test_default_num_splits_follows_flash_attentions_heuristic():
    # FlashAttention's own example (flash_api.cpp): batch * heads = 48 on 108 SMs: 2 splits (0.89 of a wave)
    # beat 3 splits (0.67)
    assert td.default_num_splits(48, 108 * 64 * 4, sm_count=108) == 2
    assert td.default_num_splits(132, 32768) == 1  # the grid already fills an H100
    assert td.default_num_splits(106, 32768) == 1  # 80% of the SMs is enough
    assert td.default_num_splits(8, 100, block_k=64) <= 2  # never more splits than key tiles
    for programs, t_k in ((8, 32768), (1, 4096), (32, 32768), (3, 1000)):
        s = td.default_num_splits(programs, t_k)
        waves = programs * s / 132
        assert 1 <= s <= min(128, math.ceil(t_k / 64))
        assert waves / math.ceil(waves) >= 0.8 or s == math.ceil(t_k / 64)


def test_decode_work_counts_programs_and_bytes():
    packed = td.decode_work(1, 32, 8, 32768, 128)
    plain = td.decode_work(1, 32, 8, 32768, 128, pack_gqa=False)
    assert packed == {"programs": 8, "keys_per_program": 32768, "kv_bytes": 2 * 8 * 32768 * 128 * 2}
    assert plain["programs"] == 32 and plain["kv_bytes"] == 4 * packed["kv_bytes"]
    assert td.decode_work(1, 32, 8, 32768, 128, num_splits=16)["programs"] == 128
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=32"):
        td.decode_work(1, 32, 3, 10, 16)


@needs_triton
def test_bad_inputs():
    q, k, v = decode_inputs(1, 4, 2, 10, 16)
    with pytest.raises(ValueError, match=r"query must be \(B, H, 1, D\).*\(1, 4, 2, 16\)"):
        td.triton_flash_decode(q.expand(-1, -1, 2, -1), k, v)
    with pytest.raises(ValueError, match="divide the query heads"):
        td.triton_flash_decode(q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1))
    with pytest.raises(ValueError, match="num_splits must be positive"):
        td.triton_flash_decode(q, k, v, num_splits=0)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        td.split_kv_partials(q, k, v, num_splits=2, block_k=24)
    with pytest.raises(ValueError, match="o_part must be float32"):
        td.merge_split_kv(torch.zeros(1, 4, 2, 16, dtype=torch.float16), torch.zeros(1, 4, 2))


@needs_cuda
@pytest.mark.parametrize("splits", [1, 7, None])
def test_gpu_long_cache(splits):
    q, k, v = decode_inputs(2, 32, 8, 20000, 128, dtype=torch.float16, seed=1)
    out = td.triton_flash_decode(q, k, v, num_splits=splits)
    torch.testing.assert_close(out.float(), oracle(q.float(), k.float(), v.float()),
                               **common.tolerance(torch.float16, "cuda"))
