"""attncourse.text_hybrid (chapter 13's char LM comparison) and attncourse.flex_timing's stored run: small and fast;
neither trains for long nor compiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attncourse import text_hybrid as th
from attncourse.char_lm import shakespeare_chars

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 60


def test_one_parameter_budget_and_shapes():
    counts = {name: th.n_params(th.build(name, VOCAB, 0)) for name in th.SCHEDULES}
    assert max(counts.values()) / min(counts.values()) < 1.005, counts
    model = th.build("hybrid 3:1", VOCAB, 0)
    assert [type(m).__name__ for m in model.mixers] == ["GatedDeltaNet"] * 3 + ["GatedRopeAttention"]
    assert model(torch.randint(0, VOCAB, (2, 70))).shape == (2, 70, VOCAB)


def test_softmax_conv_control_is_the_softmax_layer_plus_the_convolution():
    """"C" is "A" with a causal depthwise convolution of 4 taps and SiLU on q, k and v: with every tap zero but the
    current token's at 1 it equals "A" whose projection is followed by SiLU."""
    a, c = th.GatedRopeAttention(32, 2, 16), th.GatedRopeAttention(32, 2, 16, short_conv=True)
    taps = torch.zeros(96, th.CONV_SIZE)
    taps[:, -1] = 1.0  # the current token only
    c.load_state_dict({**a.state_dict(), "conv_weight": taps}, strict=True)
    a.qkv = torch.nn.Sequential(a.qkv, torch.nn.SiLU())
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(c(x), a(x))
    with pytest.raises(TypeError, match="short_conv"):
        th.GatedRopeAttention(32, 2, 16, short_conv=1)
    assert [type(m).__name__ for m in th.build("softmax + conv", VOCAB, 0).mixers] == ["GatedRopeAttention"] * 4


def test_causal():
    """A token's logits do not change when later tokens do, for every schedule (the chunked GDN and the masked
    softmax both)."""
    x = torch.randint(0, VOCAB, (1, 80))
    y = x.clone()
    y[0, 50:] = (y[0, 50:] + 1) % VOCAB
    for name in th.SCHEDULES:
        model = th.build(name, VOCAB, 0).eval()
        torch.testing.assert_close(model(x)[:, :50], model(y)[:, :50])


def test_bad_input():
    with pytest.raises(ValueError, match="pattern"):
        th.TextHybrid(VOCAB, "GXA", 64)
    with pytest.raises(ValueError, match="schedule"):
        th.build("mamba", VOCAB, 0)
    with pytest.raises(ValueError, match="stop"):
        th.train("softmax", 0, (torch.zeros(500, dtype=torch.long), torch.zeros(500, dtype=torch.long), "ab"),
                 steps=3, stop=4)


def test_stored_run_matches_the_code():
    stored = json.loads((ROOT / "notebooks/results/ch13_text_lm.json").read_text())
    cfg = stored["config"]
    assert (cfg["context"], cfg["d_model"], cfg["steps"], cfg["batch"]) == (th.CONTEXT, th.D_MODEL, th.STEPS, th.BATCH)
    data = shakespeare_chars(ROOT / "notebooks/data/shakespeare/coriolanus.txt")
    for name, entry in stored["schedules"].items():
        assert entry["pattern"] == th.SCHEDULES[name]
        assert entry["n_params"] == th.n_params(th.build(name, len(data[2]), 0))
        assert sorted(entry["runs"]) == ["0", "1", "2"]
        for run in entry["runs"].values():
            assert len(run["train"]) == th.STEPS and run["eval_steps"][-1] == th.STEPS
    # the first 2 steps of the softmax model's seed 0, re-measured
    live = th.train("softmax", 0, data, stop=2)
    assert live["train"] == pytest.approx(stored["schedules"]["softmax"]["runs"]["0"]["train"][:2], abs=2e-3)


def test_flex_stored_run():
    stored = json.loads((ROOT / "notebooks/results/ch14_flex_compiled.json").read_text())
    from attncourse import flex_timing as ft

    assert (stored["config"]["T"], stored["config"]["block"], stored["config"]["top_k"]) == (ft.T, ft.BLOCK, ft.TOP_K)
    n = ft.T // ft.BLOCK
    for run in stored["runs"].values():
        assert run["causal_blocks"] == ft.H * n * (n + 1) // 2
        assert 0 < run["listed_blocks"] < run["causal_blocks"] and run["max_abs_err"] < 1e-4
        assert set(run["ms"]) == {"moba", "causal", "sdpa"}


def test_flex_block_mask_lists_the_union():
    """The BlockMask built from a selection lists, per query tile, the blocks any of its queries chose (eager: no
    compile)."""
    from attncourse import flex_timing as ft
    from attncourse.learned_sparse import moba_gate

    q = ft.ar1_queries(0.99, 0, shape=(1, 1, 256, 16))
    k = torch.randn(1, 1, 256, 16, generator=torch.Generator().manual_seed(1))
    sel = moba_gate(q, k, 32, 2)
    mask, union = ft.moba_block_mask(sel, 32)
    assert torch.equal(mask.kv_num_blocks, union.sum(-1).int())
    assert union.sum() < 8 * 9 // 2  # correlated queries: fewer than every causal (tile, block) pair


def test_stored_lr_run_matches_the_code():
    """The runs at a peak rate of 1e-2 (chapter 13's per-model rate): same recipe but the rate; the first 2 steps of
    the control's seed 0 re-measured."""
    stored = json.loads((ROOT / "notebooks/results/ch13_text_lm_lr.json").read_text())
    cfg = stored["config"]
    assert cfg["lr"] == 0.01 and (cfg["context"], cfg["steps"], cfg["batch"]) == (th.CONTEXT, th.STEPS, th.BATCH)
    assert {n for n, e in stored["schedules"].items() if sorted(e["runs"]) == ["0", "1", "2"]} == set(th.SCHEDULES)
    data = shakespeare_chars(ROOT / "notebooks/data/shakespeare/coriolanus.txt")
    live = th.train("softmax + conv", 0, data, stop=2, lr=0.01)
    assert live["train"] == pytest.approx(stored["schedules"]["softmax + conv"]["runs"]["0"]["train"][:2], abs=2e-3)
