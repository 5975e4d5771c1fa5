"""Chapter 05's additions: MLA's FLOPs in both forms, the five cache layouts of the char GPT, the uptraining helpers."""
import pytest
import torch

from attncourse.kv_layouts import LAYOUTS, LatentSelfAttention, cache_numbers, held_out_windows, layout_lm
from attncourse.mla import MLACache, MultiHeadLatentAttention, matmul_flops, mla_attention_flops
from attncourse.uptrain_lm import convert


@pytest.mark.parametrize("n_new,prefix", [(7, 0), (1, 9), (3, 5)])
def test_mla_attention_flops_match_the_module(n_new, prefix):
    torch.manual_seed(0)
    d, h, r, dn, dr = 32, 4, 12, 8, 4
    mla = MultiHeadLatentAttention(d, h, kv_rank=r, head_dim=dn, rope_dim=dr)
    past, x = torch.randn(1, prefix, d), torch.randn(1, n_new, d)
    s = prefix + n_new
    proj = 2 * n_new * d * (h * (dn + dr) + r + dr) + 2 * n_new * h * dn * d  # q, kv_down, k_rope, o (shared)
    counted = {}
    for absorbed in (False, True):
        cache = MLACache()
        if prefix:
            with torch.no_grad():
                mla(past, is_causal=True, kv_cache=cache)
        with torch.no_grad():
            counted["absorbed" if absorbed else "expanded"] = matmul_flops(
                lambda: mla(x, is_causal=True, kv_cache=cache if prefix else None, absorbed=absorbed)) - proj
    assert counted == mla_attention_flops(h, r, dr, dn, n_new, s)


def test_matmul_flops_counts_products():
    a, b = torch.randn(2, 3, 4), torch.randn(4, 5)
    assert matmul_flops(lambda: a @ b) == 2 * 2 * 3 * 4 * 5
    assert matmul_flops(lambda: torch.nn.functional.linear(a, b.T, torch.zeros(5))) == 2 * 6 * 4 * 5
    assert matmul_flops(lambda: a + 1) == 0
    with pytest.raises(TypeError, match="fn"):
        matmul_flops(3)


def test_mla_attention_flops_decode_absorbs_prefill_expands():
    v3 = dict(n_heads=128, kv_rank=512, rope_dim=64, head_dim=128)
    decode, prefill = mla_attention_flops(**v3, n_new=1, context_len=4096), mla_attention_flops(**v3, n_new=4096,
                                                                                                   context_len=4096)
    assert decode["absorbed"] * 50 < decode["expanded"] and prefill["expanded"] < prefill["absorbed"]
    with pytest.raises(ValueError, match="n_new"):
        mla_attention_flops(**v3, n_new=5, context_len=4)
    with pytest.raises(ValueError, match="head_dim"):
        mla_attention_flops(128, 512, 64, 0, 1, 4)


def test_layouts_cache_and_mla_model_equals_absorbed():
    assert [cache_numbers(k) for k in LAYOUTS] == [128, 64, 32, 64, 32, 96]
    with pytest.raises(ValueError, match="layout"):
        cache_numbers("GQA-3")
    torch.manual_seed(0)
    model = layout_lm("MLA-32", 11, seed=0).double()
    tokens = torch.randint(0, 11, (2, 9))
    expanded = model(tokens)
    for block in model.blocks:
        assert isinstance(block.attn, LatentSelfAttention)
        block.attn.absorbed = True
    torch.testing.assert_close(model(tokens), expanded)
    # position 3's logits do not depend on later tokens (causal), and do depend on order (the RoPE key)
    other = tokens.clone()
    other[:, 5:] = (other[:, 5:] + 1) % 11
    torch.testing.assert_close(model(other)[:, :5], expanded[:, :5])
    swapped = tokens[:, [1, 0, *range(2, 9)]]
    assert not torch.allclose(model(swapped)[:, 2], expanded[:, 2])
    with pytest.raises(ValueError, match="attn_mask"):
        model.blocks[0].attn(torch.randn(1, 3, 64, dtype=torch.float64), attn_mask=torch.ones(3, 3, dtype=torch.bool))
    assert layout_lm("GQA-2", 11, 0).blocks[0].attn.n_kv_heads == 2


def test_held_out_windows_cover_the_text():
    held = held_out_windows(torch.arange(200))
    assert held.shape == (3, 65) and held[1, 0] == 64 and held[-1, -1] == 192


def test_convert_every_block():
    lm = layout_lm("MHA", 11, 0)
    for n_kv in (2, 1):
        assert all(b.attn.n_kv_heads == n_kv for b in convert(lm, n_kv, "mean").blocks)
    assert all(b.attn.n_kv_heads == 4 for b in lm.blocks)


def test_models_2025_and_gemma3_local_global_cache():
    from attncourse.kv_models import KIMI_K2, MODELS_2025, local_global_cache_bytes, n_global_layers
    from attncourse.mla import mla_cache_bytes

    by = {c.name: c for c in MODELS_2025}
    assert by["Llama-3.1 70B"].kv_cache_bytes(1) == 327_680 and by["Qwen3-235B-A22B"].kv_cache_bytes(1) == 192_512
    gemma = by["Gemma 3 27B"]
    assert n_global_layers(62) == 10 and n_global_layers(12) == 2
    assert local_global_cache_bytes(gemma, 1024) == gemma.kv_cache_bytes(1024)   # within the window: all layers
    assert local_global_cache_bytes(gemma, 131_072) == 8192 * (10 * 131_072 + 52 * 1024)
    assert local_global_cache_bytes(gemma, 5000) < local_global_cache_bytes(gemma, 5001)
    with pytest.raises(TypeError, match="cfg"):
        local_global_cache_bytes(dict(n_layers=2), 10)
    with pytest.raises(ValueError, match="window"):
        local_global_cache_bytes(gemma, 10, window=0)
    assert mla_cache_bytes(KIMI_K2["n_layers"], KIMI_K2["kv_rank"], KIMI_K2["rope_dim"], 1) == 70_272
