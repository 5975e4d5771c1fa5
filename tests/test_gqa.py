"""kv_cache_bytes and the model table (facts the notes got wrong), grouped attention against PyTorch's
enable_gqa kernel, MHA-to-GQA conversion, and the decode cost model."""

import pytest
import torch
import torch.nn.functional as F

from attncourse.gqa import (MODEL_CONFIGS, ModelConfig, decode_attention_cost, decode_step_bytes, grouped_attention,
                            kv_cache_bytes, mha_to_gqa, model_config)
from attncourse.mha import MultiHeadAttention, repeat_kv
from attncourse.sdpa import scaled_dot_product_attention

TOL = dict(rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- KV-cache sizes and configs


def test_kv_cache_bytes_formula():
    assert kv_cache_bytes(1, 1, 1, 1) == 4  # K and V, one float16 each
    assert kv_cache_bytes(2, 3, 5, 7, batch_size=11, bytes_per_element=4) == 2 * 2 * 3 * 5 * 7 * 11 * 4
    # the notes' exercise: d_model 512, 8 heads (head dim 64), one layer, 2048 tokens, float16
    assert [kv_cache_bytes(1, h, 64, 2048) / 2**20 for h in (8, 4, 1)] == [4.0, 2.0, 0.5]


def test_llama1_65b_cache_at_2048_tokens():
    """The notes give 5.2 GB; the right number is 5,368,709,120 bytes (5.4 GB, 5.0 GiB)."""
    cfg = model_config("LLaMA-1 65B")
    assert cfg.kv_cache_bytes(2048) == 5_368_709_120
    assert kv_cache_bytes(80, 64, 128, 2048) == 5_368_709_120


@pytest.mark.parametrize("name, h, hkv, kind", [
    ("LLaMA-2 70B", 64, 8, "GQA-8"),    # not "8 heads, G=8"
    ("PaLM 540B", 48, 1, "MQA"),        # not 16 query heads
    ("Falcon-40B", 128, 8, "GQA-8"),    # not MQA with 64 heads
    ("Falcon-7B", 71, 1, "MQA"),
    ("Mistral 7B", 32, 8, "GQA-8"),     # 8 KV heads: 8 groups of 4, not "4 groups"
    ("LLaMA-3 8B", 32, 8, "GQA-8"),
    ("GPT-3 175B", 96, 96, "MHA"),
])
def test_model_facts(name, h, hkv, kind):
    cfg = model_config(name)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.attention) == (h, hkv, kind)
    assert cfg.n_heads % cfg.n_kv_heads == 0 and cfg.group_size == h // hkv
    assert cfg.source.count("http") >= 1


def test_configs_consistent():
    names = [c.name for c in MODEL_CONFIGS]
    assert len(set(names)) == len(names)
    for cfg in MODEL_CONFIGS:
        if cfg.name != "PaLM 540B":  # PaLM: 48 heads of 256 = 12288 != d_model 18432
            assert cfg.n_heads * cfg.head_dim == cfg.d_model, cfg.name
    assert model_config("Mistral 7B").kv_cache_bytes(1) == 131_072  # 128 KiB per token


def test_kv_cache_bytes_rejects():
    with pytest.raises(ValueError, match="seq_len"):
        kv_cache_bytes(1, 1, 1, 0)
    with pytest.raises(TypeError, match="n_layers"):
        kv_cache_bytes(1.5, 1, 1, 1)
    with pytest.raises(ValueError, match="'nope'"):
        model_config("nope")


# ---------------------------------------------------------------- grouped attention


def make(b, h, hkv, t, s, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, t, d, generator=g, dtype=torch.float64),
            torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64),
            torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("h, hkv", [(8, 8), (8, 2), (8, 1), (6, 3), (5, 1)])
@pytest.mark.parametrize("t, s", [(5, 5), (3, 7), (1, 11)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_grouped_matches_enable_gqa_and_repeat(h, hkv, t, s, is_causal):
    q, k, v = make(2, h, hkv, t, s, 8)
    out, w = grouped_attention(q, k, v, is_causal=is_causal, return_weights=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True),
                               **TOL)
    n_rep = h // hkv
    ref_out, ref_w = scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                                  is_causal=is_causal, return_weights=True)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(w, ref_w, **TOL)


