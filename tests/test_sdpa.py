"""scaled_dot_product_attention against PyTorch's kernel: shapes, masks, dtypes, gradients, bad input."""

import math

import pytest
import torch
import torch.nn.functional as F

from attncourse import causal_mask, safe_softmax, scaled_dot_product_attention

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6),
       torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

SHAPES = [  # (lead dims, Tq, Tk, D, Dv)
    ((2, 3), 5, 5, 8, 8),
    ((2, 3), 5, 7, 8, 4),      # Tq != Tk, Dv != D
    ((1, 1), 1, 13, 16, 16),   # one query
    ((3,), 11, 2, 4, 6),       # more queries than keys, 3-D tensors
    ((2, 2, 2), 3, 17, 8, 8),  # 5-D: any leading dims
    ((), 7, 7, 5, 3),          # 2-D, prime sizes
]


def make(lead, tq, tk, d, dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, tq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(*lead, tk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(*lead, tk, dv, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_pytorch(shape, is_causal):
    q, k, v = make(*shape)
    if is_causal and shape[1] > shape[2]:
        pytest.skip("PyTorch gives NaN rows there; covered by test_causal_more_queries_than_keys")
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, is_causal=is_causal),
                               F.scaled_dot_product_attention(q, k, v, is_causal=is_causal), **TOL[q.dtype])


def test_causal_more_queries_than_keys():
    q, k, v = make((2,), 6, 3, 4, 4)
    out, w = scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    # top-left alignment: query i sees keys 0..i, so every row here has at least key 0
    assert torch.equal(w > 0, torch.ones(6, 3, dtype=torch.bool).tril().expand(2, 6, 3))
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 6, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_dtypes(dtype):
    q, k, v = make((2, 4), 9, 6, 16, 16, dtype=dtype)
    out = scaled_dot_product_attention(q, k, v)
    assert out.dtype == dtype
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("mask_shape", [(5, 7), (1, 1, 5, 7), (2, 1, 1, 7), (2, 3, 5, 7)])
def test_boolean_and_float_masks(mask_shape):
    q, k, v = make((2, 3), 5, 7, 8, 8)
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(*mask_shape, generator=g) > 0.3
    keep[..., 0] = True  # no fully masked rows here: PyTorch agrees exactly then
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, keep),
                               F.scaled_dot_product_attention(q, k, v, keep), **TOL[q.dtype])
    bias = torch.randn(*mask_shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, bias),
                               F.scaled_dot_product_attention(q, k, v, bias), **TOL[q.dtype])


def test_mask_and_causal_together():
    q, k, v = make((2, 3), 6, 6, 8, 8)
    keep = torch.tensor([True] * 4 + [False] * 2).expand(6, 6)
    got = scaled_dot_product_attention(q, k, v, keep, is_causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, keep & causal_mask(6, 6))
    torch.testing.assert_close(got, ref, **TOL[q.dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_fully_masked_rows_give_zeros(dtype):
    q, k, v = make((2, 2), 4, 5, 8, 8, dtype=dtype)
    keep = torch.ones(2, 2, 4, 5, dtype=torch.bool)
    keep[0, 1, 2] = False
    keep[1, :, 0] = False
    out, w = scaled_dot_product_attention(q, k, v, keep, return_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    assert (out[0, 1, 2] == 0).all() and (w[0, 1, 2] == 0).all()
    assert (out[1, :, 0] == 0).all()
    rows = keep.any(-1)
    torch.testing.assert_close(w.sum(-1)[rows].double(), torch.ones(int(rows.sum()), dtype=torch.float64),
                               **TOL[dtype])
    # PyTorch's own kernel also returns zeros there
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, keep), **TOL[dtype])


def test_float_mask_with_all_inf_row():
    q, k, v = make((1,), 3, 4, 4, 4)
    bias = torch.zeros(3, 4, dtype=torch.float64)
    bias[1] = float("-inf")
    out = scaled_dot_product_attention(q, k, v, bias)
    assert (out[0, 1] == 0).all() and torch.isfinite(out).all()


def test_scale_and_weights():
    q, k, v = make((2,), 4, 6, 8, 3)
    out, w = scaled_dot_product_attention(q, k, v, scale=0.3, return_weights=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.3))
    torch.testing.assert_close(w, torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1))
    torch.testing.assert_close(w @ v, out)


def test_default_scale_is_inverse_sqrt_d():
    q, k, v = make((), 3, 3, 9, 2)
    _, w = scaled_dot_product_attention(q, k, v, return_weights=True)
    torch.testing.assert_close(w, torch.softmax(q @ k.T / math.sqrt(9), -1))


