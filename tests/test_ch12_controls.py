"""Lesson 12's controls (attncourse.sink_controls): softpick and softmax_1 layers against their definitions and
PyTorch, the repeat-anywhere data, the position probe, and the stored runs."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from attncourse import sink_controls as sc
from attncourse.heads import AttnOnlyConfig, AttnOnlyTransformer
from attncourse.mha import merge_heads
from attncourse.sink_fixes import SoftmaxOneAttention, SoftpickAttention


def _x(seed=0, t=7):
    return torch.randn(2, t, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_softpick_layer_is_softpick_of_the_scores():
    torch.manual_seed(0)
    layer = SoftpickAttention(16, 4).double()
    x = _x()
    out, w = layer(x, is_causal=True, return_weights=True)
    q, k, v = layer.project_qkv(x)  # (B, H, T, D)
    e = torch.exp(q @ k.transpose(-2, -1) / 2.0) - 1  # D = 4
    e = e.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), 0.0)
    ref = torch.relu(e) / (e.abs().sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(w, ref)
    torch.testing.assert_close(out, layer.o_proj(merge_heads(ref @ v)))
    keep = torch.ones(7, 7, dtype=torch.bool).tril()  # a bool mask equal to the causal one gives the same layer
    torch.testing.assert_close(layer(x, attn_mask=keep), out)
    with pytest.raises(TypeError, match="attn_mask"):
        layer(x, attn_mask=keep.double())


def test_softmax_one_is_sdpa_with_a_zero_key_and_value_and_its_logit_never_trains():
    torch.manual_seed(1)
    layer = SoftmaxOneAttention(16, 4).double()
    x = _x(1)
    out = layer(x, is_causal=True)
    q, k, v = layer.project_qkv(x)
    zero = torch.zeros(*k.shape[:2], 1, k.shape[-1], dtype=k.dtype)  # score q . 0 = 0, value 0: e^0 in the sum
    keep = torch.cat([torch.ones(7, 1, dtype=torch.bool), torch.ones(7, 7, dtype=torch.bool).tril()], 1)
    ref = F.scaled_dot_product_attention(q, torch.cat([zero, k], 2), torch.cat([zero, v], 2), attn_mask=keep)
    torch.testing.assert_close(out, layer.o_proj(merge_heads(ref)))
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1, weight_decay=0.1)
    layer(x, is_causal=True).square().sum().backward()
    opt.step()
    assert torch.equal(layer.sinks, torch.zeros(4))


def test_anywhere_tokens_repeat_a_segment_anywhere():
    g = torch.Generator().manual_seed(3)
    x, first, second = sc.anywhere_tokens(4000, 24, 32, generator=g, p_none=0.0, return_copies=True)
    for row, f, m in zip(x[:200].tolist(), first[:200].tolist(), second[:200].tolist()):  # marked runs: equal
        s, r, n = f.index(True), m.index(True), sum(m)
        assert 4 <= n <= 12 and sum(f) == n and all(m[r:r + n]) and s + n <= r and row[s:s + n] == row[r:r + n]
    share = second.float().mean(0)  # (T,) how often each position holds a second copy
    assert share[:4].sum() == 0 and share[8] > 0.05 and share[11] > 0.2  # early positions too, not only the end
    none, first, second = sc.anywhere_tokens(64, 24, 32, generator=g, p_none=1.0, return_copies=True)
    assert none.shape == (64, 24) and none.dtype == torch.int64 and not (first.any() or second.any())
    for bad in (dict(p_none=1.5), dict(min_len=13)):
        with pytest.raises(ValueError):
            sc.anywhere_tokens(2, 24, 32, **bad)


def test_position_probe_on_an_untrained_model():
    early, late = sc.probe_batches(8)
    assert torch.equal(early[:, :6], early[:, 6:12]) and torch.equal(late[:, 12:18], late[:, 18:])
    assert torch.equal(early[:, :6], late[:, 12:18])  # the same segment, moved
    torch.manual_seed(0)
    model = AttnOnlyTransformer(AttnOnlyConfig(32, block_size=24, d_model=32, n_heads=2, attention="gated")).eval()
    p = sc.position_probe(model)
    assert abs(p["early_loss"] - math.log(32)) < 0.5 and len(p["gate_early_repeat"]) == 2
    with pytest.raises(TypeError):
        sc.position_probe("model")


def test_stored_controls_hold_every_setting_and_seed():
    stored = json.loads(sc.STORED.read_text())
    assert stored["recipe"] == dict(steps=1000, lr=5e-3, warmup=100)
    assert set(stored["runs"]) == set(sc.SETTINGS)
    assert all(set(r) == {"0", "1", "2"} for r in stored["runs"].values())
    states = sc.load_states()
    assert set(states) == set(sc.SETTINGS)  # seed 0's weights of every setting, in files under 1 MB each
    assert all(p.stat().st_size < 1_000_000 for p in (sc.STORED_STATES, sc.STORED_STATES_ANYWHERE))
    live = sc.read(sc.load_model("softpick", states["softpick"]))
    for key in ("repeat", "evict_first", "early_loss", "key0_early_repeat"):
        assert abs(live[key] - stored["runs"]["softpick"]["0"][key]) < 1e-4, key