@pytest.mark.parametrize("mask_shape", [(5, 7), (1, 8, 5, 7), (2, 1, 1, 7), (8, 5, 7), (2, 8, 5, 7)])
def test_grouped_masks_per_head(mask_shape):
    q, k, v = make(2, 8, 2, 5, 7, 4)
    gen = torch.Generator().manual_seed(1)
    keep = torch.rand(mask_shape, generator=gen) > 0.4
    bias = torch.randn(mask_shape, generator=gen, dtype=torch.float64)  # e.g. an ALiBi bias per head
    ref_k, ref_v = repeat_kv(k, 4), repeat_kv(v, 4)
    for mask in (keep, bias):
        torch.testing.assert_close(grouped_attention(q, k, v, mask),
                                   scaled_dot_product_attention(q, ref_k, ref_v, mask), **TOL)


def test_grouped_gradients():
    q, k, v = (x.requires_grad_(True) for x in make(1, 4, 2, 3, 5, 4))
    assert torch.autograd.gradcheck(lambda a, b, c: grouped_attention(a, b, c, is_causal=True), (q, k, v))


def test_grouped_rejects():
    q, k, v = make(1, 6, 4, 3, 3, 4)
    with pytest.raises(ValueError, match=r"divisible.*\(1, 6, 3, 4\)"):
        grouped_attention(q, k, v)
    q, k, v = make(1, 4, 2, 3, 3, 4)
    with pytest.raises(ValueError, match="query must be"):
        grouped_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="attn_mask"):
        grouped_attention(q, k, v, torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask"):
        grouped_attention(q, k, v, torch.ones(3, 3, 3, dtype=torch.bool))  # 3 heads, not 4


def test_grouped_never_repeats_kv():
    """The grouped path reads K through a view: no tensor with H heads' worth of keys is built."""
    q, k, v = make(1, 8, 2, 4, 6, 4)
    out = grouped_attention(q, k, v)
    assert out.shape == (1, 8, 4, 4)
    expanded = k[:, :, None].expand(1, 2, 4, 6, 4)
    assert expanded.data_ptr() == k.data_ptr() and expanded.stride(2) == 0  # expand is free
    repeated = repeat_kv(k, 4)
    assert repeated.data_ptr() != k.data_ptr()  # ... but reshape of an expanded tensor copies
    assert repeat_kv(k[:, :1], 8).data_ptr() == k.data_ptr()  # except from a single KV head (MQA): a view


# ---------------------------------------------------------------- MHA -> GQA conversion


@pytest.mark.parametrize("bias", [False, True])
def test_mha_to_gqa_mean_and_first(bias):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, bias=bias).double()
    for method in ("mean", "first"):
        gqa = mha_to_gqa(mha, 2, method)
        assert gqa.n_kv_heads == 2 and gqa.k_proj.weight.shape == (8, 16)
        torch.testing.assert_close(gqa.q_proj.weight, mha.q_proj.weight, rtol=0, atol=0)
        torch.testing.assert_close(gqa.o_proj.weight, mha.o_proj.weight, rtol=0, atol=0)
        for proj in ("k_proj", "v_proj"):
            w = getattr(mha, proj).weight  # head h = rows 4h .. 4h+3
            want = (w[0:4] + w[4:8]) / 2 if method == "mean" else w[0:4]
            torch.testing.assert_close(getattr(gqa, proj).weight[:4], want, **TOL)
            want = (w[8:12] + w[12:16]) / 2 if method == "mean" else w[8:12]
            torch.testing.assert_close(getattr(gqa, proj).weight[4:], want, **TOL)
    same = mha_to_gqa(mha, 4, "mean")  # one head per group: an exact copy
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(same(x), mha(x), **TOL)


def test_mha_to_gqa_when_heads_agree_is_exact():
    """If the heads of each group already share K/V, mean-pooling loses nothing."""
    torch.manual_seed(0)
    gqa = MultiHeadAttention(16, 4, 2).double()
    mha = MultiHeadAttention(16, 4).double()
    with torch.no_grad():
        for name in ("q_proj", "o_proj"):
            getattr(mha, name).weight.copy_(getattr(gqa, name).weight)
        for name in ("k_proj", "v_proj"):
            w = getattr(gqa, name).weight.view(2, 1, 4, 16).expand(2, 2, 4, 16)
            getattr(mha, name).weight.copy_(w.reshape(16, 16))
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(mha(x), gqa(x), **TOL)
    torch.testing.assert_close(mha_to_gqa(mha, 2, "mean")(x), gqa(x), **TOL)
    torch.testing.assert_close(mha_to_gqa(mha, 2, "first")(x), gqa(x), **TOL)


