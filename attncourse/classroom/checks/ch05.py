"""Checks for chapter 05, MQA and GQA (solutions/05_mqa_gqa.ipynb)."""

from __future__ import annotations

import torch

from attncourse.gqa import grouped_attention, kv_cache_bytes, mha_to_gqa, model_config
from attncourse.mha import MultiHeadAttention
from . import Case, exercise
from .ch04 import _weights, reference_mha


@exercise("05-grouped-attention", "gqa_attention", points=3,
          forbid=("torch.nn.functional.scaled_dot_product_attention",),
          hint="query head h reads KV head h // (H // Hkv); either repeat K/V in that order "
               "(repeat_interleave, not repeat) or view q as (B, Hkv, G, T, D)")
def _grouped():
    """Grouped-query attention: q (B, H, T, D) over k, v (B, Hkv, S, D)."""
    gen = torch.Generator().manual_seed(50)
    cases = []
    for name, (b, h, hkv, t, s, d) in {"GQA: 8 query heads, 2 KV heads": (2, 8, 2, 5, 5, 4),
                                       "MQA: 6 query heads, 1 KV head, T != S": (1, 6, 1, 3, 7, 8),
                                       "MHA: 4 and 4": (2, 4, 4, 4, 4, 4),
                                       "groups of 3, one query": (1, 6, 2, 1, 9, 4)}.items():
        q = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(b, hkv, s, d, generator=gen, dtype=torch.float64) for _ in range(2))
        cases.append(Case(name, (q, k, v), expected=grouped_attention(q, k, v), rtol=1e-7, atol=1e-9))
    return cases


@exercise("05-mqa-axis-bug", "mqa_fixed", points=2,
          forbid=("torch.nn.functional.scaled_dot_product_attention",),
          hint="attention mixes over the second-to-last axis: it must be time, so the layout is (B, heads, T, D)")
def _mqa_bug():
    """Fix an MQA that attends over the wrong axis (each token attends only to itself)."""
    gen = torch.Generator().manual_seed(51)
    cases = []
    for name, (b, t, d, h) in {"(2, 5, 16), 4 query heads": (2, 5, 16, 4), "(1, 8, 12), 3 query heads": (1, 8, 12, 3),
                               "(2, 2, 8), 8 query heads": (2, 2, 8, 8)}.items():
        x = torch.randn(b, t, d, generator=gen, dtype=torch.float64)
        w = _weights(gen, d, h, 1)
        cases.append(Case(name, (x, *w, h), expected=reference_mha(x, *w, h, 1), rtol=1e-7, atol=1e-9))
    return cases


@exercise("05-predict-kv-cache", "predicted_kv_bytes", kind="value", points=1,
          hint="2 (K and V) x layers x KV heads x head dim x tokens x batch x bytes per element")
def _predict_cache():
    """Predict three KV-cache sizes in bytes before computing them."""
    mistral, llama70, falcon = (model_config(n) for n in ("Mistral 7B", "LLaMA-2 70B", "Falcon-7B"))
    expected = (mistral.kv_cache_bytes(32_768), llama70.kv_cache_bytes(4096, batch_size=8),
                falcon.kv_cache_bytes(2048, bytes_per_element=4))
    return [Case("(Mistral 7B 32k bf16, LLaMA-2 70B 8 x 4k fp16, Falcon-7B 2k fp32)", expected=expected,
                 compare="equal")]


@exercise("05-notes-table", "notes_table", kind="value", points=2,
          hint="K and V projections map d_model to n_kv_heads * head_dim each (no bias); the cache of one layer "
               "holds K and V for 2048 tokens in float16 (2 bytes); 1 MiB = 2**20 bytes")
def _notes_table():
    """KV projection parameters and one layer's float16 KV cache (MiB) at 2048 tokens, d_model 512, 8 heads."""
    expected = {}
    for name, hkv in (("MHA", 8), ("GQA-4", 4), ("MQA", 1)):
        m = MultiHeadAttention(512, 8, hkv)
        params = m.k_proj.weight.numel() + m.v_proj.weight.numel()
        expected[name] = (params, kv_cache_bytes(1, hkv, 64, 2048) / 2**20)
    return [Case("{name: (KV projection parameters, KV cache MiB)}", expected=expected)]


@exercise("05-mean-pool", "mean_pool_heads", points=2,
          hint="view the (H*D, d_model) weight as (Hkv, G, D, d_model): heads h*G .. h*G+G-1 form group h; "
               "average over the G axis")
def _mean_pool():
    """Mean-pool a K (or V) projection's heads into n_kv_heads groups (Ainslie et al.)."""
    gen = torch.Generator().manual_seed(52)
    cases = []
    for name, (d, h, hkv) in {"8 heads into 2": (32, 8, 2), "8 heads into 1 (MQA)": (16, 8, 1),
                              "6 heads into 3": (12, 6, 3), "4 heads into 4 (unchanged)": (8, 4, 4)}.items():
        mha = MultiHeadAttention(d, h).double()
        with torch.no_grad():
            mha.k_proj.weight.copy_(torch.randn(d, d, generator=gen, dtype=torch.float64))
        expected = mha_to_gqa(mha, hkv, "mean").k_proj.weight.detach().clone()
        cases.append(Case(name, (mha.k_proj.weight.detach().clone(), h, hkv), expected=expected,
                          rtol=1e-10, atol=1e-12))
    return cases
