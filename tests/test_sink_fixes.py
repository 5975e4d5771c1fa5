"""Softpick, QK-norm, logit soft-capping and Scalable-Softmax (attncourse.sink_fixes) against PyTorch."""

import math

import pytest
import torch
import torch.nn.functional as F

from attncourse.sink_fixes import qk_norm_attention, softcap_attention, softpick, softpick_attention, ssmax_attention


def _qkv(seed, tq=6, tk=6, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, tq, d, generator=g, dtype=dtype), torch.randn(2, 3, tk, d, generator=g, dtype=dtype),
            torch.randn(2, 3, tk, 5, generator=g, dtype=dtype))


def test_softpick_is_its_definition_and_stays_finite():
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2
    e = torch.exp(x) - 1
    torch.testing.assert_close(softpick(x), torch.relu(e) / (e.abs().sum(-1, keepdim=True) + 1e-6))
    assert torch.equal(softpick(-x.abs()), torch.zeros_like(x))  # every score <= 0: an all-zero row, no sink needed
    assert bool((softpick(x).sum(-1) <= 1).all())
    big = softpick(torch.tensor([[800.0, 799.0, -5.0]]))  # e^800 overflows float64: the shifted form does not
    torch.testing.assert_close(big, torch.tensor([[1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1)), 0.0]]))
    masked = softpick(torch.tensor([[1.0, float("-inf"), 2.0], [float("-inf")] * 3]))
    assert masked[0, 1] == 0 and torch.equal(masked[1], torch.zeros(3))  # masked keys and rows carry nothing
    xg = x.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: softpick(t), (xg,))


def test_softpick_attention_causal():
    q, k, v = _qkv(2)
    out, w = softpick_attention(q, k, v, is_causal=True, return_weights=True)
    s = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    e = (torch.exp(s) - 1).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), 0.0)
    ref = torch.relu(e) / (e.abs().sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(w, ref)
    torch.testing.assert_close(out, ref @ v)


def test_softcap_qknorm_ssmax_against_pytorch():
    q, k, v = _qkv(3, tq=5, tk=7)
    for causal in (False, True):
        # a cap far above the scores changes nothing: PyTorch's kernel
        torch.testing.assert_close(softcap_attention(q, k, v, 1e6, is_causal=causal),
                                   F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        # QK-norm == PyTorch's kernel on F.rms_norm'd queries and keys with their gains
        gq, gk = torch.rand(8, dtype=torch.float64) + 0.5, torch.rand(8, dtype=torch.float64) + 0.5
        torch.testing.assert_close(qk_norm_attention(q, k, v, gq, gk, is_causal=causal),
                                   F.scaled_dot_product_attention(F.rms_norm(q, (8,), gq, 1e-6),
                                                                  F.rms_norm(k, (8,), gk, 1e-6), v, is_causal=causal))
    # soft-capping: the same softmax on c tanh(x / c)
    s = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    torch.testing.assert_close(softcap_attention(q * 4, k, v, 3.0), torch.softmax(3 * torch.tanh(4 * s / 3), -1) @ v)
    # SSMax, not causal: PyTorch's kernel with scale s log(Tk) / sqrt(D), one head at a time
    sh = torch.tensor([0.3, 1.0, 2.5], dtype=torch.float64)
    out = ssmax_attention(q, k, v, sh)
    for h in range(3):
        torch.testing.assert_close(out[:, h], F.scaled_dot_product_attention(
            q[:, h], k[:, h], v[:, h], scale=sh[h].item() * math.log(7) / math.sqrt(8)))
    # causal: query i sees i + 1 keys, so its row uses log(i + 1)
    out = ssmax_attention(q, k, v, sh, is_causal=True)
    for i in range(1, 5):
        for h in range(3):
            torch.testing.assert_close(out[:, h, i], F.scaled_dot_product_attention(
                q[:, h, i:i + 1], k[:, h, :i + 1], v[:, h, :i + 1],
                scale=sh[h].item() * math.log(i + 1) / math.sqrt(8))[:, 0])


def test_bounds_and_bad_input():
    q, k, v = _qkv(4)
    _, w = qk_norm_attention(q * 100, k * 100, v, return_weights=True)  # unit gains: scores within +-sqrt(D)
    s = F.rms_norm(q * 100, (8,), eps=1e-6) @ F.rms_norm(k * 100, (8,), eps=1e-6).transpose(-2, -1) / math.sqrt(8)
    assert s.abs().max() <= math.sqrt(8) + 1e-9
    torch.testing.assert_close(w, torch.softmax(s, -1))
    _, w = softcap_attention(q * 1000, k, v, 5.0, return_weights=True)
    assert w.min() >= math.exp(-10) / 6 * 0.99  # logits within (-5, 5): no weight below e^-10 / n
    half = softpick_attention(*(t.half() for t in (q, k, v)))
    torch.testing.assert_close(half.double(), softpick_attention(q.half().double(), k.half().double(),
                                                                 v.half().double()), atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="query"):
        softpick_attention(q[0], k, v)
    with pytest.raises(ValueError, match="cap"):
        softcap_attention(q, k, v, 0.0)
    with pytest.raises(ValueError, match="s must be"):
        ssmax_attention(q, k, v, torch.ones(2))
    with pytest.raises(ValueError, match="q_weight"):
        qk_norm_attention(q, k, v, torch.ones(3))
    with pytest.raises(TypeError):
        softpick(torch.arange(3))
