"""Lesson 12's distractor-retrieval comparison (attncourse.diff_noise): the data, the needle/noise read-out, the
head-matched models, and the stored runs."""

import json
from pathlib import Path

import pytest
import torch

from attncourse import diff_noise as dn

STORED = Path(__file__).resolve().parents[1] / "notebooks" / "results" / "ch12_diff_noise.json"


def test_batch_points_each_query_at_its_pair():
    keys, values, targets, needle = dn.batch(torch.Generator().manual_seed(0), 4, 8)
    assert keys.shape == values.shape == (4, 16) and targets.shape == needle.shape == (4, 8)
    for b in range(4):
        for j in range(8):
            assert keys[b, needle[b, j]] == keys[b, 8 + j]  # the needle holds the query's key
            assert values[b, needle[b, j]] == targets[b, j]  # and the answer
    assert (values[:, 8:] == dn.VOCAB).all()  # queries carry no value
    with pytest.raises(ValueError, match="n_pairs"):
        dn.batch(torch.Generator(), 2, dn.VOCAB + 1)


def test_needle_and_noise_on_a_constructed_map():
    n, b, h = 3, 1, 2
    w = torch.zeros(b, h, 2 * n, 2 * n)
    needle = torch.tensor([[1, 0, 2]])  # query j asks for the pair at these positions
    for j in range(n):
        w[0, 0, n + j, needle[0, j]] = 0.7  # head 0: 0.7 on the needle
        w[0, 0, n + j, (needle[0, j] + 1) % n] = -0.2  # and -0.2 on one distractor pair (|.| counts)
        w[0, 1, n + j, n] = 1.0  # head 1: everything on a query position, nothing on any pair
    on_needle, noise, net = dn.needle_and_noise(w, needle)
    torch.testing.assert_close(on_needle, torch.tensor([0.7, 0.0]))
    torch.testing.assert_close(noise, torch.tensor([0.2, 0.0]))
    torch.testing.assert_close(net, torch.tensor([-0.2, 0.0]))
    with pytest.raises(ValueError, match="needle"):
        dn.needle_and_noise(w, needle[:, :2])
    with pytest.raises(TypeError, match="weights"):
        dn.needle_and_noise(w.long(), needle)


def test_models_are_head_matched_and_train():
    soft, diff = dn.new_model("softmax", 0), dn.new_model("differential", 0)
    assert soft.attns[0].n_heads == 4 and diff.attns[0].n_heads == 2 and diff.attns[0].head_dim == 16
    assert [a.lambda_init for a in diff.attns] == pytest.approx([0.2, 0.8 - 0.6 * 2.718281828 ** -0.3])
    n_soft, n_diff = (sum(p.numel() for p in m.parameters()) for m in (soft, diff))
    assert abs(n_soft - n_diff) / n_soft < 0.01  # the same projections; the differential adds lambda and a norm
    with pytest.raises(ValueError, match="name"):
        dn.new_model("sigmoid", 0)
    model, losses = dn.train_run("differential", 0, steps=3, warmup=1)
    assert len(losses) == 3 and all(x == x for x in losses)
    read = dn.read_run(model, 0, queries=256)
    assert len(read["accuracy"]) == len(dn.TEST_PAIRS) and all(0 <= a <= 1 for a in read["accuracy"])


def test_stored_runs_cover_both_models_and_three_seeds():
    store = json.loads(STORED.read_text())
    assert store["recipe"] == dn.RECIPE and store["test_pairs"] == list(dn.TEST_PAIRS)
    for name in dn.MODELS:
        assert sorted(store["runs"][name]) == ["0", "1", "2"]
        for run in store["runs"][name].values():
            assert len(run["accuracy"]) == len(dn.TEST_PAIRS) == len(run["needle"]) == len(run["noise"])
