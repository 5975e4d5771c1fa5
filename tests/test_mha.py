"""MultiHeadAttention and repeat_kv against PyTorch: SDPA with enable_gqa, nn.MultiheadAttention, masks,
the KV-cache protocol, gradients, parameter counts and bad input."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attncourse.mha import MultiHeadAttention, merge_heads, repeat_kv, split_heads

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def make_x(b, t, d, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, d, generator=g, dtype=torch.float64).to(dtype)


def make_mha(d, h, hkv=None, bias=False, seed=0):
    torch.manual_seed(seed)
    return MultiHeadAttention(d, h, hkv, bias=bias).double()


def reference(m: MultiHeadAttention, x, context=None, **kw):
    """PyTorch's fused kernel with enable_gqa on the module's own projections."""
    src = x if context is None else context
    b, t, _ = x.shape
    s = src.shape[1]
    q = m.q_proj(x).view(b, t, m.n_heads, m.head_dim).transpose(1, 2)
    k = m.k_proj(src).view(b, s, m.n_kv_heads, m.head_dim).transpose(1, 2)
    v = m.v_proj(src).view(b, s, m.n_kv_heads, m.head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    return m.o_proj(out.transpose(1, 2).reshape(b, t, m.d_model))


class ListCache:
    """A tiny stand-in for chapter 07's KVCache: concatenates along the time dim."""

    def __init__(self):
        self.k, self.v = [], []

    def update(self, k, v):
        self.k.append(k)
        self.v.append(v)
        return torch.cat(self.k, dim=-2), torch.cat(self.v, dim=-2)


# ---------------------------------------------------------------- repeat_kv, split/merge heads


@pytest.mark.parametrize("n_rep", [1, 2, 3, 5])
def test_repeat_kv_matches_repeat_interleave(n_rep):
    x = torch.randn(2, 3, 7, 4)
    out = repeat_kv(x, n_rep)
    assert out.shape == (2, 3 * n_rep, 7, 4)
    torch.testing.assert_close(out, x.repeat_interleave(n_rep, dim=1), rtol=0, atol=0)
    for h in range(3):  # KV head h serves query heads h*n_rep .. h*n_rep + n_rep - 1
        for j in range(n_rep):
            assert torch.equal(out[:, h * n_rep + j], x[:, h])


def test_repeat_kv_gradient():
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    repeat_kv(x, 3).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


@pytest.mark.parametrize("bad, err", [(torch.randn(2, 3, 4), ValueError), ([1.0], TypeError)])
def test_repeat_kv_bad_input(bad, err):
    with pytest.raises(err, match="x"):
        repeat_kv(bad, 2)
    with pytest.raises(ValueError, match="n_rep"):
        repeat_kv(torch.randn(1, 2, 3, 4), 0)


def test_split_merge_roundtrip():
    x = torch.randn(2, 5, 12)
    h = split_heads(x, 3)
    assert h.shape == (2, 3, 5, 4)
    torch.testing.assert_close(h[:, 1], x[..., 4:8], rtol=0, atol=0)  # head 1 = features 4..7
    torch.testing.assert_close(merge_heads(h), x, rtol=0, atol=0)
    with pytest.raises(ValueError, match="n_heads=5"):
        split_heads(x, 5)
    with pytest.raises(ValueError, match=r"x must have .*\(2, 5, 12\)"):
        merge_heads(x)


# ---------------------------------------------------------------- module against PyTorch


