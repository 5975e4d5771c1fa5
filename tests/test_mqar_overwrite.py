"""attncourse.mqar_overwrite (chapter 13's MQAR with overwrites): the batch against a loop, bad input, and the stored
run against the module's constants. Small and fast: nothing here trains for long."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attncourse import mqar_overwrite as mo

ROOT = Path(__file__).resolve().parents[1]


def test_batch_targets_are_the_last_value_written():
    tokens, targets, writes = mo.overwrite_batch(torch.Generator().manual_seed(3), 16, n_keys=5, n_writes=12, vocab=20)
    assert tokens.shape == (16, 2 * 12 + 5) and targets.shape == writes.shape == (16, 5)
    for b in range(16):
        pairs = tokens[b, :24].view(12, 2).tolist()
        queried = tokens[b, 24:].tolist()
        assert sorted(queried) == sorted(set(k for k, _ in pairs))  # every written key queried once
        for j, key in enumerate(queried):
            vals = [v - 20 for k, v in pairs if k == key]
            assert targets[b, j] == vals[-1] and writes[b, j] == len(vals)
    assert (writes > 1).any()  # some keys are overwritten


def test_bad_input_and_a_tiny_run():
    with pytest.raises(ValueError, match="n_writes"):
        mo.overwrite_batch(torch.Generator(), 2, n_keys=8, n_writes=4)
    with pytest.raises(ValueError, match="n_keys"):
        mo.overwrite_batch(torch.Generator(), 2, n_keys=70, n_writes=80, vocab=64)
    r = mo.train_overwrite("linear", 0, steps=2, n_keys=4, n_writes=6)
    assert 0 <= r["accuracy"] <= r["any_written"] <= 1  # the last value is one of the values written


def test_stored_run_matches_the_module():
    path = ROOT / "notebooks/results/ch13_mqar_overwrite.json"
    stored = json.loads(path.read_text())
    cfg = stored["config"]
    assert (cfg["n_keys"], cfg["n_writes"], cfg["vocab"], cfg["steps"], cfg["lr"], cfg["batch"]) == (
        mo.N_KEYS, mo.N_WRITES, mo.VOCAB, mo.STEPS, mo.LR, mo.BATCH)
    assert cfg["seeds"] == [0, 1, 2] and all(len(runs) == 3 for runs in stored["runs"].values())
    assert set(stored["runs"]) == set(mo.KINDS)  # softmax attention included: the control
