"""Sigmoid and differential attention (functional and modules) against hand computations and PyTorch:
shapes, masks, gradients (gradcheck in float64), the lambda = 0 limit, parameters, bad input."""

import math

import pytest
import torch
import torch.nn.functional as F

from attncourse import (DifferentialAttention, MultiHeadAttention, SigmoidAttention, diff_lambda_init,
                        differential_attention, merge_heads, scaled_dot_product_attention, sigmoid_attention,
                        split_heads)

TOL64 = dict(rtol=1e-10, atol=1e-12)

SHAPES = [  # (lead dims, Tq, Tk, D, Dv)
    ((2, 3), 5, 5, 8, 8),
    ((2, 3), 5, 7, 8, 4),  # Tq != Tk, Dv != D
    ((1, 1), 1, 13, 16, 16),  # one query
    ((3,), 11, 2, 4, 6),  # more queries than keys
    ((), 7, 7, 5, 3),  # 2-D, prime sizes
]


def make(lead, tq, tk, d, dv, seed=0, n_q=1, n_k=1):
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(*lead, tq, d, generator=g, dtype=torch.float64) for _ in range(n_q)]
    ks = [torch.randn(*lead, tk, d, generator=g, dtype=torch.float64) for _ in range(n_k)]
    v = torch.randn(*lead, tk, dv, generator=g, dtype=torch.float64)
    return (*qs, *ks, v)


# ----------------------------------------------------------------------------- sigmoid attention


def sigmoid_by_hand(q, k, v, bias, keep=None):
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    w = torch.zeros(*q.shape[:-1], k.shape[-2], dtype=q.dtype)
    for i in range(q.shape[-2]):
        for j in range(k.shape[-2]):
            s = (q[..., i, :] * k[..., j, :]).sum(-1) / math.sqrt(q.shape[-1]) + bias
            wij = 1 / (1 + torch.exp(-s))
            if keep is not None:
                wij = wij * keep[i, j]
            w[..., i, j] = wij
            out[..., i, :] += wij[..., None] * v[..., j, :]
    return out, w


@pytest.mark.parametrize("shape", SHAPES)
def test_sigmoid_matches_hand_computation_with_default_bias(shape):
    q, k, v = make(*shape)
    out, w = sigmoid_attention(q, k, v, return_weights=True)
    ref_out, ref_w = sigmoid_by_hand(q, k, v, -math.log(shape[2]))
    torch.testing.assert_close(w, ref_w, **TOL64)
    torch.testing.assert_close(out, ref_out, **TOL64)


def test_sigmoid_rows_do_not_sum_to_one_but_start_near_one():
    q, k, v = make((4, 2), 16, 64, 8, 8, seed=1)
    _, w = sigmoid_attention(q * 0, k, v, return_weights=True)  # zero scores: every weight is sigmoid(-log T)
    torch.testing.assert_close(w, torch.full_like(w, 1 / (1 + 64)), **TOL64)  # 1 / (1 + T): rows sum to T/(T+1)
    _, w = sigmoid_attention(q, k, v, return_weights=True)
    assert not torch.allclose(w.sum(-1), torch.ones(4, 2, 16, dtype=torch.float64), atol=1e-3)


def test_sigmoid_causal_and_masks_give_exact_zeros():
    q, k, v = make((2, 2), 6, 6, 4, 4)
    keep = torch.ones(6, 6, dtype=torch.bool).tril()
    out, w = sigmoid_attention(q, k, v, is_causal=True, bias=0.3, return_weights=True)
    ref_out, ref_w = sigmoid_by_hand(q, k, v, 0.3, keep)
    torch.testing.assert_close(out, ref_out, **TOL64)
    assert torch.equal(w == 0, ~keep.expand_as(w))
    for mask in (keep, torch.zeros(6, 6, dtype=torch.float64).masked_fill(~keep, float("-inf"))):
        torch.testing.assert_close(sigmoid_attention(q, k, v, mask, bias=0.3), out, **TOL64)
    none = torch.zeros(6, 6, dtype=torch.bool)  # fully masked rows: zeros, never NaN
    assert torch.equal(sigmoid_attention(q, k, v, none), torch.zeros_like(out))


def test_sigmoid_is_not_softmax_but_a_large_negative_bias_makes_weights_small():
    q, k, v = make((2,), 5, 9, 8, 8)
    _, w = sigmoid_attention(q, k, v, bias=-30.0, return_weights=True)
    assert w.max() < 1e-10


