"""Lesson 13's stored FULL=1 run at N = 32 pairs (notebooks/results/ch13_zoology_n32_full.json) is what the lesson's
cell trains: the recipe in the file (pairs, steps, seeds, models, convolution) is the one in the notebook's cell, and
every model has one held-out accuracy per seed. (Retraining one run takes about 20 s of CPU: the notebook's FULL=1
run does it.)"""

import json
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def test_stored_n32_run_matches_the_lesson_recipe():
    stored = json.loads((ROOT / "notebooks" / "results" / "ch13_zoology_n32_full.json").read_text())
    nb = nbformat.read(ROOT / "notebooks" / "13_linear_attention.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and "STORED_ZOO32 =" in c.source)
    ns = {}
    exec(next(line for line in cell.splitlines() if line.startswith("ZOO32 =")), ns)
    recipe = ns["ZOO32"]
    assert stored["pairs"] == recipe["pairs"] and stored["steps"] == recipe["steps"]
    assert stored["seeds"] == list(recipe["seeds"]) and stored["short_conv"] is True
    assert set(stored["accuracy"]) == {f"{kind} + conv" for kind in recipe["kinds"]}
    for accs in stored["accuracy"].values():
        assert len(accs) == len(recipe["seeds"]) and all(0.0 <= a <= 1.0 for a in accs)
    assert "train_zoology(kind, True, ZOO32[\"pairs\"], s, steps=ZOO32[\"steps\"])" in cell


def test_stored_lr_sweep_matches_the_lesson_recipe():
    """Review 10: the per-method learning-rate sweep (Zoology's protocol) in the file is the notebook's recipe, every
    (method, learning rate) has one accuracy per seed, and the best rate is picked by the mean over seeds."""
    from attncourse.mqar_tokens import best_lr

    stored = json.loads((ROOT / "notebooks" / "results" / "ch13_zoology_lr_full.json").read_text())
    nb = nbformat.read(ROOT / "notebooks" / "13_linear_attention.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and "STORED_LR =" in c.source)
    ns = {}
    exec(next(line for line in cell.splitlines() if line.startswith("LR_SWEEP =")), ns)
    recipe = ns["LR_SWEEP"]
    assert stored["pairs"] == recipe["pairs"] and stored["steps"] == recipe["steps"] and stored["short_conv"] is True
    assert stored["seeds"] == list(recipe["seeds"]) and set(stored["accuracy"]) == set(recipe["kinds"])
    for by_lr in stored["accuracy"].values():
        assert set(by_lr) == {str(lr) for lr in recipe["lrs"]}
        assert all(len(accs) == 3 and all(0.0 <= a <= 1.0 for a in accs) for accs in by_lr.values())
    assert best_lr({"0.01": [0.5, 0.5, 0.5], "0.03": [0.9, 0.1, 0.6]}) == "0.03"  # the mean, not the best seed
