"""The stored warm-up runs of lesson 04 (notebooks/results/warmup_runs.json) are what the lesson's code trains."""
import json
from pathlib import Path

import nbformat
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def lesson_namespace():
    # The imports (cell 1), the neighbour task's sizes, and the warm-up cell's definitions, as the lesson runs them.
    nb = nbformat.read(ROOT / "notebooks" / "04_multi_head_attention.ipynb", as_version=4)
    task = next(c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith("VOCAB, T_SEQ, D_MODEL"))
    warm = next(c.source for c in nb.cells if c.cell_type == "code" and "def train_deep" in c.source)
    ns = {}
    exec(nb.cells[1].source, ns)
    exec(task.split("models = {}")[0], ns)
    exec(warm.split("if FULL or not")[0], ns)
    return ns


@pytest.mark.parametrize("name, seed", [("post-norm, no warm-up", 0), ("post-norm, 50-step warm-up", 1),
                                        ("pre-norm, no warm-up", 2)])
def test_stored_runs_are_what_the_lesson_trains(name, seed):
    stored = json.loads((ROOT / "notebooks" / "results" / "warmup_runs.json").read_text())
    ns = lesson_namespace()
    assert stored["steps"] == ns["WU_STEPS"] and stored["lr"] == ns["WU_LR"] and stored["every"] == ns["WU_EVERY"]
    run = stored["runs"][name][seed]
    assert len(run) == stored["steps"] // stored["every"] + 1
    norm_first, warmup = ns["WU_RUNS"][name]
    curve = ns["train_deep"](norm_first, warmup, seed, steps=20)  # the first 20 of the same 150 steps
    torch.testing.assert_close(torch.tensor(curve), torch.tensor(run[:3]), atol=1e-4, rtol=1e-4)