@pytest.mark.parametrize("h, hkv", [(4, None), (4, 4), (4, 2), (4, 1), (6, 3), (6, 2)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_sdpa_enable_gqa(h, hkv, is_causal):
    m = make_mha(24, h, hkv)
    x = make_x(2, 7, 24)
    torch.testing.assert_close(m(x, is_causal=is_causal), reference(m, x, is_causal=is_causal),
                               **TOL[torch.float64])


@pytest.mark.parametrize("s", [1, 5, 11])
def test_cross_attention(s):
    m = make_mha(16, 4, 2, bias=True)
    x, ctx = make_x(3, 6, 16, seed=1), make_x(3, s, 16, seed=2)
    out, w = m(x, ctx, return_weights=True)
    assert out.shape == (3, 6, 16) and w.shape == (3, 4, 6, s)
    torch.testing.assert_close(out, reference(m, x, ctx), **TOL[torch.float64])
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 4, 6, dtype=torch.float64))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("s", [6, 9])
def test_matches_nn_multihead_attention(bias, s):
    d, h = 20, 4
    m = make_mha(d, h, bias=bias)
    ref = nn.MultiheadAttention(d, h, bias=bias, batch_first=True).double()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]))
        ref.out_proj.weight.copy_(m.o_proj.weight)
        if bias:
            ref.in_proj_bias.copy_(torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias]))
            ref.out_proj.bias.copy_(m.o_proj.bias)
    x, ctx = make_x(2, 6, d), make_x(2, s, d, seed=3)
    mask = torch.rand(6, s, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[:, 0] = True  # PyTorch gives NaN on fully masked rows; keep one key per row
    out, w = m(x, ctx, attn_mask=mask, return_weights=True)
    # nn.MultiheadAttention's boolean mask is True where attention is *not* allowed
    ref_out, ref_w = ref(x, ctx, ctx, attn_mask=~mask, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float64])
    torch.testing.assert_close(w, ref_w, **TOL[torch.float64])


@pytest.mark.parametrize("d, h, hkv, bias, expected", [
    (64, 8, None, False, 4 * 64 * 64),
    (64, 8, None, True, 4 * 64 * 64 + 4 * 64),
    (64, 8, 2, False, 2 * 64 * 64 + 2 * 64 * 16),
    (64, 8, 1, False, 2 * 64 * 64 + 2 * 64 * 8),
    (512, 8, 4, True, 2 * 512 * 512 + 2 * 512 * 256 + 2 * 512 + 2 * 256),
])
def test_parameter_count(d, h, hkv, bias, expected):
    m = MultiHeadAttention(d, h, hkv, bias=bias)
    assert sum(p.numel() for p in m.parameters()) == expected
    assert m.k_proj.out_features == m.v_proj.out_features == m.n_kv_heads * m.head_dim


# ---------------------------------------------------------------- masks


def test_boolean_and_float_masks_agree():
    m = make_mha(16, 4, 2)
    x = make_x(2, 5, 16)
    keep = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(1)) > 0.4
    keep[..., 0] = True
    additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(m(x, attn_mask=keep), m(x, attn_mask=additive), **TOL[torch.float64])
    torch.testing.assert_close(m(x, attn_mask=keep), reference(m, x, attn_mask=keep), **TOL[torch.float64])


def test_per_head_float_bias():
    """A float mask of shape (H, T, S), e.g. an ALiBi bias, is added per head."""
    m = make_mha(16, 4, 1)
    x = make_x(2, 6, 16)
    bias = torch.randn(4, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(m(x, attn_mask=bias, is_causal=True),
                               reference(m, x, attn_mask=bias + torch.zeros(6, 6, dtype=torch.float64)
                                         .masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))),
                               **TOL[torch.float64])


def test_causal_output_ignores_future():
    m = make_mha(16, 4, 2)
    x = make_x(1, 8, 16)
    y = x.clone()
    y[:, 5:] += 1.0  # change the future
    torch.testing.assert_close(m(x, is_causal=True)[:, :5], m(y, is_causal=True)[:, :5], **TOL[torch.float64])
    assert not torch.allclose(m(x)[:, :5], m(y)[:, :5])


# ---------------------------------------------------------------- KV-cache protocol


@pytest.mark.parametrize("hkv", [4, 2, 1])
@pytest.mark.parametrize("chunks", [[1] * 7, [3, 1, 1, 2], [4, 3]])
def test_kv_cache_decode_equals_full_forward(hkv, chunks):
    m = make_mha(16, 4, hkv)
    x = make_x(2, sum(chunks), 16)
    full = m(x, is_causal=True)
    cache, outs, start = ListCache(), [], 0
    for n in chunks:  # prefill with the first chunk, then decode the rest
        outs.append(m(x[:, start:start + n], is_causal=True, kv_cache=cache))
        start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TOL[torch.float64])


