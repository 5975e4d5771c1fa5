"""The stored induction runs of lesson 12 (notebooks/results/induction_runs.pt) are what the lesson's code trains."""
from pathlib import Path

import nbformat
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def lesson_namespace():
    # Cells 1 and 3 (imports, data) and the training function of cell 5, run as the lesson runs them.
    nb = nbformat.read(ROOT / "notebooks" / "12_attention_variants.ipynb", as_version=4)
    src5 = next(c.source for c in nb.cells if c.cell_type == "code" and "def train_induction" in c.source)
    ns = {}
    exec(nb.cells[1].source, ns)
    exec(nb.cells[3].source, ns)
    exec(src5.split("STEPS = ")[0], ns)
    return ns


@pytest.mark.parametrize("attention, seed", [("softmax", 1), ("sigmoid", 2), ("differential", 0), ("sink_logit", 1),
                                             ("gated", 2)])
def test_stored_runs_are_what_the_lesson_trains(attention, seed, monkeypatch):
    monkeypatch.chdir(ROOT / "notebooks")
    stored = torch.load(ROOT / "notebooks" / "results" / "induction_runs.pt")
    assert stored["steps"] == 250 and len(stored["runs"]) == 15  # 5 attentions x 3 seeds
    run = stored["runs"][f"{attention}/{seed}"]
    assert run["hist"]["step"] == list(range(0, 251, 10))
    _, hist = lesson_namespace()["train_induction"](attention, 30, seed)  # the first 30 of the same 250 steps
    for key in ("repeat", "first", "induction", "prev"):
        torch.testing.assert_close(torch.tensor(hist[key]), torch.tensor(run["hist"][key][:4]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention, seed", [("sigmoid", 1), ("gated", 0)])
def test_stored_variant_runs_are_what_the_lesson_trains(attention, seed, monkeypatch):
    """results/variant_runs.pt (sections 3, 4 and 4b): the recipe the lesson declares, and its first 30 steps retrained."""
    monkeypatch.chdir(ROOT / "notebooks")
    nb = nbformat.read(ROOT / "notebooks" / "12_attention_variants.ipynb", as_version=4)
    recipe_src = next(c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith("RECIPE = "))
    recipe = eval(recipe_src.splitlines()[0].split("=", 1)[1].split("#")[0])  # dict(steps=..., lr=..., warmup=...)
    stored = torch.load(ROOT / "notebooks" / "results" / "variant_runs.pt")
    assert stored["recipe"] == recipe and len(stored["runs"]) == 15  # 5 attentions x 3 seeds
    run = stored["runs"][f"{attention}/{seed}"]
    assert run["hist"]["step"] == list(range(0, recipe["steps"] + 1, 10))
    _, hist = lesson_namespace()["train_induction"](attention, 30, seed, lr=recipe["lr"], warmup=recipe["warmup"])
    for key in ("repeat", "first", "induction", "prev"):
        torch.testing.assert_close(torch.tensor(hist[key]), torch.tensor(run["hist"][key][:4]), atol=1e-4, rtol=1e-4)
