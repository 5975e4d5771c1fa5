"""RoPE: against a complex-number reference and the halves formulation (rotate_half), the relative property,
the permutation between layouts, scalings against the published formulas (Hugging Face transformers'
modeling_rope_utils, transcribed independently), RoPE inside MultiHeadAttention and the tiny GPT
(cached decode == full forward), bad input."""

import math

import pytest
import torch

from attncourse.gpt import GPT, GPTConfig
from attncourse.kv_cache import KVCache, SinkWindowCache
from attncourse.mha import MultiHeadAttention
from attncourse.positions import (apply_rope, rope_attention_factor, rope_inv_freq, rope_permutation)


def complex_rope(x, positions, base=10000.0):
    """Su et al.'s form: pairs (2i, 2i+1) as complex numbers, times exp(i t theta_i). float64 reference."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (D/2,)
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())  # (..., T, D/2)
    rot = torch.polar(torch.ones_like(theta), positions.double()[..., None] * theta)  # (..., T, D/2)
    return torch.view_as_real(z * rot).flatten(-2)  # (..., T, D)


def rotate_half_rope(x, positions, inv_freq, angle_dtype=torch.float64):
    """GPT-NeoX / Hugging Face: x * cos + rotate_half(x) * sin with cos, sin repeated over both halves."""
    angle = (positions.to(angle_dtype)[..., None] * inv_freq.to(angle_dtype)).double()  # (T, D/2)
    emb = torch.cat([angle, angle], dim=-1)  # (T, D)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    rotate_half = torch.cat([-x2, x1], dim=-1)
    return x * emb.cos() + rotate_half * emb.sin()


@pytest.mark.parametrize("d", [2, 8, 64])
@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_pairs_layout_equals_complex_reference(d, base):
    x = torch.randn(2, 3, 11, d, dtype=torch.float64)
    pos = torch.arange(5, 16)
    torch.testing.assert_close(apply_rope(x, pos, base=base, interleaved=True), complex_rope(x, pos, base))


@pytest.mark.parametrize("d", [2, 6, 128])
def test_halves_layout_equals_rotate_half(d):
    x = torch.randn(3, 13, d, dtype=torch.float64)
    pos = torch.randint(0, 4000, (13,))
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    torch.testing.assert_close(apply_rope(x, pos), rotate_half_rope(x, pos, inv_freq))


def test_layouts_are_one_permutation_apart():
    d = 16
    perm = rope_permutation(d)
    assert sorted(perm.tolist()) == list(range(d)) and perm[:3].tolist() == [0, 2, 4] and perm[d // 2] == 1
    x = torch.randn(2, 9, d, dtype=torch.float64)
    pos = torch.arange(9)
    torch.testing.assert_close(apply_rope(x, pos, interleaved=True)[..., perm], apply_rope(x[..., perm], pos))
    # scores are the same attention: q.k is invariant under the same permutation of both
    q, k = torch.randn(9, d, dtype=torch.float64), torch.randn(9, d, dtype=torch.float64)
    s_pairs = apply_rope(q, pos, interleaved=True) @ apply_rope(k, pos, interleaved=True).T
    s_halves = apply_rope(q[:, perm], pos) @ apply_rope(k[:, perm], pos).T
    torch.testing.assert_close(s_pairs, s_halves)
    # mixing layouts up (pairs checkpoint run with halves rotation) changes the scores
    s_mixed = apply_rope(q, pos) @ apply_rope(k, pos).T
    assert (s_mixed - s_pairs).abs().max() > 0.1


@pytest.mark.parametrize("interleaved", [False, True])
def test_scores_depend_only_on_offset(interleaved):
    d = 32
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    score = {}
    for m, n in [(7, 3), (104, 100), (2004, 2000), (3, 7), (100, 104)]:
        qm = apply_rope(q[None], torch.tensor([m]), interleaved=interleaved)[0]
        kn = apply_rope(k[None], torch.tensor([n]), interleaved=interleaved)[0]
        score.setdefault(m - n, []).append(float(qm @ kn))
    for vals in score.values():
        assert max(vals) - min(vals) < 1e-9
    assert abs(score[4][0] - score[-4][0]) > 1e-6  # but the sign of the offset matters


def test_rotation_keeps_norms_and_position_zero_is_identity():
    x = torch.randn(4, 10, 24)
    torch.testing.assert_close(apply_rope(x).norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(apply_rope(x, torch.zeros(10, dtype=torch.long)), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtype_and_shape_kept_angles_in_float32(dtype):
    x = torch.randn(2, 5, 3000, 16).to(dtype)[:, :, -7:]  # (2, 5, 7, 16), non-contiguous slice
    pos = torch.arange(60000, 60007)  # large positions: float16 angles would be wrong
    out = apply_rope(x, pos)
    assert out.dtype == dtype and out.shape == x.shape
    ref = rotate_half_rope(x.double(), pos, rope_inv_freq(16), torch.float32)  # angles as the spec says
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol * 8, rtol=tol * 4)


def test_positions_broadcast_per_batch():
    x = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 3], [10, 11, 12, 13]])[:, None]  # (B, 1, T)
    out = apply_rope(x, pos)
    torch.testing.assert_close(out[1], apply_rope(x[1], torch.arange(10, 14)))
    torch.testing.assert_close(out[0], apply_rope(x[0]))


def test_rope_gradient():
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, interleaved=True), (x,))
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, torch.arange(3, 8)), (x,))


@pytest.mark.parametrize("bad,err,match", [
    (dict(x=torch.randn(4, 7)), ValueError, "even"),
    (dict(x=torch.randn(7)), ValueError, "x"),
    (dict(x=torch.arange(8).view(2, 4)), TypeError, "x"),
    (dict(x=torch.randn(3, 4), positions=torch.arange(3.0)), TypeError, "positions"),
    (dict(x=torch.randn(3, 4), positions=torch.arange(4)), ValueError, "positions"),
    (dict(x=torch.randn(3, 4), inv_freq=torch.ones(3)), ValueError, "inv_freq"),
    (dict(x=[1.0, 2.0]), TypeError, "x"),
])
def test_apply_rope_rejects(bad, err, match):
    with pytest.raises(err, match=match):
        apply_rope(**bad)


# ---- scalings, against the published formulas ----------------------------------------------------------

def hf_default(dim, base):
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def hf_yarn(dim, base, factor, original_max, beta_fast=32, beta_slow=1):
    """transformers' _compute_yarn_parameters (truncate=True), transcribed once in the 06-yarn-frequencies check:
    the frequencies and the attention factor."""
    from attncourse.classroom.checks.ch06_extension import _hf_yarn_inv_freq

    return _hf_yarn_inv_freq(dim, base, factor, original_max, beta_fast, beta_slow), 0.1 * math.log(factor) + 1.0


@pytest.mark.parametrize("dim,base", [(64, 10000.0), (128, 500000.0), (16, 10000.0)])
def test_default_linear_ntk(dim, base):
    f = rope_inv_freq(dim, base)
    assert f.shape == (dim // 2,) and f.dtype == torch.float32
    torch.testing.assert_close(f, hf_default(dim, base))
    torch.testing.assert_close(rope_inv_freq(dim, base, scaling={"type": "linear", "factor": 4.0}),
                               hf_default(dim, base) / 4)
    ntk = rope_inv_freq(dim, base, scaling={"type": "ntk", "factor": 8})
    torch.testing.assert_close(ntk, hf_default(dim, base * 8 ** (dim / (dim - 2))))
    torch.testing.assert_close(ntk[0], f[0])  # the fastest dim is not touched
    torch.testing.assert_close(ntk[-1], f[-1] / 8)  # the slowest is interpolated by the full factor


@pytest.mark.parametrize("dim,base,factor,L", [(64, 10000.0, 4.0, 256), (128, 10000.0, 16, 4096),
                                                (128, 500000.0, 8, 8192), (8, 10000.0, 2, 64)])
def test_yarn_matches_transformers(dim, base, factor, L):
    got = rope_inv_freq(dim, base, scaling={"type": "yarn", "factor": factor, "original_max_position": L})
    want, att = hf_yarn(dim, base, factor, L)
    torch.testing.assert_close(got, want)
    assert rope_attention_factor({"type": "yarn", "factor": factor, "original_max_position": L}) == \
        pytest.approx(att)
    plain = rope_inv_freq(dim, base)
    assert torch.all((got <= plain * (1 + 1e-6)) & (got >= plain / factor * (1 - 1e-6)))


def test_yarn_betas_and_attention_factor():
    cfg = {"type": "yarn", "factor": 4, "original_max_position": 512, "beta_fast": 16, "beta_slow": 2}
    torch.testing.assert_close(rope_inv_freq(32, scaling=cfg), hf_yarn(32, 10000.0, 4, 512, 16, 2)[0])
    assert rope_attention_factor(None) == 1.0 and rope_attention_factor({"type": "linear", "factor": 4}) == 1.0
    assert rope_attention_factor({**cfg, "factor": 1}) == 1.0
    assert rope_attention_factor({**cfg, "factor": 32}) == pytest.approx(1 + 0.1 * math.log(32))


@pytest.mark.parametrize("scaling,err", [
    ({"type": "dynamic", "factor": 2}, ValueError), ({"factor": 2}, ValueError),
    ({"type": "linear"}, ValueError), ({"type": "yarn", "factor": 2}, ValueError),
    ({"type": "linear", "factor": 2, "original_max_position": 8}, ValueError),
    ({"type": "linear", "factor": -1}, ValueError), ("linear", TypeError),
])
def test_scaling_rejects(scaling, err):
    with pytest.raises(err, match="scaling"):
        rope_inv_freq(16, scaling=scaling)


def test_yarn_ramp_is_the_ramp_of_the_yarn_frequencies():
    from attncourse.positions import yarn_ramp
    theta = rope_inv_freq(32, 10000.0)
    ramp = yarn_ramp(32, 10000.0, 512, 16, 2)  # 0: keep theta_i, 1: theta_i / s
    assert ramp[0] == 0 and ramp[-1] == 1 and bool((ramp.diff() >= 0).all())
    torch.testing.assert_close(theta * (1 - ramp) + theta / 4 * ramp, hf_yarn(32, 10000.0, 4, 512, 16, 2)[0])
    for kwargs, name in (({"head_dim": 7}, "head_dim"), ({"base": 1.0}, "base"), ({"original_max": 0}, "original_max"),
                         ({"beta_fast": -1}, "beta_fast"), ({"beta_slow": 40}, "beta_slow")):
        with pytest.raises(ValueError, match=name):
            yarn_ramp(**{"head_dim": 16, "base": 10000.0, "original_max": 64, **kwargs})


def test_inv_freq_rejects():
    with pytest.raises(ValueError, match="head_dim"):
        rope_inv_freq(7)
    with pytest.raises(ValueError, match="base"):
        rope_inv_freq(8, base=0.5)


# ---- RoPE inside attention -------------------------------------------------------------------------

def rope_attention_reference(m, x):
    """Full causal forward written out: project, rotate at 0..T-1 (halves), causal softmax, project."""
    b, t, _ = x.shape
    q = m.q_proj(x).view(b, t, m.n_heads, m.head_dim).transpose(1, 2)
    k = m.k_proj(x).view(b, t, m.n_kv_heads, m.head_dim).transpose(1, 2).repeat_interleave(m.n_rep, 1)
    v = m.v_proj(x).view(b, t, m.n_kv_heads, m.head_dim).transpose(1, 2).repeat_interleave(m.n_rep, 1)
    pos = torch.arange(t)
    q, k = (rotate_half_rope(z, pos, m.inv_freq) * m.rope_factor for z in (q, k))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return m.o_proj(out.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("hkv", [4, 2, 1])
@pytest.mark.parametrize("scaling", [None, {"type": "yarn", "factor": 4, "original_max_position": 16}])
def test_mha_rope_matches_reference_and_cached_decode(hkv, scaling):
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, hkv, rope_base=10000.0, rope_scaling=scaling).double()
    x = torch.randn(2, 19, 32, dtype=torch.float64)
    full = m(x, is_causal=True)
    torch.testing.assert_close(full, rope_attention_reference(m, x))
    cache = KVCache(2, hkv, 8, 19, dtype=torch.float64)
    outs = [m(x[:, :6], is_causal=True, kv_cache=cache)]
    outs += [m(x[:, t:t + 1], is_causal=True, kv_cache=cache) for t in range(6, 19)]
    torch.testing.assert_close(torch.cat(outs, 1), full)


def test_mha_rope_is_position_aware_and_off_by_default():
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 2)
    assert m.rope_base is None and m.inv_freq is None
    m.set_rope(10000.0)
    x = torch.randn(1, 6, 16)
    perm = torch.tensor([1, 0, 2, 3, 4, 5])
    # without positions, swapping tokens 0 and 1 would only swap outputs; with RoPE it does not
    assert not torch.allclose(m(x)[:, perm], m(x[:, perm]), atol=1e-5)
    m.set_rope(None)
    torch.testing.assert_close(m(x)[:, perm], m(x[:, perm]))


def test_mha_rope_rejects():
    with pytest.raises(ValueError, match="rope_base"):
        MultiHeadAttention(16, 2, rope_scaling={"type": "linear", "factor": 2})
    with pytest.raises(ValueError, match="head_dim"):
        MultiHeadAttention(12, 4, rope_base=10000.0)
    m = MultiHeadAttention(16, 2, rope_base=10000.0)
    with pytest.raises(ValueError, match="cross-attention"):
        m(torch.randn(1, 3, 16), torch.randn(1, 5, 16))


def gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, d_model=32, n_heads=4, n_layers=2, position="rope", **kw)).double().eval()


@pytest.mark.parametrize("n_kv_heads", [None, 1])
@pytest.mark.parametrize("scaling", [None, {"type": "linear", "factor": 2}, {"type": "ntk", "factor": 4}])
def test_gpt_rope_cached_equals_full(n_kv_heads, scaling):
    m = gpt(n_kv_heads=n_kv_heads, rope_scaling=scaling)
    tokens = torch.randint(0, 11, (2, 25))
    full = m(tokens)
    caches = m.new_caches(2, 25)
    outs = [m(tokens[:, :9], caches)] + [m(tokens[:, t:t + 1], caches) for t in range(9, 25)]
    torch.testing.assert_close(torch.cat(outs, 1), full)


def test_gpt_rope_rolling_cache_and_set_scaling():
    m = gpt(window=5)
    tokens = torch.randint(0, 11, (1, 20))
    full = m(tokens)
    caches = m.new_caches(1, 20)
    assert isinstance(caches[0], SinkWindowCache)
    outs = [m(tokens[:, t:t + 1], caches) for t in range(20)]
    torch.testing.assert_close(torch.cat(outs, 1), full)
    m.set_rope_scaling({"type": "linear", "factor": 4})
    assert m.config.rope_scaling["factor"] == 4
    torch.testing.assert_close(m.blocks[1].attn.inv_freq, rope_inv_freq(8) / 4)
    assert not torch.allclose(m(tokens), full)
    m.set_rope_scaling(None)
    torch.testing.assert_close(m(tokens), full)


def test_gpt_rope_config_rejects():
    with pytest.raises(ValueError, match="rope_scaling"):
        GPTConfig(vocab_size=5, position="alibi", rope_scaling={"type": "linear", "factor": 2})
    with pytest.raises(ValueError, match="even head dim"):
        GPTConfig(vocab_size=5, d_model=12, n_heads=4, position="rope")
    m = GPT(GPTConfig(vocab_size=5, position="alibi"))
    with pytest.raises(ValueError, match="rope"):
        m.set_rope_scaling(None)


def _llama3_transformers(dim, base, factor, low_freq_factor, high_freq_factor, old_context_len):
    """transformers' _compute_llama3_parameters, written as it is there (torch.where on three regions)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


@pytest.mark.parametrize("dim, base, factor, L, lo, hi", [(128, 500000.0, 8.0, 8192, 1.0, 4.0),   # Llama 3.1
                                                           (64, 10000.0, 4.0, 64, 1.0, 4.0), (8, 10000.0, 4.0, 16, 0.5, 2.0)])
def test_llama3_scaling_matches_transformers(dim, base, factor, L, lo, hi):
    scaling = {"type": "llama3", "factor": factor, "original_max_position": L, "low_freq_factor": lo,
               "high_freq_factor": hi}
    got = rope_inv_freq(dim, base, scaling=scaling)
    torch.testing.assert_close(got, _llama3_transformers(dim, base, factor, lo, hi, L))
    plain = rope_inv_freq(dim, base)
    assert got[0] == plain[0] and torch.isclose(got[-1], plain[-1] / factor)  # fastest kept, slowest divided
    with pytest.raises(ValueError, match="high_freq_factor"):
        rope_inv_freq(dim, base, scaling={**scaling, "low_freq_factor": hi, "high_freq_factor": lo})
