"""Chapter 13's feature maps (attncourse.feature_maps), the Mamba-2 mixer of attncourse.recall and the sliding-window
layer of attncourse.text_hybrid: each against a loop written from its definition. Small and fast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attncourse import feature_maps as fm
from attncourse import text_hybrid as th
from attncourse.recall import Mixer, memory_recall
from attncourse.sdpa import scaled_dot_product_attention


def test_taylor_kernel_is_three_terms_of_exp():
    q, k = torch.randn(5, 7, dtype=torch.float64), torch.randn(9, 7, dtype=torch.float64)
    dot = q @ k.T  # (5, 9)
    torch.testing.assert_close(fm.taylor2(q) @ fm.taylor2(k).T, 1 + dot + dot ** 2 / 2)
    assert fm.feature_dim("taylor2", 16) == 273 and fm.feature_dim("elu+1", 16) == 16


def test_feature_recall_identity_is_memory_recall_and_maps_differ():
    for n, seed in ((16, 0), (48, 3)):
        assert fm.feature_recall("identity", n, 32, seed) == memory_recall("linear", n, 32, seed)
    assert fm.feature_recall("elu+1", 32, 16, 0) < 0.1 < 0.9 < fm.feature_recall("taylor2", 32, 16, 0, scale=16.0)


def test_feature_maps_reject_bad_input():
    with pytest.raises(ValueError, match="feature map"):
        fm.feature_map("relu", torch.zeros(3))
    with pytest.raises(ValueError, match="scale"):
        fm.feature_recall("taylor2", 8, 4, 0, scale=0.0)
    with pytest.raises((TypeError, ValueError), match="key_dim"):
        fm.feature_recall("identity", 8, 0, 0)
    with pytest.raises((TypeError, ValueError), match="x"):
        fm.taylor2(3.0)


def test_mamba2_mixer_is_the_scalar_decay_recurrence():
    """S_t = exp(-A dt_t) S_{t-1} + dt_t k_t v_t^T, o_t = RMSNorm(S_t^T q_t) per head, q and k L2-normalised: a loop."""
    torch.manual_seed(0)
    m = Mixer("mamba2", 8, 2, chunk_size=4).double()
    x = torch.randn(2, 11, 8, dtype=torch.float64)
    B, T, H, dh = 2, 11, 2, 4
    q, k, v = (t.view(B, T, H, dh) for t in m.qkv(x).chunk(3, -1))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    dt = F.softplus(m.gate(x))  # (B, T, H)
    a = torch.exp(-torch.exp(m.A_log) * dt)  # (B, T, H)
    S = torch.zeros(B, H, dh, dh, dtype=torch.float64)
    outs = []
    for t in range(T):
        S = a[:, t, :, None, None] * S + dt[:, t, :, None, None] * k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))  # (B, H, dh)
    o = torch.stack(outs, 1)  # (B, T, H, dh), then RMS-normalised per head with the learned weight
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + torch.finfo(torch.float64).eps) * m.norm.weight
    ref = m.out(o.reshape(B, T, -1))
    torch.testing.assert_close(m(x), ref)
    assert m.beta is None  # no delta correction


def test_sliding_window_layer_sees_only_its_window():
    torch.manual_seed(0)
    w = th.GatedRopeAttention(32, 2, 16, window=5)
    x = torch.randn(1, 20, 32)
    y = x.clone()
    y[:, :10] += 1.0  # change tokens 0..9: queries 14.. (window 10..14 and later) must not see it
    torch.testing.assert_close(w(x)[:, 14:], w(y)[:, 14:])
    assert not torch.allclose(w(x)[:, 13], w(y)[:, 13])  # query 13 still sees token 9
    with pytest.raises((TypeError, ValueError), match="window"):
        th.GatedRopeAttention(32, 2, 16, window=0)
    assert [type(m).__name__ for m in th.build("hybrid 3:1, window", 60, 0).mixers] == ["GatedDeltaNet"] * 3 + [
        "GatedRopeAttention"]


def test_sliding_window_equals_masked_attention():
    """The "W" layer is the "A" layer with the band mask i - WINDOW < j <= i, built here by hand."""
    torch.manual_seed(1)
    a, w = th.GatedRopeAttention(32, 2, 16), th.GatedRopeAttention(32, 2, 16, window=th.WINDOW)
    w.load_state_dict(a.state_dict())
    x = torch.randn(2, 70, 32)
    band = torch.ones(70, 70, dtype=torch.bool).tril() & ~torch.ones(70, 70, dtype=torch.bool).tril(-th.WINDOW)
    from attncourse.positions import apply_rope
    q, k, v = (t.reshape(2, 70, 2, 16).transpose(1, 2) for t in a.qkv(x).chunk(3, -1))
    o = scaled_dot_product_attention(apply_rope(q), apply_rope(k), v, attn_mask=band)
    ref = a.out(o.transpose(1, 2).reshape(2, 70, -1) * torch.sigmoid(a.gate(x)))
    torch.testing.assert_close(w(x), ref)


def test_stored_mamba2_runs_match_the_lesson_recipe():
    """The stored Mamba-2 runs (MQAR at N = 32, and the overwrite task) are the recipes the lesson's cell names."""
    import json
    from pathlib import Path

    import nbformat

    root = Path(__file__).resolve().parents[1]
    stored = json.loads((root / "notebooks/results/ch13_zoology_mamba2_full.json").read_text())
    assert (stored["pairs"], stored["steps"], stored["seeds"], stored["short_conv"]) == (32, 300, [0, 1, 2], True)
    assert set(stored["accuracy"]) == {"0.01", "0.03"}
    assert all(len(a) == 3 and all(0 <= x <= 1 for x in a) for a in stored["accuracy"].values())
    nb = nbformat.read(root / "notebooks/13_linear_attention.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and "STORED_M2 =" in c.source)
    assert 'train_zoology("mamba2", True, 32, s, steps=300, lr=lr)' in cell and "for lr in (1e-2, 3e-2)" in cell
    ow = json.loads((root / "notebooks/results/ch13_mqar_overwrite.json").read_text())
    assert len(ow["runs"]["mamba2"]) == 3 and len(ow["controls"]["mamba2, lr 0.01"]) == 3
