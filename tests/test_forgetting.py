"""The Forgetting Transformer's attention against a dense reference (products of gates) and PyTorch's SDPA."""

import pytest
import torch
import torch.nn.functional as F

from attncourse.forgetting import forget_bias, forgetting_attention
from attncourse.linear_attention import segsum


def _dense_reference(q, k, v, f):
    """Weights exp(q.k / sqrt(d)) * prod_{l=s+1..t} f_l, normalised over s <= t: written with explicit products."""
    B, H, T, D = q.shape
    out = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        w = torch.zeros(B, H, t + 1, dtype=torch.float64)
        for s in range(t + 1):
            prod = torch.ones(B, H, dtype=torch.float64)
            for l in range(s + 1, t + 1):
                prod = prod * f[..., l]
            w[..., s] = torch.exp((q[..., t, :] * k[..., s, :]).sum(-1) / D ** 0.5) * prod
        out[..., t, :] = (w / w.sum(-1, keepdim=True))[..., None, :].matmul(v[..., : t + 1, :])[..., 0, :]
    return out


def test_equals_dense_products_and_sdpa():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 3, 12, 8, generator=gen, dtype=torch.float64).unbind(0)
    f = torch.sigmoid(torch.randn(2, 3, 12, generator=gen, dtype=torch.float64) + 1)
    ours = forgetting_attention(q, k, v, f.log())
    torch.testing.assert_close(ours, _dense_reference(q, k, v, f))
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=forget_bias(f.log())))
    torch.testing.assert_close(forget_bias(f.log()), segsum(f.log()))  # the bias is the decay mask's log


def test_no_forgetting_is_causal_softmax_and_gradients_match():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    torch.testing.assert_close(forgetting_attention(q, k, v, torch.zeros(1, 2, 9, dtype=torch.float64)),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))
    logit = torch.randn(1, 2, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    ours = torch.autograd.grad(forgetting_attention(q, k, v, F.logsigmoid(logit)).square().sum(), (q, logit))
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=forget_bias(F.logsigmoid(logit)))
                              .square().sum(), (q, logit))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)
    assert ours[1].abs().sum() > 0  # the gate learns


def test_half_inputs_keep_float32_scores():
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(3, 1, 1, 16, 8, generator=gen).unbind(0)
    lf = F.logsigmoid(torch.randn(1, 1, 16, generator=gen))
    out = forgetting_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), lf)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), forgetting_attention(q, k, v, lf), atol=3e-2, rtol=3e-2)


def test_rejects_bad_shapes():
    q = torch.randn(1, 1, 5, 4)
    with pytest.raises(ValueError, match="log_f"):
        forgetting_attention(q, q, q, torch.zeros(1, 1, 6))
    with pytest.raises(ValueError, match="v"):
        forgetting_attention(q, q, torch.randn(1, 1, 4, 4), torch.zeros(1, 1, 5))
    with pytest.raises(TypeError):
        forgetting_attention(q, q, q, [0.0] * 5)
