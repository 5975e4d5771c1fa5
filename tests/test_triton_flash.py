"""Tests of the Triton FlashAttention kernels (attncourse.triton_flash).

Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set here before Triton is imported) at
small sizes; the float16 / long-sequence tests need CUDA and are skipped without it. Everything that needs
Triton is skipped, with the reason, where Triton is not installed.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before Triton (and our kernels) are imported

from attncourse import scaled_dot_product_attention  # noqa: E402
from attncourse import triton_flash as tf  # noqa: E402

if tf.TRITON_AVAILABLE and not HAS_CUDA and not tf.interpreted():
    # Something imported the module before the variable was set: rebuild the kernels for the interpreter.
    tf = importlib.reload(tf)

needs_triton = pytest.mark.skipif(not tf.TRITON_AVAILABLE,
                                  reason="Triton is not installed (pip install 'attncourse[triton]', Linux only)")
needs_cuda = pytest.mark.skipif(not (tf.TRITON_AVAILABLE and HAS_CUDA), reason="needs Triton and a CUDA GPU")
DEVICE = "cuda" if HAS_CUDA else "cpu"
# Float32 tolerances: the interpreter multiplies in float32; on a GPU tl.dot rounds float32 inputs to TF32.
F32 = dict(rtol=1e-5, atol=2e-5) if not HAS_CUDA else dict(rtol=3e-3, atol=3e-3)


def qkv(shape_q, k_len, *, dtype=torch.float32, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    *lead, _, d = shape_q
    q = torch.randn(*shape_q, generator=gen)
    k = torch.randn(*lead, k_len, d, generator=gen)
    v = torch.randn(*lead, k_len, d, generator=gen)
    return (x.to(device=device, dtype=dtype) for x in (q, k, v))


def reference_lse(q, k, is_causal, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.double() @ k.double().transpose(-2, -1)) * scale  # (..., Tq, D) @ (..., D, Tk) -> (..., Tq, Tk)
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()  # (Tq, Tk)
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.logsumexp(scores, dim=-1)  # (..., Tq)


# (Tq, Tk, D): 1, primes, a block multiple, a non-multiple, Tq != Tk both ways, a head dim that is no power of two
SHAPES = [(1, 1, 16), (17, 17, 16), (64, 64, 32), (100, 100, 32), (17, 40, 16), (40, 17, 32), (33, 33, 24)]


@needs_triton
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("t_q,t_k,d", SHAPES, ids=[f"Tq{a}-Tk{b}-D{c}" for a, b, c in SHAPES])
def test_forward_matches_oracle_pytorch_and_logsumexp(t_q, t_k, d, is_causal):
    q, k, v = qkv((1, 2, t_q, d), t_k, seed=t_q * 100 + t_k)
    out, lse = tf.triton_flash_attention_forward(q, k, v, is_causal=is_causal)
    assert out.shape == (1, 2, t_q, d) and out.dtype == q.dtype and lse.shape == (1, 2, t_q)
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, is_causal=is_causal), **F32)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal), **F32)
    torch.testing.assert_close(lse.double(), reference_lse(q, k, is_causal), **F32)


@needs_triton
@pytest.mark.parametrize("block_q,block_k", [(16, 32), (32, 16), (64, 16)])
def test_block_sizes_do_not_change_the_result(block_q, block_k):
    q, k, v = qkv((1, 1, 50, 16), 50, seed=7)
    for causal in (False, True):
        out, lse = tf.triton_flash_attention_forward(q, k, v, is_causal=causal, block_q=block_q, block_k=block_k)
        torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, is_causal=causal), **F32)
        torch.testing.assert_close(lse.double(), reference_lse(q, k, causal), **F32)


@needs_triton
@pytest.mark.parametrize("shape_q,k_len", [((9, 16), 5), ((3, 9, 16), 12), ((2, 3, 5, 16), 7)],
                         ids=["rank2", "rank3", "rank4"])
def test_any_leading_dims_and_custom_scale(shape_q, k_len):
    q, k, v = qkv(shape_q, k_len, seed=11)
    out = tf.triton_flash_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, scale=0.3), **F32)
    _, lse = tf.triton_flash_attention_forward(q, k, v, scale=0.3)
    torch.testing.assert_close(lse.double(), reference_lse(q, k, False, scale=0.3), **F32)


@needs_triton
def test_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 19, 2, 16, generator=gen).to(DEVICE).transpose(1, 2)  # (B, T, H, D) -> (B, H, T, D)
               for _ in range(3))
    assert not q.is_contiguous()
    torch.testing.assert_close(tf.triton_flash_attention(q, k, v, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True), **F32)


@needs_triton
@pytest.mark.parametrize("t_q,t_k,d,is_causal,blocks", [
    (17, 17, 16, True, (16, 16)),
    (40, 23, 16, False, (32, 16)),
    (23, 40, 24, True, (16, 32)),
    (64, 64, 32, True, (32, 32)),
], ids=["Tq17-causal", "Tq40-Tk23", "Tq23-Tk40-D24-causal", "Tq64-causal"])
def test_gradients_match_autograd(t_q, t_k, d, is_causal, blocks):
    q, k, v = qkv((1, 2, t_q, d), t_k, seed=5)
    grad = torch.randn(1, 2, t_q, d, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    tf.triton_flash_attention(*ours, is_causal=is_causal, block_q=blocks[0], block_k=blocks[1]).backward(grad)
    scaled_dot_product_attention(*ref, is_causal=is_causal).backward(grad)
    for name, a, b in zip("qkv", ours, ref):
        torch.testing.assert_close(a.grad, b.grad, **F32, msg=lambda m, n=name: f"d{n}: {m}")


@needs_triton
def test_float16_in_the_interpreter_or_on_the_gpu():
    q, k, v = qkv((1, 2, 37, 32), 37, dtype=torch.float16, seed=8)
    out, lse = tf.triton_flash_attention_forward(q, k, v, is_causal=True)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)


@needs_triton
def test_bad_inputs_raise_with_shapes():
    q, k, v = qkv((1, 2, 8, 16), 8)
    with pytest.raises(ValueError, match=r"head dim.*\(1, 2, 8, 16\).*\(1, 2, 8, 8\)"):
        tf.triton_flash_attention(q, k[..., :8], v)
    with pytest.raises(ValueError, match="leading"):
        tf.triton_flash_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="same rank"):
        tf.triton_flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="same length"):
        tf.triton_flash_attention(q, k, v[..., :5, :])
    with pytest.raises(ValueError, match="at least 2 dims"):
        tf.triton_flash_attention(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0])
    with pytest.raises(ValueError, match="empty"):
        tf.triton_flash_attention(q[..., :0, :], k, v)
    with pytest.raises(TypeError, match="floating-point"):
        tf.triton_flash_attention(q.long(), k.long(), v.long())
    with pytest.raises(TypeError, match="dtype must be one of"):
        tf.triton_flash_attention(q.double(), k.double(), v.double())
    with pytest.raises(TypeError, match="share a dtype"):
        tf.triton_flash_attention(q, k.half(), v)
    with pytest.raises(TypeError, match="torch.Tensor"):
        tf.triton_flash_attention(q.tolist(), k, v)
    for bad in (0, 24, 8):
        with pytest.raises(ValueError, match="block_q"):
            tf.triton_flash_attention(q, k, v, block_q=bad)
    with pytest.raises(TypeError, match="block_k"):
        tf.triton_flash_attention(q, k, v, block_k=32.0)
    with pytest.raises(TypeError, match="scale"):
        tf.triton_flash_attention(q, k, v, scale="0.5")


@needs_triton
@pytest.mark.skipif(HAS_CUDA, reason="the CPU interpreter's limits")
def test_bfloat16_is_refused_in_the_interpreter():
    q, k, v = qkv((1, 1, 8, 16), 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        tf.triton_flash_attention(q, k, v)


def test_clear_message_without_triton(monkeypatch):
    monkeypatch.setattr(tf, "TRITON_AVAILABLE", False)
    q = torch.randn(1, 4, 16)
    with pytest.raises(ImportError, match=r"pip install 'attncourse\[triton\]'"):
        tf.triton_flash_attention(q, q, q)
    with pytest.raises(ImportError, match="TRITON_INTERPRET=1"):
        tf.triton_flash_attention_forward(q, q, q)


def test_attention_flops():
    assert tf.attention_flops(2, 128, 128, 64) == 4 * 2 * 128 * 128 * 64
    assert tf.attention_flops(2, 128, 128, 64, is_causal=True) == 2 * 2 * 128 * 128 * 64


# ----------------------------------------------------------------------------- GPU only


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("t_q,t_k,d", [(1000, 1000, 64), (511, 1537, 128), (2048, 2048, 64), (129, 77, 96)])
def test_gpu_half_precision_long_sequences(t_q, t_k, d, is_causal, dtype):
    q, k, v = qkv((2, 4, t_q, d), t_k, dtype=dtype, seed=t_q)
    out, lse = tf.triton_flash_attention_forward(q, k, v, is_causal=is_causal)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=4e-3, atol=4e-3)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal), **tol)
    torch.testing.assert_close(lse.double(), reference_lse(q, k, is_causal), rtol=1e-3, atol=1e-2)


@needs_cuda
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_gpu_float16_gradients(is_causal):
    q, k, v = qkv((2, 4, 777, 64), 777, dtype=torch.float16, seed=3)
    grad = torch.randn_like(q)
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = [x.clone().float().requires_grad_() for x in (q, k, v)]
    tf.triton_flash_attention(*ours, is_causal=is_causal).backward(grad)
    F.scaled_dot_product_attention(*ref, is_causal=is_causal).backward(grad.float())
    for name, a, b in zip("qkv", ours, ref):
        torch.testing.assert_close(a.grad.float(), b.grad, rtol=2e-2, atol=2e-2, msg=lambda m, n=name: f"d{n}: {m}")


def test_module_imports_without_triton():
    # A fresh interpreter where `import triton` fails: the module must import and explain what to install.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import attncourse.triton_flash as tf\n"
        "assert not tf.TRITON_AVAILABLE and tf.TRITON_VERSION is None and not tf.interpreted()\n"
        "try:\n"
        "    tf.triton_flash_attention(torch.randn(4, 16), torch.randn(4, 16), torch.randn(4, 16))\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pip install 'attncourse[triton]'" in done.stdout
