"""Positions: sinusoidal table, ALiBi slopes against Press et al.'s formula, biases, grouped ALiBi."""

import math

import pytest
import torch
import torch.nn.functional as F

from attncourse import masks, scaled_dot_product_attention
from attncourse.gqa import grouped_attention
from attncourse.positions import (alibi_bias, alibi_bias_at, alibi_score_mod, alibi_slopes,
                                  grouped_alibi_bias, materialize_bias, sinusoidal_positions)


def paper_slopes(n: int) -> list[float]:
    """Press et al.'s reference code, transcribed independently (their get_slopes)."""
    def pow2(k):
        start = 2 ** (-(2 ** -(math.log2(k) - 3)))
        return [start * start ** i for i in range(k)]
    if math.log2(n).is_integer():
        return pow2(n)
    closest = 2 ** math.floor(math.log2(n))
    return pow2(closest) + paper_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("n", range(1, 65))
def test_slopes_match_the_paper_for_1_to_64_heads(n):
    got = alibi_slopes(n)
    assert got.shape == (n,) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(paper_slopes(n), dtype=torch.float32), rtol=1e-6, atol=0)
    assert len(set(got.tolist())) == n  # every head its own slope


def test_slopes_published_values():
    assert alibi_slopes(8).tolist() == [2.0 ** -k for k in range(1, 9)]  # 1/2, 1/4, ..., 1/256
    s12 = alibi_slopes(12)
    assert s12[:8].tolist() == alibi_slopes(8).tolist()
    torch.testing.assert_close(s12[8:], torch.tensor([2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5]))


def test_sinusoidal_formula_and_properties():
    pe = sinusoidal_positions(50, 16)
    assert pe.shape == (50, 16) and pe.dtype == torch.float32
    t, i = 7, 3
    angle = t / 10000 ** (2 * i / 16)
    torch.testing.assert_close(pe[t, 2 * i], torch.tensor(math.sin(angle)))
    torch.testing.assert_close(pe[t, 2 * i + 1], torch.tensor(math.cos(angle)))
    torch.testing.assert_close(pe[:, 0::2] ** 2 + pe[:, 1::2] ** 2, torch.ones(50, 8))  # sin^2 + cos^2
    # The dot product depends only on the distance: pe[a] . pe[a + k] == pe[b] . pe[b + k].
    torch.testing.assert_close(pe[3] @ pe[10], pe[20] @ pe[27])


def test_alibi_bias_entries_and_decoding_alignment():
    h, tq, tk = 6, 3, 7
    bias = alibi_bias(h, tq, tk)
    slopes = alibi_slopes(h)
    assert bias.shape == (h, tq, tk)
    for i in range(tq):
        for j in range(tk):
            torch.testing.assert_close(bias[:, i, j], slopes * (j - (i + tk - tq)))
    # A decode step's row equals the last row of the square bias.
    torch.testing.assert_close(alibi_bias(h, 1, tk)[:, 0], alibi_bias(h, tk)[:, -1])
    torch.testing.assert_close(alibi_bias(h, 4), alibi_bias(h, 4, 4))


def test_alibi_bias_at_arbitrary_positions():
    s = alibi_slopes(4)
    q, k = torch.tensor([10, 11]), torch.tensor([0, 1, 8, 9, 10, 11])
    torch.testing.assert_close(alibi_bias_at(s, q, k), s[:, None, None] * (k[None, None] - q[None, :, None]))
    torch.testing.assert_close(alibi_bias_at(s, torch.arange(5), torch.arange(5)), alibi_bias(4, 5))


def test_softmax_shift_invariance_two_forms():
    """m * (j - i) and m * j give the same causal weights: the row constant -m*i cancels."""
    h, t = 4, 9
    scores = torch.randn(1, h, t, t, dtype=torch.float64)
    keep = masks.materialize(masks.causal, t, t)
    rel = alibi_bias(h, t).double().masked_fill(~keep, float("-inf"))
    absolute = (alibi_slopes(h).double()[:, None, None] * torch.arange(t)).expand(h, t, t)
    absolute = absolute.masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(torch.softmax(scores + rel, -1), torch.softmax(scores + absolute, -1))