@pytest.mark.parametrize("hkv", [2, 1])
def test_gqa_decode_reads_the_cache_without_copying_it(hkv, monkeypatch):
    """Decode goes through the grouped form: repeat_kv is never called and the scores hold Hkv groups."""
    import attncourse.mha as mha_module
    from attncourse.kv_cache import KVCache

    def refuse(*a, **k):
        raise AssertionError("repeat_kv called: the cache would be copied n_rep times")

    seen = []

    def spy(q, k, v, *a, **kw):
        seen.append((k.shape[1], k.data_ptr(), v.data_ptr()))
        return grouped(q, k, v, *a, **kw)

    grouped = mha_module.grouped_attention
    monkeypatch.setattr(mha_module, "repeat_kv", refuse)
    monkeypatch.setattr(mha_module, "grouped_attention", spy)
    m = make_mha(16, 4, hkv)
    x = make_x(2, 9, 16)
    full = m(x, is_causal=True)
    cache = KVCache(2, hkv, 4, 9, dtype=torch.float64)
    seen.clear()
    outs = [m(x[:, :5], is_causal=True, kv_cache=cache)] + [
        m(x[:, t:t + 1], is_causal=True, kv_cache=cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TOL[torch.float64])
    # every step attended over the cache's own storage (same pointers), Hkv heads wide
    assert seen == [(hkv, cache.k.data_ptr(), cache.v.data_ptr())] * 5


def test_kv_cache_with_extra_mask_and_weights():
    m = make_mha(16, 4, 2)
    x = make_x(1, 6, 16)
    keep = torch.ones(6, 6, dtype=torch.bool)
    keep[:, 1] = False  # nobody may attend to position 1 (except position 0's row keeps key 0)
    full = m(x, attn_mask=keep, is_causal=True)
    cache = ListCache()
    m(x[:, :4], attn_mask=keep[:4, :4], is_causal=True, kv_cache=cache)
    out, w = m(x[:, 4:], attn_mask=keep[4:, :6], is_causal=True, kv_cache=cache, return_weights=True)
    assert w.shape == (1, 4, 2, 6)
    assert torch.all(w[..., 1] == 0) and torch.all(w[:, :, 0, 5] == 0)  # query 4 cannot see key 5
    torch.testing.assert_close(out, full[:, 4:], **TOL[torch.float64])


# ---------------------------------------------------------------- gradients, dtypes


def test_gradients_match_reference():
    m = make_mha(12, 6, 2, bias=True)
    x = make_x(2, 5, 12).requires_grad_(True)
    m(x, is_causal=True).pow(2).sum().backward()
    ours = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad()
    reference(m, x, is_causal=True).pow(2).sum().backward()
    theirs = [x.grad] + [p.grad for p in m.parameters()]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


def test_gradcheck():
    m = make_mha(8, 4, 2)
    x = make_x(1, 3, 8).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: m(t, is_causal=True), (x,))


def test_float32():
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 8, 2)
    x = torch.randn(2, 9, 32)
    out = m(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference(m, x), **TOL[torch.float32])


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("args, err, match", [
    ((30, 4), ValueError, "d_model=30"),
    ((32, 8, 3), ValueError, "n_kv_heads=3"),
    ((32, 4, 8), ValueError, "n_kv_heads=8"),
    ((32, 0), ValueError, "n_heads"),
    ((32, 4, 0), ValueError, "n_kv_heads"),
    ((32.0, 4), TypeError, "d_model"),
    ((32, True), TypeError, "n_heads"),
])
def test_constructor_rejects(args, err, match):
    with pytest.raises(err, match=match):
        MultiHeadAttention(*args)


def test_forward_rejects():
    m = MultiHeadAttention(16, 4, 2)
    with pytest.raises(ValueError, match=r"x must be .*\(5, 16\)"):
        m(torch.randn(5, 16))  # wrong rank
    with pytest.raises(ValueError, match=r"x must be .*\(2, 5, 12\)"):
        m(torch.randn(2, 5, 12))  # wrong width
    with pytest.raises(ValueError, match=r"context must be .*\(2, 5, 8\)"):
        m(torch.randn(2, 5, 16), torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="batch"):
        m(torch.randn(2, 5, 16), torch.randn(3, 5, 16))
    with pytest.raises(TypeError, match="x"):
        m(torch.randint(0, 3, (2, 5, 16)))
    with pytest.raises(ValueError, match="attn_mask"):
        m(torch.randn(2, 5, 16), attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask"):
        m(torch.randn(2, 5, 16), attn_mask=[[True]])