def test_sigmoid_gradcheck():
    q, k, v = (t.requires_grad_() for t in make((), 3, 4, 3, 2))
    assert torch.autograd.gradcheck(lambda q, k, v: sigmoid_attention(q, k, v, is_causal=True), (q, k, v))


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
def test_sigmoid_module_equals_functional_on_its_projections(n_kv_heads):
    torch.manual_seed(0)
    m = SigmoidAttention(24, 4, n_kv_heads).double()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    out, w = m(x, is_causal=True, return_weights=True)
    assert out.shape == (2, 7, 24) and w.shape == (2, 4, 7, 7)
    q, k, v = m.project_qkv(x)
    rep = 4 // m.n_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    ref = m.o_proj(merge_heads(sigmoid_attention(q, k, v, is_causal=True)))
    torch.testing.assert_close(out, ref, **TOL64)
    ctx = torch.randn(2, 5, 24, dtype=torch.float64)  # cross-attention: Tk = 5
    assert m(x, ctx).shape == (2, 7, 24)
    assert isinstance(m, MultiHeadAttention) and sum(p.numel() for p in m.parameters()) == \
        sum(p.numel() for p in MultiHeadAttention(24, 4, n_kv_heads).parameters())


def test_sigmoid_module_score_bias_and_gradients():
    torch.manual_seed(0)
    m = SigmoidAttention(16, 2, score_bias=-2.0)
    x = torch.randn(3, 5, 16, requires_grad=True)
    _, w = m(x, return_weights=True)
    q, k, _ = m.project_qkv(x)
    torch.testing.assert_close(w, torch.sigmoid(q @ k.transpose(-2, -1) / math.sqrt(8) - 2.0))
    m(x).sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in m.parameters())


def test_sigmoid_bad_input():
    q, k, v = make((2,), 3, 4, 5, 2)
    with pytest.raises(ValueError, match="query and key"):
        sigmoid_attention(q, k[..., :4], v)
    with pytest.raises(TypeError, match="bias"):
        sigmoid_attention(q, k, v, bias="log")
    with pytest.raises(ValueError, match=r"attn_mask of shape \(3, 3\)"):
        sigmoid_attention(q, k, v, torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="score_bias"):
        SigmoidAttention(8, 2, score_bias="x")


# ----------------------------------------------------------------------------- differential attention


def test_lambda_init_follows_the_paper():
    assert diff_lambda_init(1) == pytest.approx(0.2)
    assert diff_lambda_init(2) == pytest.approx(0.8 - 0.6 * math.exp(-0.3))
    assert diff_lambda_init(100) == pytest.approx(0.8, abs=1e-12)
    with pytest.raises(ValueError, match="layer"):
        diff_lambda_init(0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_differential_with_lambda_zero_is_softmax_attention(shape, is_causal):
    q1, q2, k1, k2, v = make(*shape, n_q=2, n_k=2)
    out = differential_attention(q1, k1, q2, k2, v, 0.0, is_causal=is_causal)
    torch.testing.assert_close(out, scaled_dot_product_attention(q1, k1, v, is_causal=is_causal), **TOL64)
    if not (is_causal and shape[1] > shape[2]):  # PyTorch gives NaN rows there
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q1, k1, v, is_causal=is_causal), **TOL64)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_differential_matches_difference_of_pytorch_maps(shape):
    q1, q2, k1, k2, v = make(*shape, n_q=2, n_k=2)
    lam = torch.tensor(0.37, dtype=torch.float64)
    out, w = differential_attention(q1, k1, q2, k2, v, lam, return_weights=True)
    a1 = torch.softmax(q1 @ k1.transpose(-2, -1) / math.sqrt(q1.shape[-1]), -1)
    a2 = torch.softmax(q2 @ k2.transpose(-2, -1) / math.sqrt(q2.shape[-1]), -1)
    torch.testing.assert_close(w, a1 - 0.37 * a2, **TOL64)
    torch.testing.assert_close(w.sum(-1), torch.full_like(w.sum(-1), 1 - 0.37), **TOL64)  # rows sum to 1 - lambda
    ref = F.scaled_dot_product_attention(q1, k1, v) - 0.37 * F.scaled_dot_product_attention(q2, k2, v)
    torch.testing.assert_close(out, ref, **TOL64)


def test_differential_gradcheck_including_lambda():
    q1, q2, k1, k2, v = make((), 2, 3, 3, 2, n_q=2, n_k=2)
    lam = torch.tensor(0.5, dtype=torch.float64)
    args = tuple(t.requires_grad_() for t in (q1, k1, q2, k2, v, lam))
    assert torch.autograd.gradcheck(lambda *a: differential_attention(*a, is_causal=True), args)


def diff_module_by_hand(m, x):
    """The reference code's forward, written out: adjacent head pairs, RMSNorm, (1 - lambda_init)."""
    b, t, dm = x.shape
    h, d = m.n_heads, m.head_dim
    q = m.q_proj(x).view(b, t, 2 * h, d).transpose(1, 2) / math.sqrt(d)
    k = m.k_proj(x).view(b, t, 2 * h, d).transpose(1, 2)
    v = m.v_proj(x).view(b, t, h, 2 * d).transpose(1, 2)
    a = torch.softmax(q @ k.transpose(-1, -2), -1).view(b, h, 2, t, t)
    lam = (torch.exp((m.lambda_q1 * m.lambda_k1).sum()) - torch.exp((m.lambda_q2 * m.lambda_k2).sum())
           + m.lambda_init)
    o = (a[:, :, 0] - lam * a[:, :, 1]) @ v
    o = F.rms_norm(o, (2 * d,), m.subln.weight, m.subln.eps) * (1 - m.lambda_init)
    return m.o_proj(o.transpose(1, 2).reshape(b, t, dm))


