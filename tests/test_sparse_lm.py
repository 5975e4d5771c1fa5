"""attncourse.sparse_lm (chapter 14's character-LM comparison at an equal key budget): small and fast, no training
beyond two steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attncourse import sparse_lm as sl
from attncourse.sdpa import scaled_dot_product_attention

ROOT = Path(__file__).resolve().parents[1]
T, BLK, BUD = 40, 4, 12


def _layer(method: str, budget: int = BUD, seed: int = 0) -> sl.SparseAttention:
    torch.manual_seed(seed)
    return sl.SparseAttention(method, 32, 2, 16, block=BLK, budget=budget)


@pytest.mark.parametrize("method", sl.METHODS)
def test_every_query_reads_at_most_the_budget_causally(method):
    layer = _layer(method)
    x = torch.randn(3, T, 32)
    b, t = x.shape[:2]
    q, k, _ = (z.reshape(b, t, 2, 16).transpose(1, 2) for z in layer.qkv(x).chunk(3, -1))
    mask = layer._mask(x, q, k).expand(b, 2, t, t)  # (B, H, T, T)
    assert not (mask & ~torch.ones(t, t, dtype=torch.bool).tril()).any()  # causal
    if method != "dsa":  # a block method reads its own block; DSA's indexer may leave out the query's own token
        assert mask.diagonal(dim1=-2, dim2=-1).all()
    reads = mask.sum(-1)
    if method == "dense":
        assert torch.equal(reads[0, 0], torch.arange(1, t + 1))
    else:
        assert reads.max() <= BUD
    if method in ("window", "dsa"):  # exactly min(t + 1, budget) keys: single tokens
        assert torch.equal(reads[0, 0], torch.arange(1, t + 1).clamp(max=BUD))
    if method == "fixed":
        assert mask[..., BLK:, :BLK].all()  # the sink block, for every later query
    if method == "nsa":  # NSA's forced local blocks: its own and the one before
        own = torch.arange(t) // BLK
        for i in range(BLK, t):
            assert mask[..., i, (own[i] - 1) * BLK:own[i] * BLK].all()


@pytest.mark.parametrize("method", ("window", "fixed", "moba", "dsa"))
def test_a_budget_covering_the_sequence_is_dense_attention(method):
    dense, sparse = _layer("dense"), _layer(method, budget=T)
    sparse.load_state_dict(dense.state_dict(), strict=False)
    x = torch.randn(2, T, 32)
    torch.testing.assert_close(sparse(x), dense(x))


def test_the_layer_is_checked_against_pytorch_attention():
    layer, x = _layer("moba"), torch.randn(2, T, 32)
    b, t = x.shape[:2]
    q, k, v = (z.reshape(b, t, 2, 16).transpose(1, 2) for z in layer.qkv(x).chunk(3, -1))
    from attncourse.positions import apply_rope
    q, k = apply_rope(q), apply_rope(k)
    mask = layer._mask(x, q, k)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, mask), ref)
    torch.testing.assert_close(layer(x), layer.out(ref.transpose(1, 2).reshape(b, t, -1)))


def test_the_indexer_loss_reaches_only_the_indexer():
    layer, x = _layer("dsa"), torch.randn(2, T, 32, requires_grad=True)
    layer(x)
    layer.aux_loss.backward()
    assert layer.idx_q.weight.grad.abs().sum() > 0 and layer.idx_k.weight.grad.abs().sum() > 0
    assert layer.qkv.weight.grad is None and x.grad is None  # the input is detached; the target is not differentiated


def test_validation_and_a_replayed_slice(monkeypatch):
    with pytest.raises(ValueError, match="method"):
        sl.SparseAttention("quest")
    with pytest.raises(ValueError, match="budget"):
        sl.SparseAttention("moba", block=8, budget=12)
    with pytest.raises(ValueError, match="token_mask"):
        sl.token_mask("moba", 8)
    with pytest.raises(ValueError, match="stop"):
        sl.train("dense", 0, steps=5, stop=6)
    monkeypatch.setattr(sl, "CONTEXT", 24)  # a short window and batch: the replay, not the model, is tested
    monkeypatch.setattr(sl, "BATCH", 2)
    data = (torch.randint(0, 20, (500,)), torch.randint(0, 20, (100,)), "x" * 20)
    a, b = sl.train("moba", 0, data, stop=2), sl.train("moba", 0, data, stop=2)
    assert a == b and len(a["train"]) == 2  # the same seed replays the same run


def test_stored_run_is_complete():
    path = ROOT / "notebooks/results/ch14_sparse_lm_full.json"
    stored = json.loads(path.read_text())
    assert stored["config"]["seeds"] == [0, 1, 2] and stored["config"]["budget"] == sl.BUDGET
    assert set(stored["runs"]) == set(sl.METHODS)
    for method, runs in stored["runs"].items():
        assert set(runs) == {"0", "1", "2"}, method
        for run in runs.values():
            assert len(run["train"]) == sl.STEPS and 0 < run["far_loss"] < 5
            if method == "dense":  # every earlier key: t + 1 at position t, averaged over FAR..CONTEXT-1
                assert run["far_keys_read"] == (sl.FAR + 1 + sl.CONTEXT) / 2
            else:
                assert run["far_keys_read"] <= sl.BUDGET


def test_stored_longer_control_is_the_same_recipe_twice_as_long():
    short = json.loads((ROOT / "notebooks/results/ch14_sparse_lm_full.json").read_text())
    long = json.loads((ROOT / "notebooks/results/ch14_sparse_lm_long_full.json").read_text())
    assert long["config"] == {**short["config"], "steps": 2 * sl.STEPS} and list(long["runs"]) == ["dense", "window"]
    for method, runs in long["runs"].items():
        assert set(runs) == {"0", "1", "2"} and all(len(r["train"]) == 2 * sl.STEPS for r in runs.values())
        for seed, run in runs.items():  # the same batches: the first steps of a one-cycle run to 600 differ only by
            assert run["train"][0] == short["runs"][method][seed]["train"][0]  # the rate, which starts equal


def test_nsa_with_its_window_branch_reads_at_most_the_budget():
    layer = _layer("nsa_win")
    x = torch.randn(2, T, 32)
    layer(x)  # the distinct keys of its three branches: the window, its own and the best earlier blocks
    assert layer.keys_read.max() <= BUD and layer.keys_read[-1] > BUD // 2
    assert layer.gate.out_features == 3 * 2  # compressed, selected and window, per head
    with pytest.raises(ValueError, match="method"):
        sl.SparseAttention("nsa_window", 32, 2, 16)


def test_stored_window_branch_control_is_the_same_recipe():
    short = json.loads((ROOT / "notebooks/results/ch14_sparse_lm_full.json").read_text())
    ctrl = json.loads((ROOT / "notebooks/results/ch14_sparse_lm_nsawin_full.json").read_text())
    assert ctrl["config"] == short["config"] and list(ctrl["runs"]) == ["nsa_win"]
    for seed, run in ctrl["runs"]["nsa_win"].items():
        assert len(run["train"]) == sl.STEPS and run["far_keys_read"] <= sl.BUDGET


@pytest.mark.parametrize("tag", ["3e-3", "3e-2"])
def test_stored_learning_rate_runs_are_the_same_recipe(tag):
    short = json.loads((ROOT / "notebooks/results/ch14_sparse_lm_full.json").read_text())
    other = json.loads((ROOT / f"notebooks/results/ch14_sparse_lm_lr{tag}_full.json").read_text())
    assert other["config"] == {**short["config"], "lr": float(tag)}
    assert list(other["runs"]) == ["dense", "window", "moba", "nsa_win"]
    ctrl = json.loads((ROOT / "notebooks/results/ch14_sparse_lm_nsawin_full.json").read_text())["runs"]
    for method, runs in other["runs"].items():
        assert set(runs) == {"0", "1", "2"}, method
        for seed, run in runs.items():  # the same initial weights and batches: the loss before any update is equal
            first = (ctrl if method == "nsa_win" else short["runs"])[method][seed]["train"][0]
            assert len(run["train"]) == sl.STEPS and run["train"][0] == first and run["far_keys_read"] <= 192.5