def test_gradients_match_pytorch():
    q, k, v = (x.requires_grad_() for x in make((2, 2), 5, 7, 4, 4))
    keep = torch.rand(5, 7, generator=torch.Generator().manual_seed(2)) > 0.4
    keep[:, 0] = True
    grads = torch.autograd.grad(scaled_dot_product_attention(q, k, v, keep).square().sum(), (q, k, v))
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, keep).square().sum(), (q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)
    assert torch.autograd.gradcheck(lambda a, b, c: scaled_dot_product_attention(a, b, c, keep, is_causal=True),
                                    (q, k, v))


def test_gradients_finite_on_fully_masked_row():
    q, k, v = (x.requires_grad_() for x in make((1,), 3, 4, 4, 4))
    keep = torch.ones(3, 4, dtype=torch.bool)
    keep[1] = False
    scaled_dot_product_attention(q, k, v, keep).sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    assert (q.grad[0, 1] == 0).all()


def test_safe_softmax():
    x = torch.tensor([[1.0, 2.0, 3.0], [float("-inf")] * 3, [1000.0, 1000.0, float("-inf")]])
    y = safe_softmax(x)
    torch.testing.assert_close(y[0], torch.softmax(x[0], -1))
    assert (y[1] == 0).all()
    torch.testing.assert_close(y[2], torch.tensor([0.5, 0.5, 0.0]))
    torch.testing.assert_close(safe_softmax(x[:1], dim=0), torch.ones(1, 3))


@pytest.mark.parametrize("bad, exc, words", [
    (lambda q, k, v: (q[0, 0, 0], k, v), ValueError, "query must have at least 2 dims"),
    (lambda q, k, v: (q, k[..., :3], v), ValueError, "share the last"),
    (lambda q, k, v: (q, k, v[..., :2, :]), ValueError, "same length"),
    (lambda q, k, v: (q, k[0], v[0]), ValueError, "same rank"),
    (lambda q, k, v: (q, torch.cat([k, k], 0), v), ValueError, "do not broadcast"),
    (lambda q, k, v: (q.float(), k, v), TypeError, "share a dtype"),
    (lambda q, k, v: (q.numpy(), k, v), TypeError, "query must be a torch.Tensor"),
    (lambda q, k, v: (q.long(), k.long(), v.long()), TypeError, "floating-point"),
])
def test_bad_input(bad, exc, words):
    q, k, v = make((2, 3), 5, 7, 8, 8)
    with pytest.raises(exc, match=words):
        scaled_dot_product_attention(*bad(q, k, v))


def test_bad_masks():
    q, k, v = make((2, 3), 5, 7, 8, 8)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(5, 6\) does not broadcast to scores \(2, 3, 5, 7\)"):
        scaled_dot_product_attention(q, k, v, torch.ones(5, 6, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool or floating"):
        scaled_dot_product_attention(q, k, v, torch.ones(5, 7, dtype=torch.long))
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor"):
        scaled_dot_product_attention(q, k, v, [[True]])


def test_key_padding_mask_against_pytorch_and_multihead_attention():
    from attncourse.sdpa import key_padding_mask

    lengths = torch.tensor([5, 2, 0])
    keep = key_padding_mask(lengths, 5)
    assert keep.shape == (3, 1, 1, 5) and keep.dtype == torch.bool
    assert keep[:, 0, 0].sum(-1).tolist() == [5, 2, 0]
    q, k, v = make((3, 2), 4, 5, 8, 8)
    ours = scaled_dot_product_attention(q, k, v, keep)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, keep))
    assert (ours[2] == 0).all()  # no key at all: zeros, as PyTorch's kernel since 2.5
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 1, batch_first=True, bias=False).double()
    x, ctx = torch.randn(3, 4, 8, dtype=torch.float64), torch.randn(3, 5, 8, dtype=torch.float64)
    theirs, _ = mha(x, ctx, ctx, key_padding_mask=~keep[:, 0, 0])  # PyTorch's polarity: True = padding
    w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
    heads = scaled_dot_product_attention(x @ w_q.T, ctx @ w_k.T, ctx @ w_v.T, keep[:, 0])  # (B, T, D), one head
    torch.testing.assert_close(heads[:2] @ mha.out_proj.weight.T, theirs[:2])
    assert torch.isnan(theirs[2]).all()  # nn.MultiheadAttention: NaN where a query may see no key
    with pytest.raises(ValueError, match="lengths"):
        key_padding_mask(torch.tensor([6]), 5)
    with pytest.raises(ValueError, match="lengths"):
        key_padding_mask(torch.tensor([1.0]), 5)