@pytest.mark.parametrize("d_model, n_heads, layer", [(16, 2, 1), (24, 3, 4), (8, 1, 2)])
def test_differential_module_equals_reference_forward(d_model, n_heads, layer):
    torch.manual_seed(0)
    m = DifferentialAttention(d_model, n_heads, layer=layer).double()
    assert m.head_dim == d_model // (2 * n_heads) and m.lambda_init == pytest.approx(diff_lambda_init(layer))
    x = torch.randn(2, 5, d_model, dtype=torch.float64)
    out, w = m(x, return_weights=True)
    assert out.shape == (2, 5, d_model) and w.shape == (2, n_heads, 5, 5)
    torch.testing.assert_close(out, diff_module_by_hand(m, x), **TOL64)


def test_differential_module_with_lambda_zero_is_normalised_softmax_attention():
    torch.manual_seed(0)
    m = DifferentialAttention(16, 2, lambda_init=0.0).double()
    with torch.no_grad():
        for p in (m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2):
            p.zero_()  # exp(0) - exp(0) + 0 = 0
    assert m.lam().item() == 0.0
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    q = split_heads(m.q_proj(x), 4)  # (B, 2H, T, d)
    k = split_heads(m.k_proj(x), 4)
    v = split_heads(m.v_proj(x), 2)  # (B, H, T, 2d)
    soft = F.scaled_dot_product_attention(q[:, 0::2], k[:, 0::2], v, is_causal=True)  # only the first maps
    ref = m.o_proj(merge_heads(F.rms_norm(soft, (8,), m.subln.weight, 1e-5)))  # scale 1 - 0 = 1
    torch.testing.assert_close(m(x, is_causal=True), ref, **TOL64)


def test_differential_module_parameters_and_gradients():
    torch.manual_seed(0)
    m = DifferentialAttention(32, 2)
    n = sum(p.numel() for p in m.parameters())
    assert n == 4 * 32 * 32 + 4 * 8 + 2 * 8
    assert n - sum(p.numel() for p in MultiHeadAttention(32, 4).parameters()) == 6 * 8
    x = torch.randn(2, 5, 32, requires_grad=True)
    m(x, is_causal=True).pow(2).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    assert m.lambda_q1.grad.abs().sum() > 0  # lambda is learned


def test_differential_module_cross_attention_and_masks():
    torch.manual_seed(0)
    m = DifferentialAttention(16, 2).double()
    x, ctx = torch.randn(2, 3, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    out, w = m(x, ctx, return_weights=True)
    assert out.shape == (2, 3, 16) and w.shape == (2, 2, 3, 7)
    keep = torch.ones(3, 7, dtype=torch.bool)
    keep[:, 4:] = False
    _, w = m(x, ctx, attn_mask=keep, return_weights=True)
    assert torch.equal(w[..., 4:], torch.zeros_like(w[..., 4:]))


def test_differential_bad_input():
    q1, q2, k1, k2, v = make((2,), 3, 4, 5, 6, n_q=2, n_k=2)
    with pytest.raises(ValueError, match="q1/q2"):
        differential_attention(q1, k1, q2[..., :4], k2[..., :4], v, 0.5)
    with pytest.raises(ValueError, match="lam"):
        differential_attention(q1, k1, q2, k2, v, torch.ones(2))
    with pytest.raises(TypeError, match="lam"):
        differential_attention(q1, k1, q2, k2, v, "0.5")
    with pytest.raises(ValueError, match="divisible by 2 \\* n_heads"):
        DifferentialAttention(12, 4)
    with pytest.raises(ValueError, match=r"x must be \(B, T, d_model=16\)"):
        DifferentialAttention(16, 2)(torch.randn(2, 3, 8))
    with pytest.raises(TypeError, match="n_heads"):
        DifferentialAttention(16, 2.0)


def test_differential_one_value_matmul_equals_two_attention_calls_and_masks_both_maps():
    q1, q2, k1, k2, v = make((2, 3), 6, 6, 4, 8, seed=5, n_q=2, n_k=2)
    for causal in (False, True):
        two_calls = (F.scaled_dot_product_attention(q1, k1, v, is_causal=causal)
                     - 0.7 * F.scaled_dot_product_attention(q2, k2, v, is_causal=causal))
        out, w = differential_attention(q1, k1, q2, k2, v, 0.7, is_causal=causal, return_weights=True)
        torch.testing.assert_close(out, two_calls, **TOL64)
        torch.testing.assert_close(out, w @ v, **TOL64)  # the package multiplies the values once
    none = torch.zeros(6, 6, dtype=torch.bool)  # fully masked rows: zeros, never NaN
    assert torch.equal(differential_attention(q1, k1, q2, k2, v, 0.7, none), torch.zeros(2, 3, 6, 8, dtype=v.dtype))
    with pytest.raises(TypeError, match="dtype"):
        differential_attention(q1.float(), k1, q2, k2, v, 0.7)
