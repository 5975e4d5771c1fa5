"""Tests of the Triton FlashAttention kernels (attncourse.triton_flash, triton_flash_bwd, triton_common).

Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set here before the kernels are decorated)
at small sizes; the float16 / long-sequence tests need CUDA and are skipped without it. Everything that needs
Triton is skipped, with the reason, where Triton is not installed. The reference is always the course's oracle
`scaled_dot_product_attention` with the equivalent boolean mask and K, V repeated over each head group.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attncourse import repeat_kv, scaled_dot_product_attention
from attncourse import triton_common as common

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    common.enable_interpreter()  # even if another test module imported Triton for a GPU first

from attncourse import triton_flash_bwd  # noqa: E402
from attncourse import triton_flash as tf  # noqa: E402

needs_triton = pytest.mark.skipif(not common.TRITON_AVAILABLE,
                                  reason="Triton is not installed (pip install 'attncourse[triton]', Linux only)")
needs_cuda = pytest.mark.skipif(not (common.TRITON_AVAILABLE and HAS_CUDA), reason="needs Triton and a CUDA GPU")
DEVICE = "cuda" if HAS_CUDA else "cpu"
# Tolerances from the one helper the notebooks use (the interpreter multiplies float32 in float32; a GPU's tl.dot
# rounds float32 inputs to TF32): tests/test_triton_tolerance.py holds the notebooks to it.
F32 = common.tolerance(torch.float32, DEVICE)
GRAD = common.tolerance(torch.float32, DEVICE, grad=True)


def allowed_mask(t_q, t_k, is_causal=False, causal_align="top_left", window=None, device=DEVICE):
    """(Tq, Tk) boolean mask: the meaning of the three arguments, written independently of the kernels."""
    if not is_causal:
        return torch.ones(t_q, t_k, dtype=torch.bool, device=device)
    pos = torch.arange(t_q, device=device)[:, None] + (t_k - t_q if causal_align == "bottom_right" else 0)
    j = torch.arange(t_k, device=device)[None, :]
    keep = j <= pos
    return keep & (j > pos - window) if window else keep


def qkv(lead, heads, kv_heads, t_q, t_k, d, *, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, heads, t_q, d, generator=gen)
    k = torch.randn(*lead, kv_heads, t_k, d, generator=gen)
    v = torch.randn(*lead, kv_heads, t_k, d, generator=gen)
    return (x.to(device=DEVICE, dtype=dtype) for x in (q, k, v))


def expand(x, heads):
    """K or V repeated over each group of query heads, any leading dims: (..., Hkv, T, D) -> (..., H, T, D)."""
    if x.dim() == 2:  # (T, D): one head
        return x
    lead, (h_kv, t, d) = x.shape[:-3], x.shape[-3:]
    return repeat_kv(x.reshape(-1, h_kv, t, d), heads // h_kv).reshape(*lead, heads, t, d)


def oracle(q, k, v, **options):
    heads = q.shape[-3] if q.dim() > 2 else 1
    mask = allowed_mask(q.shape[-2], k.shape[-2], **options)
    return scaled_dot_product_attention(q, expand(k, heads), expand(v, heads), mask)


def oracle_lse(q, k, **options):
    scores = (q.double() @ expand(k, q.shape[-3] if q.dim() > 2 else 1).double().transpose(-2, -1)) / q.shape[-1] ** 0.5
    mask = allowed_mask(q.shape[-2], k.shape[-2], **options)
    return torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)  # (..., H, Tq), -inf on empty rows


# (lead, H, Hkv, Tq, Tk, D, options, blocks): 1 and prime lengths, Tq != Tk both ways, a head dim that is no power
# of two, grouped and single KV heads, both alignments, windows of 1, inside a tile, across tiles and past Tk.
FORWARD_CASES = {
    "T1": ((1,), 2, 2, 1, 1, 16, {}, (16, 16)),
    "full-17x40-D24": ((1,), 2, 2, 17, 40, 24, {}, (16, 16)),
    "causal-33-gqa4:2": ((1,), 4, 2, 33, 33, 16, dict(is_causal=True), (16, 16)),
    "causal-top-left-Tq40-Tk17": ((1,), 2, 1, 40, 17, 16, dict(is_causal=True), (16, 32)),
    "bottom-right-Tq20-Tk37-mqa": ((1,), 4, 1, 20, 37, 16, dict(is_causal=True, causal_align="bottom_right"), (16, 16)),
    "bottom-right-Tq37-Tk20-empty-rows": ((1,), 2, 2, 37, 20, 16, dict(is_causal=True, causal_align="bottom_right"),
                                          (16, 16)),
    "window1": ((1,), 2, 1, 23, 23, 16, dict(is_causal=True, window=1), (16, 16)),
    "window5-D24-gqa": ((2,), 4, 2, 37, 37, 24, dict(is_causal=True, window=5), (16, 16)),
    "window40-bottom-right": ((1,), 2, 2, 23, 70, 16, dict(is_causal=True, causal_align="bottom_right", window=40),
                              (16, 32)),
    "window-top-left-Tq40-Tk17-empty-rows": ((1,), 2, 1, 40, 17, 16, dict(is_causal=True, window=3), (16, 16)),
    "window-larger-than-Tk": ((1,), 3, 3, 19, 29, 16, dict(is_causal=True, causal_align="bottom_right", window=100),
                              (16, 16)),
    "rank5-lead-2x1": ((2, 1), 2, 1, 9, 13, 16, dict(is_causal=True, causal_align="bottom_right", window=4),
                       (16, 16)),
}


@needs_triton
@pytest.mark.parametrize("case", FORWARD_CASES, ids=list(FORWARD_CASES))
def test_forward_matches_oracle_with_the_equivalent_mask(case):
    lead, h, h_kv, t_q, t_k, d, options, (bq, bk) = FORWARD_CASES[case]
    q, k, v = qkv(lead, h, h_kv, t_q, t_k, d, seed=t_q * 100 + t_k)
    out, lse = tf.triton_flash_attention_forward(q, k, v, **options, block_q=bq, block_k=bk)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1]
    torch.testing.assert_close(out, oracle(q, k, v, **options), **F32)
    torch.testing.assert_close(lse.double(), oracle_lse(q, k, **options), **F32)


@needs_triton
def test_matches_pytorch_gqa_and_its_causal_lower_right():
    # PyTorch's own semantics: enable_gqa=True, and causal_lower_right is our "bottom_right".
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = qkv((1,), 4, 2, 13, 30, 16, seed=3)
    ours = tf.triton_flash_attention(q, k, v, is_causal=True, causal_align="bottom_right", block_q=16, block_k=16)
    bias = causal_lower_right(13, 30)
    theirs = F.scaled_dot_product_attention(q, expand(k, 4), expand(v, 4), attn_mask=bias)
    torch.testing.assert_close(ours, theirs, **F32)
    if "enable_gqa" in F.scaled_dot_product_attention.__doc__:
        torch.testing.assert_close(tf.triton_flash_attention(q, k, v, block_q=16, block_k=16),
                                   F.scaled_dot_product_attention(q, k, v, enable_gqa=True), **F32)


@needs_triton
def test_rank2_and_rank3_inputs_and_custom_scale():
    q, k, v = qkv((), 3, 1, 9, 12, 16, seed=11)  # (H, T, D) with one KV head
    torch.testing.assert_close(tf.triton_flash_attention(q, k, v, scale=0.3),
                               scaled_dot_product_attention(q, expand(k, 3), expand(v, 3), scale=0.3), **F32)
    q2, k2, v2 = q[0], k[0], v[0]  # (T, D): one head
    torch.testing.assert_close(tf.triton_flash_attention(q2, k2, v2, is_causal=True),
                               oracle(q2, k2, v2, is_causal=True), **F32)


@needs_triton
@pytest.mark.parametrize("block_q,block_k", [(16, 32), (32, 16), (64, 16)])
def test_block_sizes_do_not_change_the_result(block_q, block_k):
    q, k, v = qkv((1,), 2, 1, 50, 50, 16, seed=7)
    options = dict(is_causal=True, window=9)
    out, lse = tf.triton_flash_attention_forward(q, k, v, **options, block_q=block_q, block_k=block_k)
    torch.testing.assert_close(out, oracle(q, k, v, **options), **F32)
    torch.testing.assert_close(lse.double(), oracle_lse(q, k, **options), **F32)


def expected_tile_states(t_q, t_k, block_q, block_k, **options):
    """0 = no allowed pair (must be skipped), 1 = some pairs allowed (masked), 2 = every pair allowed (full)."""
    n_qb, n_kb = -(-t_q // block_q), -(-t_k // block_k)
    padded = torch.zeros(n_qb * block_q, n_kb * block_k, dtype=torch.bool)
    padded[:t_q, :t_k] = allowed_mask(t_q, t_k, **options, device="cpu")
    tiles = padded.reshape(n_qb, block_q, n_kb, block_k)
    return torch.where(tiles.all(3).all(1), 2, tiles.any(3).any(1).int()).int()


@needs_triton
@pytest.mark.parametrize("t_q,t_k,options", [
    (100, 100, dict(is_causal=True)),
    (100, 100, dict(is_causal=True, window=20)),
    (48, 100, dict(is_causal=True, causal_align="bottom_right", window=33)),
    (100, 40, dict(is_causal=True, causal_align="bottom_right")),
    (64, 64, {}),
], ids=["causal", "window20", "bottom-right-window", "bottom-right-Tq>Tk", "full"])
def test_kernel_skips_tiles_outside_the_band_and_masks_only_partial_ones(t_q, t_k, options):
    q, k, v = qkv((1,), 1, 1, t_q, t_k, 16, seed=1)
    got = tf.tile_states(q, k, v, **options, block_q=16, block_k=16)
    torch.testing.assert_close(got, expected_tile_states(t_q, t_k, 16, 16, **options), rtol=0, atol=0)


@needs_triton
def test_window_work_grows_with_the_band_not_with_t_squared():
    q, k, v = qkv((1,), 1, 1, 512, 512, 16, seed=2)
    visited = (tf.tile_states(q, k, v, is_causal=True, window=32, block_q=32, block_k=32) > 0).sum().item()
    # each of the 16 query blocks needs its own tile and the one before it (window 32 = one tile): 31 tiles
    assert visited == 2 * 16 - 1
    causal = (tf.tile_states(q, k, v, is_causal=True, block_q=32, block_k=32) > 0).sum().item()
    assert causal == 16 * 17 // 2


GRAD_CASES = {
    "causal-gqa-17": ((1,), 4, 2, 17, 17, 16, dict(is_causal=True), (16, 16)),
    "full-40x23-mqa": ((1,), 2, 1, 40, 23, 16, {}, (32, 16)),
    "bottom-right-window-D24": ((1,), 4, 2, 23, 40, 24, dict(is_causal=True, causal_align="bottom_right", window=7),
                                (16, 32)),
    "empty-rows-bottom-right": ((1,), 2, 1, 37, 20, 16, dict(is_causal=True, causal_align="bottom_right"), (16, 16)),
    "window1-rank5": ((2, 1), 2, 2, 21, 21, 16, dict(is_causal=True, window=1), (16, 16)),
}


@needs_triton
@pytest.mark.parametrize("case", GRAD_CASES, ids=list(GRAD_CASES))
def test_gradients_match_autograd(case):
    lead, h, h_kv, t_q, t_k, d, options, (bq, bk) = GRAD_CASES[case]
    q, k, v = qkv(lead, h, h_kv, t_q, t_k, d, seed=5)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    tf.triton_flash_attention(*ours, **options, block_q=bq, block_k=bk).backward(grad)
    oracle(*ref, **options).backward(grad)
    for name, a, b in zip("qkv", ours, ref):
        assert a.grad.shape == b.grad.shape
        torch.testing.assert_close(a.grad, b.grad, **GRAD, msg=lambda m, n=name: f"d{n}: {m}")


@needs_triton
def test_backward_is_deterministic_and_has_no_nan_on_empty_rows():
    q, k, v = qkv((1,), 2, 1, 30, 10, 16, seed=9)
    options = dict(is_causal=True, causal_align="bottom_right", window=3, block_q=16, block_k=16)
    out, lse = tf.triton_flash_attention_forward(q, k, v, **options)
    assert torch.isneginf(lse[..., :20]).all() and (out[..., :20, :] == 0).all()  # rows before key 0 see nothing
    grad = torch.randn_like(out)
    first = tf.triton_flash_attention_backward(grad, q, k, v, out, lse, **options)
    second = tf.triton_flash_attention_backward(grad, q, k, v, out, lse, **options)
    for a, b in zip(first, second):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    assert (first[0][..., :20, :] == 0).all()


@needs_triton
def test_grouped_heads_are_read_in_place_without_copies():
    q, k, v = qkv((2,), 8, 2, 5, 7, 16)
    p = common.prepare(q, k, v, is_causal=False, causal_align="top_left", window=None, scale=None, block_q=None,
                       block_k=None)
    assert (p.heads, p.kv_heads, p.group) == (8, 2, 4)
    assert p.k.data_ptr() == k.data_ptr() and p.v.data_ptr() == v.data_ptr()  # views, not repeats
    kt = k.transpose(-3, -2).contiguous().transpose(-3, -2)  # (B, T, Hkv, D) memory seen as (B, Hkv, T, D)
    assert common.prepare(q, kt, v, is_causal=False, causal_align="top_left", window=None, scale=None,
                          block_q=None, block_k=None).k.data_ptr() == kt.data_ptr()
    torch.testing.assert_close(tf.triton_flash_attention(q, kt, v), oracle(q, kt, v), **F32)


@needs_triton
def test_float16_in_the_interpreter_or_on_the_gpu():
    q, k, v = qkv((1,), 4, 2, 37, 37, 32, dtype=torch.float16, seed=8)
    options = dict(is_causal=True, window=11)
    out, lse = tf.triton_flash_attention_forward(q, k, v, **options)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), oracle(q.float(), k.float(), v.float(), **options),
                               **common.tolerance(torch.float16, DEVICE))


@needs_triton
def test_bad_inputs_raise_with_argument_and_shapes():
    q, k, v = qkv((1,), 4, 2, 8, 8, 16)
    fn = tf.triton_flash_attention
    with pytest.raises(ValueError, match=r"head dim.*\(1, 4, 8, 16\).*\(1, 2, 8, 8\)"):
        fn(q, k[..., :8], v)
    with pytest.raises(ValueError, match=r"KV heads.*divide.*query \(1, 4, 8, 16\), key \(1, 3, 8, 16\)"):
        fn(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1))
    with pytest.raises(ValueError, match="same number of heads"):
        fn(q, k, v[:, :1])
    with pytest.raises(ValueError, match="batch dims"):
        fn(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match="causal_align must be one of"):
        fn(q, k, v, is_causal=True, causal_align="bottom-right")
    with pytest.raises(ValueError, match="window must be positive"):
        fn(q, k, v, is_causal=True, window=0)
    with pytest.raises(TypeError, match="window must be an int"):
        fn(q, k, v, is_causal=True, window=True)
    with pytest.raises(ValueError, match="window=4 needs is_causal=True"):
        fn(q, k, v, window=4)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        fn(q, k, v, is_causal=1)
    with pytest.raises(ValueError, match="same rank"):
        fn(q[0], k, v)
    with pytest.raises(ValueError, match="same length"):
        fn(q, k, v[..., :5, :])
    with pytest.raises(ValueError, match="at least 2 dims"):
        fn(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0])
    with pytest.raises(ValueError, match="empty"):
        fn(q[..., :0, :], k, v)
    with pytest.raises(TypeError, match="floating-point"):
        fn(q.long(), k.long(), v.long())
    with pytest.raises(TypeError, match="dtype must be one of"):
        fn(q.double(), k.double(), v.double())
    with pytest.raises(TypeError, match="share a dtype"):
        fn(q, k.half(), v)
    with pytest.raises(TypeError, match="torch.Tensor"):
        fn(q.tolist(), k, v)
    for bad in (0, 24, 8):
        with pytest.raises(ValueError, match="block_q"):
            fn(q, k, v, block_q=bad)
    with pytest.raises(TypeError, match="block_k"):
        fn(q, k, v, block_k=32.0)
    with pytest.raises(TypeError, match="scale"):
        fn(q, k, v, scale="0.5")
    with pytest.raises(ValueError, match="grad_out and out must have the query's shape"):
        tf.triton_flash_attention_backward(q[..., :4, :], q, k, v, q, q[..., 0])


@needs_triton
@pytest.mark.skipif(HAS_CUDA, reason="the CPU interpreter's limits")
def test_bfloat16_is_refused_in_the_interpreter():
    q, k, v = qkv((1,), 1, 1, 8, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        tf.triton_flash_attention(q, k, v)


def test_clear_message_without_triton(monkeypatch):
    monkeypatch.setattr(common, "TRITON_AVAILABLE", False)
    q = torch.randn(1, 4, 16)
    with pytest.raises(ImportError, match=r"pip install 'attncourse\[triton\]'"):
        tf.triton_flash_attention(q, q, q)
    with pytest.raises(ImportError, match="TRITON_INTERPRET=1"):
        tf.triton_flash_attention_forward(q, q, q)


def test_attention_and_backward_flops_match_pytorchs_counter():
    from torch.utils.flop_counter import FlopCounterMode  # imports Triton: only after the interpreter is on

    assert tf.attention_flops(2, 128, 128, 64) == 4 * 2 * 128 * 128 * 64
    assert tf.attention_flops(2, 128, 128, 64, is_causal=True) == 2 * 2 * 128 * 128 * 64
    t_q, t_k, d = 48, 80, 32
    q, k, v = (torch.randn(t, d, requires_grad=True) for t in (t_q, t_k, t_k))
    with FlopCounterMode(display=False) as fwd:
        out = torch.softmax(q @ k.T, dim=-1) @ v  # (Tq, D) @ (D, Tk) -> (Tq, Tk); (Tq, Tk) @ (Tk, D)
    with FlopCounterMode(display=False) as bwd:
        out.backward(torch.randn(t_q, d))
    assert fwd.get_total_flops() == tf.backward_flops(t_q, t_k, d, "forward")["flops"]
    assert bwd.get_total_flops() == tf.backward_flops(t_q, t_k, d, "stored P")["flops"]  # autograd keeps P
    two, one = tf.backward_flops(t_q, t_k, d)["flops"], tf.backward_flops(t_q, t_k, d, "one pass")["flops"]
    assert two / one == pytest.approx(1.4)  # 7 matmuls against 5
    with pytest.raises(ValueError, match="scheme must be one of"):
        tf.backward_flops(1, 1, 1, "three kernels")


@needs_triton
def test_autotune_configs_and_the_autotuned_launch(monkeypatch):
    import time

    import triton

    configs = tf.forward_configs("full")
    assert len(configs) == 36 and all(c.num_warps in (4, 8) and c.num_stages in (2, 3, 4) for c in configs)
    assert len(tf.forward_configs("quick")) == 2 and len(triton_flash_bwd.backward_configs("quick")) == 1
    with pytest.raises(ValueError, match="'full' or 'quick'"):
        tf.forward_configs("fast")
    assert {c.kwargs["BLOCK_Q"] for c in configs} == {64, 128}
    kept = tf.prune_configs(configs, {"T_Q": 40}, HEAD_DIM=256)
    assert kept and all(c.kwargs["BLOCK_Q"] == 64 and c.kwargs["BLOCK_Q"] * c.kwargs["BLOCK_K"] <= 64 * 128
                        for c in kept)
    assert len(triton_flash_bwd.backward_configs("full")) == 16

    def wall_clock(fn, quantiles):  # the interpreter has no GPU timer: time on the CPU instead
        start = time.perf_counter()
        fn()
        return [time.perf_counter() - start] * len(quantiles)

    small = [triton.Config({"BLOCK_Q": 16, "BLOCK_K": 16}), triton.Config({"BLOCK_Q": 32, "BLOCK_K": 16})]
    tuned = triton.autotune(small, key=tf._TUNE_KEY, do_bench=wall_clock)(tf._flash_fwd_kernel)
    monkeypatch.setattr(tf, "_FWD_TUNED", tuned)
    monkeypatch.setattr(common, "use_autotune", lambda device, bq, bk: bq is None and bk is None)
    q, k, v = qkv((1,), 2, 1, 40, 40, 16, seed=4)
    out = tf.triton_flash_attention_forward(q, k, v, is_causal=True, window=6)[0]
    assert tuned.best_config in small
    torch.testing.assert_close(out, oracle(q, k, v, is_causal=True, window=6), **F32)


# ----------------------------------------------------------------------------- GPU only


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, dict(is_causal=True), dict(is_causal=True, causal_align="bottom_right"),
                                     dict(is_causal=True, window=256)], ids=["full", "causal", "bottom-right", "window"])
@pytest.mark.parametrize("t_q,t_k,d", [(1000, 1000, 64), (511, 1537, 128), (2048, 2048, 64), (129, 77, 96)])
def test_gpu_half_precision_long_sequences(t_q, t_k, d, options, dtype):
    q, k, v = qkv((2,), 8, 2, t_q, t_k, d, dtype=dtype, seed=t_q)
    out, lse = tf.triton_flash_attention_forward(q, k, v, **options)
    tol = common.tolerance(dtype, "cuda")
    torch.testing.assert_close(out.float(), oracle(q.float(), k.float(), v.float(), **options), **tol)
    finite = torch.isfinite(oracle_lse(q, k, **options))
    torch.testing.assert_close(lse.double()[finite], oracle_lse(q, k, **options)[finite], **tol)


@needs_cuda
@pytest.mark.parametrize("options", [{}, dict(is_causal=True, window=300)], ids=["full", "window"])
def test_gpu_float16_gradients(options):
    q, k, v = qkv((2,), 8, 2, 777, 777, 64, dtype=torch.float16, seed=3)
    grad = torch.randn_like(q)
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = [x.clone().float().requires_grad_() for x in (q, k, v)]
    tf.triton_flash_attention(*ours, **options).backward(grad)
    oracle(*ref, **options).backward(grad.float())
    for name, a, b in zip("qkv", ours, ref):
        torch.testing.assert_close(a.grad.float(), b.grad, **common.tolerance(torch.float16, "cuda", grad=True),
                                   msg=lambda m, n=name: f"d{n}: {m}")


def test_module_imports_without_triton():
    # A fresh interpreter where `import triton` fails: the modules must import and explain what to install.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import attncourse.triton_flash as tf, attncourse.triton_decode as td\n"
        "assert not tf.TRITON_AVAILABLE and tf.TRITON_VERSION is None and not tf.interpreted()\n"
        "try:\n"
        "    tf.triton_flash_attention(torch.randn(4, 16), torch.randn(4, 16), torch.randn(4, 16))\n"
        "except ImportError as err:\n"
        "    print(err)\n"
        "try:\n"
        "    td.triton_flash_decode(torch.randn(1, 1, 1, 16), torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16))\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("pip install 'attncourse[triton]'") == 2
