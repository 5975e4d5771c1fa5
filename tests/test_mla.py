"""MLA: naive vs absorbed, against F.scaled_dot_product_attention on the expanded keys, cached decode == full
forward with a cache that holds only the latent and the RoPE key, cache bytes against published configs."""

import pytest
import torch
import torch.nn.functional as F

from attncourse.gqa import model_config
from attncourse.mla import (MLA_CONFIGS, MLACache, mla_cache_bytes, mla_config_cache_bytes,
                            MultiHeadLatentAttention)
from attncourse.positions import apply_rope


def make(q_rank=None, seed=0):
    torch.manual_seed(seed)
    return MultiHeadLatentAttention(32, 4, kv_rank=12, head_dim=8, rope_dim=4, q_rank=q_rank).double()


def reference(m, x):
    """Expand K and V per head, concatenate the shared RoPE key, and call PyTorch's kernel (causal)."""
    b, t, _ = x.shape
    h, dn, dr = m.n_heads, m.head_dim, m.rope_dim
    pos = torch.arange(t)
    q = m.q_proj(x).view(b, t, h, dn + dr).transpose(1, 2)
    q = torch.cat([q[..., :dn], apply_rope(q[..., dn:], pos)], -1)
    c = m.kv_down(x)
    k_nope = m.k_up(c).view(b, t, h, dn).transpose(1, 2)
    k_rope = apply_rope(m.k_rope_proj(x), pos)[:, None].expand(b, h, t, dr)
    k = torch.cat([k_nope, k_rope], -1)
    v = m.v_up(c).view(b, t, h, dn).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(dn + dr)
    return m.o_proj(out.transpose(1, 2).reshape(b, t, h * dn))


@pytest.mark.parametrize("q_rank", [None, 16])
def test_naive_and_absorbed_match_pytorch(q_rank):
    m = make(q_rank)
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    ref = reference(m, x)
    torch.testing.assert_close(m(x, is_causal=True), ref)
    torch.testing.assert_close(m(x, is_causal=True, absorbed=True), ref)


@pytest.mark.parametrize("absorbed", [False, True])
def test_cached_decode_equals_full_forward_and_cache_holds_latent_only(absorbed):
    m = make()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    full = m(x, is_causal=True)
    cache = MLACache()
    outs = [m(x[:, :4], is_causal=True, kv_cache=cache, absorbed=absorbed)]
    outs += [m(x[:, t:t + 1], is_causal=True, kv_cache=cache, absorbed=absorbed) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(outs, 1), full)
    assert cache.c_kv.shape == (2, 9, 12) and cache.k_rope.shape == (2, 9, 4)
    assert cache.nbytes == 2 * 9 * (12 + 4) * 8  # float64: latent + RoPE key, nothing per head
    assert len(cache) == 9


def test_absorbed_float32_close_and_gradients():
    m = make().float()
    x = torch.randn(1, 7, 32, requires_grad=True)
    a, n = m(x, is_causal=True, absorbed=True), m(x, is_causal=True)
    torch.testing.assert_close(a, n, rtol=1e-4, atol=1e-5)
    a.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_cache_bytes_formula_and_published_configs():
    assert mla_cache_bytes(61, 512, 64, 1) == 61 * 576 * 2 == 70_272  # DeepSeek-V3, bf16, per token
    assert mla_config_cache_bytes("DeepSeek-V3", 1) == 70_272
    assert mla_config_cache_bytes("DeepSeek-V2", 1) == 60 * 576 * 2
    v3 = MLA_CONFIGS["DeepSeek-V3"]
    assert (v3["n_layers"], v3["kv_rank"], v3["rope_dim"], v3["n_heads"]) == (61, 512, 64, 128)
    assert mla_cache_bytes(61, 512, 64, 4096, batch_size=3, bytes_per_element=1) == 61 * 576 * 4096 * 3
    llama70 = model_config("LLaMA-2 70B").kv_cache_bytes(1)
    assert llama70 == 327_680 and llama70 / 70_272 > 4.6
    # DeepSeek-V3 with plain MHA over 128 heads of (128 + 64) keys and 128 values would cache, per token:
    mha_equivalent = 61 * 128 * (128 + 64 + 128) * 2
    assert mha_equivalent / mla_config_cache_bytes("DeepSeek-V3", 1) > 70


