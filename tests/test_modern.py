"""The modern block against PyTorch: RMSNorm == nn.RMSNorm, SwiGLU == its formula with F.silu, the whole block ==
a reference written from Hugging Face's Qwen3 formulas with nn.RMSNorm, rotate_half and F.scaled_dot_product_attention."""

import pytest
import torch
import torch.nn.functional as F

from attncourse.modern import ModernBlock, RMSNorm, SwiGLU, swiglu_hidden


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_rmsnorm_equals_torch(dtype):
    torch.manual_seed(0)
    norm, ref = RMSNorm(24, eps=1e-5), torch.nn.RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        ref.weight.copy_(norm.weight)
    x = torch.randn(3, 5, 24) * 7
    if dtype is torch.float64:
        torch.testing.assert_close(norm.double()(x.double()), ref.double()(x.double()))
    else:  # computed in float32, rounded once
        out = norm(x.to(dtype))
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref(x.to(dtype).float()), atol=0.05, rtol=0.02)


def test_swiglu_formula_and_width():
    torch.manual_seed(0)
    ffn = SwiGLU(12, 20).double()
    x = torch.randn(2, 3, 12, dtype=torch.float64)
    ref = (F.silu(x @ ffn.w_gate.weight.T) * (x @ ffn.w_up.weight.T)) @ ffn.w_down.weight.T
    torch.testing.assert_close(ffn(x), ref)
    assert swiglu_hidden(4096, 256) == 11008  # LLaMA-1/2 7B's intermediate_size
    assert swiglu_hidden(30) == 80 and SwiGLU(30).w_gate.out_features == 80


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


def reference_block(blk, x):
    """Qwen3-style decoder layer written from the formulas, on PyTorch's RMSNorm and fused kernel."""
    b, t, d = x.shape
    h, hkv, hd = blk.n_heads, blk.n_kv_heads, blk.head_dim

    def rms(module, z):
        ref = torch.nn.RMSNorm(z.shape[-1], eps=module.eps).to(z.dtype)
        with torch.no_grad():
            ref.weight.copy_(module.weight)
        return ref(z)

    theta = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * theta                  # (T, hd/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    z = rms(blk.norm1, x)
    q = (z @ blk.q_proj.weight.T).view(b, t, h, hd).transpose(1, 2)
    k = (z @ blk.k_proj.weight.T).view(b, t, hkv, hd).transpose(1, 2)
    v = (z @ blk.v_proj.weight.T).view(b, t, hkv, hd).transpose(1, 2)
    if blk.q_norm is not None:
        q, k = rms(blk.q_norm, q), rms(blk.k_norm, k)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    hid = x + att.transpose(1, 2).reshape(b, t, h * hd) @ blk.o_proj.weight.T
    z = rms(blk.norm2, hid)
    ff = (F.silu(z @ blk.ffn.w_gate.weight.T) * (z @ blk.ffn.w_up.weight.T)) @ blk.ffn.w_down.weight.T
    return hid + ff


@pytest.mark.parametrize("n_kv, qk_norm", [(4, True), (2, True), (1, False)])
def test_block_equals_reference(n_kv, qk_norm):
    torch.manual_seed(1)
    blk = ModernBlock(32, 4, n_kv, qk_norm=qk_norm).double()
    with torch.no_grad():
        for p in blk.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    torch.testing.assert_close(blk(x), reference_block(blk, x))
    assert all(m.bias is None for m in blk.modules() if isinstance(m, torch.nn.Linear))


def test_block_gradients_and_parameter_count():
    blk = ModernBlock(32, 4, 2)
    n = sum(p.numel() for p in blk.parameters())
    hd = 8
    assert n == 32 * 32 * 2 + 2 * 32 * 2 * hd + 3 * 32 * swiglu_hidden(32) + 2 * 32 + 2 * hd
    x = torch.randn(1, 5, 32, requires_grad=True)
    blk(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="n_heads"):
        ModernBlock(30, 4)
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModernBlock(32, 4, 3)
    with pytest.raises(ValueError, match="d_model"):
        ModernBlock(32, 4)(torch.randn(1, 3, 16))
    with pytest.raises(ValueError, match="eps"):
        RMSNorm(8, eps=0)
    with pytest.raises(ValueError, match="d="):
        RMSNorm(8)(torch.randn(2, 4))
    with pytest.raises(TypeError, match="d_ff"):
        SwiGLU(8, 2.5)