def test_mha_to_gqa_rejects():
    mha = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        mha_to_gqa(mha, 3)
    with pytest.raises(ValueError, match="method"):
        mha_to_gqa(mha, 2, "median")
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        mha_to_gqa(MultiHeadAttention(16, 4, 2), 1)
    with pytest.raises(TypeError, match="mha"):
        mha_to_gqa(torch.nn.Linear(2, 2), 1)


# ---------------------------------------------------------------- cost model


def test_decode_attention_cost():
    mha = decode_attention_cost(32, 32, 128, 4096)
    gqa = decode_attention_cost(32, 8, 128, 4096)
    assert mha["flops"] == gqa["flops"] == 4 * 32 * 4096 * 128
    assert mha["kv_bytes"] == 4 * gqa["kv_bytes"] == kv_cache_bytes(1, 32, 128, 4096)
    assert mha["flops_per_byte"] == 1.0 and gqa["flops_per_byte"] == 4.0  # 2 G / 2 bytes
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        decode_attention_cost(32, 3, 128, 10)


def test_decode_step_bytes():
    cfg = model_config("LLaMA-2 70B")
    step = decode_step_bytes(cfg, 4096, batch_size=8)
    assert step["weights"] == 138_000_000_000
    assert step["kv_cache"] == 8 * kv_cache_bytes(80, 8, 128, 4096)
    assert step["total"] == step["weights"] + step["kv_cache"]
    mha_twin = ModelConfig("70B as MHA", cfg.n_params, 80, 8192, 64, 64, 128, 4096, "hypothetical")
    assert decode_step_bytes(mha_twin, 4096, 8)["kv_cache"] == 8 * step["kv_cache"]
    with pytest.raises(TypeError, match="cfg"):
        decode_step_bytes("LLaMA-2 70B", 10)


def test_with_kv_heads_counts_mha_extra_parameters():
    from attncourse.gqa import with_kv_heads
    gqa70 = model_config("LLaMA-2 70B")
    mha = with_kv_heads(gqa70, 64)
    assert mha.n_kv_heads == 64 and mha.n_params - gqa70.n_params == 2 * 80 * 8192 * 128 * 56
    assert with_kv_heads(gqa70, 8).n_params == gqa70.n_params
    with pytest.raises(ValueError, match="divisible"):
        with_kv_heads(gqa70, 3)
    with pytest.raises(TypeError, match="cfg"):
        with_kv_heads("LLaMA-2 70B", 8)


def test_memory_sets_the_batch_on_8_gpus():
    from attncourse.gqa import H100_X8, Hardware, decode_throughput, max_batch, serving_bytes, with_kv_heads
    gqa70 = model_config("LLaMA-2 70B")
    mha, mqa = with_kv_heads(gqa70, 64), with_kv_heads(gqa70, 1)
    assert H100_X8.total_memory == 8 * 80 * 2**30 and H100_X8.total_bandwidth == 8 * 3.35e12
    fit = max_batch(gqa70, H100_X8, 4096)
    one = serving_bytes(gqa70, H100_X8, 4096)
    assert fit == int((8 * 80 * 2**30 - one["weights"]) // one["kv_cache"]) == 409
    assert max_batch(mha, H100_X8, 4096) == 49
    # MQA's one KV head is stored on all 8 devices: the same cache bytes as GQA-8's 8 heads
    assert serving_bytes(mqa, H100_X8, 4096)["kv_cache"] == one["kv_cache"]
    assert decode_throughput(gqa70, H100_X8, 4096, fit + 1) is None
    step = (one["weights"] + fit * one["kv_cache"]) / H100_X8.total_bandwidth
    assert decode_throughput(gqa70, H100_X8, 4096, fit) == pytest.approx(fit / step)
    tiny = Hardware("one 80 GB", 1, 80e9, 3.35e12)
    assert max_batch(gqa70, tiny, 4096) == 0 and decode_throughput(gqa70, tiny, 4096, 1) is None
    with pytest.raises(TypeError, match="hw"):
        serving_bytes(gqa70, "H100", 4096)
