"""Lesson 14's stored FULL=1 group-selection runs (notebooks/results/ch14_groups_full.json) are what the lesson's
recipe trains: its runs and schedule match the notebook's cell, 3 seeds each, and a shared choice loads exactly its
own block and n earlier ones."""

import json
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
STORED = json.loads((ROOT / "notebooks" / "results" / "ch14_groups_full.json").read_text())


def recipe():
    nb = nbformat.read(ROOT / "notebooks" / "14_learned_sparse_attention.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and "STORED_GROUPS =" in c.source)
    ns = {}
    for line in cell.splitlines():
        if line.startswith(("GROUP_RUNS =", "GROUP_SCHEDULE =")):
            exec(line, ns)
    return ns["GROUP_RUNS"], ns["GROUP_SCHEDULE"]


def test_stored_group_runs_match_the_lesson_recipe():
    runs, schedule = recipe()
    assert STORED["schedule"] == schedule and STORED["seeds"] == [0, 1, 2]
    assert set(STORED["runs"]) == {f"{sel}/{n}" for sel, n in runs}
    for name, rs in STORED["runs"].items():
        assert len(rs) == 3
        assert all(set(r) >= {"accuracy", "needle_accuracy", "loss", "recall", "blocks_loaded"} for r in rs)
        if name.startswith("shared/"):
            assert all(r["blocks_loaded"] == int(name.split("/")[1]) + 1 for r in rs)
        assert all(0 <= r["recall"] <= 1 and 0 <= r["accuracy"] <= r["needle_accuracy"] <= 1 for r in rs)