@pytest.mark.parametrize("tq,tk", [(5, 5), (1, 9), (3, 7)])
def test_score_mod_composes_with_masks_and_matches_pytorch(tq, tk):
    h = 4
    score_mod = alibi_score_mod(h, q_offset=tk - tq)
    bias = materialize_bias(score_mod, h, tq, tk, masks.causal_bottom_right(tq, tk))
    expected = alibi_bias(h, tq, tk).masked_fill(~masks.materialize(masks.causal_bottom_right(tq, tk), tq, tk),
                                                 float("-inf"))
    torch.testing.assert_close(bias, expected)
    q, k, v = torch.randn(2, h, tq, 8), torch.randn(2, h, tk, 8), torch.randn(2, h, tk, 8)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, bias),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=bias))


@pytest.mark.parametrize("h,h_kv,tq,tk", [(8, 2, 5, 5), (12, 4, 1, 7), (6, 1, 3, 6), (4, 4, 2, 2)])
def test_grouped_alibi_equals_ungrouped(h, h_kv, tq, tk):
    g = h // h_kv
    q = torch.randn(2, h, tq, 8, dtype=torch.float64)
    k, v = torch.randn(2, h_kv, tk, 8, dtype=torch.float64), torch.randn(2, h_kv, tk, 8, dtype=torch.float64)
    scores = (q.view(2, h_kv, g, tq, 8) @ k[:, :, None].transpose(-2, -1)) / math.sqrt(8)  # (B, Hkv, G, Tq, Tk)
    grouped = scores + grouped_alibi_bias(h, h_kv, tq, tk).double()
    flat = (q @ k.repeat_interleave(g, 1).transpose(-2, -1)) / math.sqrt(8) + alibi_bias(h, tq, tk).double()
    torch.testing.assert_close(grouped.reshape(2, h, tq, tk), flat)
    bias = alibi_bias(h, tq, tk).double()
    torch.testing.assert_close(grouped_attention(q, k, v, bias),
                               F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                                              v.repeat_interleave(g, 1), attn_mask=bias))


def test_bad_input():
    with pytest.raises(ValueError, match="n_heads"):
        alibi_slopes(0)
    with pytest.raises(TypeError, match="n_heads"):
        alibi_slopes(2.0)
    with pytest.raises(ValueError, match="d_model"):
        sinusoidal_positions(4, 7)
    with pytest.raises(ValueError, match="k_len"):
        alibi_bias(4, 5, 3)
    with pytest.raises(ValueError, match="n_kv_heads"):
        grouped_alibi_bias(6, 4, 2)
    with pytest.raises(ValueError, match="q_positions"):
        alibi_bias_at(alibi_slopes(2), torch.zeros(2, 2), torch.arange(3))
    with pytest.raises(ValueError, match="q_offset"):
        alibi_score_mod(4, q_offset=-1)
    with pytest.raises(TypeError, match="score_mod"):
        materialize_bias("alibi", 4, 2, 2)


def test_attention_sink_mask():
    m = masks.materialize(masks.attention_sink(2, 3), 8, 8)
    assert m[7].tolist() == [True, True, False, False, False, True, True, True]
    assert torch.equal(masks.materialize(masks.attention_sink(0, 3), 8, 8),
                       masks.materialize(masks.sliding_window(3), 8, 8))
    assert not (m & ~masks.materialize(masks.causal, 8, 8)).any()
    with pytest.raises(ValueError, match="n_sink"):
        masks.attention_sink(-1, 3)
    with pytest.raises(ValueError, match="k_positions"):
        masks.materialize_at(masks.causal, torch.arange(2), torch.zeros(3))


# ----------------------------------------------------------------------------- T5's relative bias, partial RoPE