@pytest.mark.parametrize("kw,err", [
    (dict(kv_rank=0), ValueError), (dict(rope_dim=3), ValueError), (dict(head_dim=2.0), TypeError),
    (dict(q_rank=0), ValueError),
])
def test_constructor_rejects(kw, err):
    args = dict(kv_rank=4, head_dim=4, rope_dim=2) | kw
    with pytest.raises(err):
        MultiHeadLatentAttention(16, 2, **args)


def test_forward_and_bytes_reject():
    m = make()
    with pytest.raises(ValueError, match="x must be"):
        m(torch.randn(2, 3, 31, dtype=torch.float64))
    with pytest.raises(TypeError, match="kv_cache"):
        m(torch.randn(1, 3, 32, dtype=torch.float64), kv_cache=[])
    with pytest.raises(ValueError, match="seq_len"):
        mla_cache_bytes(61, 512, 64, 0)
    with pytest.raises(ValueError, match="no MLA config"):
        mla_config_cache_bytes("DeepSeek-V9", 1)


def test_absorbed_mla_is_mqa_over_a_shared_latent_key():
    """Absorbed MLA == PyTorch's kernel in MQA form: one KV head, key [c_kv, k_rope], value c_kv."""
    from attncourse.mla import mla_decode_attention_cost
    m = make()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    b, t, _ = x.shape
    h, dn, dr, r = m.n_heads, m.head_dim, m.rope_dim, m.kv_rank
    pos = torch.arange(t)
    q = m.q_proj(x).view(b, t, h, dn + dr).transpose(1, 2)                      # (B, H, T, dn + dr)
    q_lat = q[..., :dn] @ m.k_up.weight.view(h, dn, r)                          # (B, H, T, r)
    q_mqa = torch.cat([q_lat, apply_rope(q[..., dn:], pos)], -1)                # (B, H, T, r + dr)
    c = m.kv_down(x)                                                            # (B, T, r)
    k_mqa = torch.cat([c, apply_rope(m.k_rope_proj(x), pos)], -1)[:, None]      # (B, 1, T, r + dr)
    ctx = F.scaled_dot_product_attention(q_mqa, k_mqa, c[:, None], is_causal=True, enable_gqa=True,
                                         scale=(dn + dr) ** -0.5)               # (B, H, T, r)
    out = m.o_proj((ctx @ m.v_up.weight.view(h, dn, r).transpose(-2, -1)).transpose(1, 2).reshape(b, t, h * dn))
    torch.testing.assert_close(m(x, is_causal=True, absorbed=True), out)
    c3 = mla_decode_attention_cost(128, 512, 64, 4096)
    assert c3["flops"] == 2 * 128 * 4096 * 576 + 2 * 128 * 4096 * 512 and c3["kv_bytes"] == 4096 * 576 * 2
    assert abs(c3["flops_per_byte"] - 128 * 1088 / 576) < 1e-9
    with pytest.raises(ValueError, match="kv_rank"):
        mla_decode_attention_cost(128, 0, 64, 4096)


@pytest.mark.parametrize("batch", [1, 2])
def test_absorbed_decode_reads_one_latent_per_sequence_at_any_batch(batch):
    """One absorbed decode step: no ATen op output holds a per-head copy of the cache (the heads are folded into the
    query axis), at batch 1 and 2; the step equals the expanded form (float64)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    self.ops.append((func.overloadpacket.__name__, tuple(o.shape), o.numel()))
            return out

    torch.manual_seed(0)
    h, r, dr, s = 8, 16, 4, 64
    m = MultiHeadLatentAttention(32, h, kv_rank=r, head_dim=4, rope_dim=dr).double()
    x = torch.randn(batch, s, 32, dtype=torch.float64)
    outs = {}
    for absorbed in (False, True):
        cache = MLACache()
        m(x[:, :s - 1], is_causal=True, kv_cache=cache, absorbed=absorbed)
        with Largest() as log:
            outs[absorbed] = m(x[:, s - 1:], is_causal=True, kv_cache=cache, absorbed=absorbed)
        if absorbed:
            per_sequence = s * (r + dr)  # one latent and one RoPE key
            biggest = max(log.ops, key=lambda op: op[2])
            assert biggest[2] <= 2 * batch * per_sequence, biggest  # a per-head copy would be h * batch * s * r
        else:  # the expanded form does expand per head: the probe sees it
            assert max(op[2] for op in log.ops) >= batch * h * s * 4
    torch.testing.assert_close(outs[True], outs[False])
