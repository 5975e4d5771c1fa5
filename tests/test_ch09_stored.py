"""The stored process-level memory run that lesson 09 reads by default (FULL=1 measures it again)."""
import json
from pathlib import Path

import numpy as np

RUN = Path(__file__).resolve().parents[1] / "notebooks" / "results" / "ch09_process_memory.json"


def test_stored_memory_run_has_three_rounds_and_the_shape_the_lesson_asserts():
    stored = json.loads(RUN.read_text())
    rounds = {impl: np.array(r) for impl, r in stored["MiB, (round, T)"].items()}
    assert set(rounds) == {"naive", "ours", "torch"} and stored["lengths"]["naive"] == [512, 1024, 2048]
    assert all(r.shape == (3, 3) and (r > 0).all() for r in rounds.values())
    memory = {impl: np.median(r, axis=0) for impl, r in rounds.items()}
    assert memory["naive"][2] / memory["naive"][1] > 3.0          # O(T^2)
    assert memory["ours"][2] / memory["ours"][1] < 2.6            # O(T)
    assert memory["ours"][2] < memory["naive"][2] / 8