def _t5_bucket_reference(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """T5's bucketing as Hugging Face writes it (transformers, models/t5/modeling_t5.py,
    T5Attention._relative_position_bucket, itself from Mesh TensorFlow's transformer_layers.py), restated here
    step by step because transformers is not a dependency of the course."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, relative_position, large)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 64), (8, 20), (64, 1000)])
def test_t5_relative_bucket_matches_t5s_code(bidirectional, num_buckets, max_distance):
    from attncourse.positions import t5_relative_bucket
    rel = torch.arange(-3000, 3001)
    got = t5_relative_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    torch.testing.assert_close(got, _t5_bucket_reference(rel, bidirectional, num_buckets, max_distance), rtol=0, atol=0)


def test_t5_relative_bucket_known_values():
    from attncourse.positions import t5_relative_bucket
    rel = torch.tensor([0, -1, -7, -8, -16, -127, -128, -5000, 1, 7, 8, 5000])
    # encoder (bidirectional, 32 buckets, 128): 0..7 exact, then log bins; the future is 16 + the same
    assert t5_relative_bucket(rel).tolist() == [0, 1, 7, 8, 10, 15, 15, 15, 17, 23, 24, 31]
    # decoder: the future is bucket 0, the past has 32 buckets, 0..15 exact
    assert t5_relative_bucket(rel, bidirectional=False).tolist() == [0, 1, 7, 8, 16, 31, 31, 31, 0, 0, 0, 0]


def test_t5_relative_bucket_rejects_bad_input():
    from attncourse.positions import t5_relative_bucket
    with pytest.raises(TypeError, match="relative_position"):
        t5_relative_bucket(torch.zeros(3))
    with pytest.raises(ValueError, match="num_buckets"):
        t5_relative_bucket(torch.zeros(3, dtype=torch.long), num_buckets=7)
    with pytest.raises(ValueError, match="max_distance"):
        t5_relative_bucket(torch.zeros(3, dtype=torch.long), num_buckets=32, max_distance=4)


def test_t5_relative_bias_is_a_table_lookup_per_head_and_decodes_like_the_full_bias():
    from attncourse.positions import T5RelativeBias, t5_relative_bucket
    torch.manual_seed(0)
    mod = T5RelativeBias(4, num_buckets=16, max_distance=32, bidirectional=False)
    full = mod(10)  # (H, T, T)
    assert full.shape == (4, 10, 10)
    rel = torch.arange(10)[None, :] - torch.arange(10)[:, None]
    b = t5_relative_bucket(rel, bidirectional=False, num_buckets=16, max_distance=32)
    for h in range(4):
        torch.testing.assert_close(full[h], mod.table.weight[:, h][b])
    torch.testing.assert_close(mod(3, 10), full[:, -3:])  # the last 3 queries over 10 keys
    # relative: the same offset gives the same bias wherever it sits
    torch.testing.assert_close(full[:, 5, 2], full[:, 8, 5])
    with pytest.raises(ValueError, match="q_offset"):
        mod(4, 10, q_offset=-1)


def test_partial_rope_rotates_only_the_first_dims():
    from attncourse.positions import apply_partial_rope, apply_rope
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 16, dtype=torch.float64)
    pos = torch.arange(7) + 5
    out = apply_partial_rope(x, pos, rotary_dim=4)
    torch.testing.assert_close(out[..., :4], apply_rope(x[..., :4], pos))
    torch.testing.assert_close(out[..., 4:], x[..., 4:], rtol=0, atol=0)
    torch.testing.assert_close(apply_partial_rope(x, pos, rotary_dim=16), apply_rope(x, pos))
    # GPT-NeoX's own formulation (rotate_half on the rotary slice, frequencies of a rotary_dim-wide RoPE)
    inv = 1.0 / (10000 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4))
    emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)  # (T, 4)
    rot, rest = x[..., :4], x[..., 4:]
    half = torch.cat([-rot[..., 2:], rot[..., :2]], -1)
    torch.testing.assert_close(out, torch.cat([rot * emb.cos() + half * emb.sin(), rest], -1))
    for bad in (0, 3, 18, 4.0, True):
        with pytest.raises(ValueError, match="rotary_dim"):
            apply_partial_rope(x, pos, rotary_dim=bad)
