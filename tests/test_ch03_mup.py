"""attncourse.mup_transfer: the width sweep's pieces on tiny runs (the sweep itself is stored, FULL=1)."""

import json
from pathlib import Path

import pytest

from attncourse import mup_transfer
from attncourse.scaling import LookupConfig, train_lookup


def test_final_loss_is_the_mean_of_the_last_steps():
    trace = train_lookup(8, "d", 0, LookupConfig(lr=1e-2, steps=6))
    assert mup_transfer.final_loss(8, "d", 1e-2, 0, steps=6, last=2) == round(trace["loss"][-2:].mean().item(), 4)
    with pytest.raises(ValueError, match="last"):
        mup_transfer.final_loss(8, "d", 1e-2, 0, steps=6, last=7)


def test_best_rates_picks_the_lowest_loss_per_seed():
    losses = {"d 64 0.1": [3.0, 1.0], "d 64 0.01": [2.0, 4.0], "sqrt 64 0.1": [1.0, 1.0], "sqrt 64 0.01": [2.0, 0.5]}
    assert mup_transfer.best_rates(losses, rates=(0.1, 0.01)) == {"d 64": [0.01, 0.1], "sqrt 64": [0.1, 0.01]}


def test_stored_sweep_is_complete_and_its_best_rates_match():
    stored = json.loads((Path(__file__).parents[1] / "notebooks/results/ch03_mup_transfer.json").read_text())
    keys = {f"{s} {w} {lr:g}" for s in stored["scales"] for w in stored["widths"] for lr in stored["rates"]}
    assert set(stored["loss_last40"]) == keys
    assert all(len(v) == len(stored["seeds"]) for v in stored["loss_last40"].values())
    assert mup_transfer.best_rates(stored["loss_last40"], stored["rates"]) == stored["best_rate"]
