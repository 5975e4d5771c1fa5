"""Chapter 11's trained recall model (attncourse.kv_recall_trained): the training loop runs and learns the loss on
answers only, bad arguments are refused, and the stored table is what the stored weights measure (fast: no
training beyond a few steps)."""

import json
from pathlib import Path

import pytest
import torch

from attncourse.kv_recall_trained import BUDGETS, POLICIES, new_model, recall_table, train_recall_model

RESULTS = Path(__file__).resolve().parent.parent / "notebooks" / "results"


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: a second thread only spins
    yield
    torch.set_num_threads(threads)


def test_training_stops_at_max_steps_or_target(one_thread):
    model, run = train_recall_model(0, max_steps=50, batch=8)
    assert not model.training and run == {"losses": [], "steps": 50, "val": 0.0}  # validated every 100 steps only
    _, run = train_recall_model(0, max_steps=300, batch=8, target=0.01)  # any validation accuracy meets it
    assert run["steps"] == 100 and len(run["losses"]) == 1 and run["losses"][0] > 2.0  # ln 16 = 2.77 at chance


@pytest.mark.parametrize("kwargs,error", [({"seed": -1}, TypeError), ({"seed": 0, "max_steps": 0}, ValueError),
                                          ({"seed": 0, "batch": 1.5}, TypeError), ({"seed": 0, "lr": 0}, ValueError),
                                          ({"seed": 0, "target": 1.5}, ValueError)])
def test_bad_arguments(kwargs, error):
    with pytest.raises(error):
        train_recall_model(**kwargs)


def test_stored_table_is_what_the_stored_weights_measure(one_thread):
    record = json.loads((RESULTS / "ch11_recall_trained.json").read_text())
    states = torch.load(RESULTS / "ch11_recall_trained.pt", weights_only=True)
    assert sorted(record["seeds"]) == sorted(states) == ["0", "1", "2"] and record["budgets"] == list(BUDGETS)
    model = new_model()
    model.load_state_dict(states["0"])
    got, stored = recall_table(model.eval(), 0, n_prompts=record["n_prompts"]), record["seeds"]["0"]
    assert abs(got["full"] - stored["full"]) < 0.01
    for name in POLICIES:
        assert max(abs(a - b) for a, b in zip(got["policies"][name], stored["policies"][name])) < 0.01, name
