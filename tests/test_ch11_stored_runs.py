"""Lesson 11's stored multi-process runs are re-derived: the default run prints them instead of launching four
gloo processes, so a test launches them and compares (the W = 4 ring training step, and the Ulysses and ring byte
counts at W = 2 and 4)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from attncourse.ring import distributed_attention, ring_bytes_per_rank, ring_pair_work, ulysses_bytes_per_rank
from attncourse.ring_train import ring_training_record

RESULTS = Path(__file__).resolve().parents[1] / "notebooks" / "results"


def test_stored_w4_ring_training_step_is_what_a_launch_gives():
    stored = json.loads((RESULTS / "ring_training_w4.json").read_text())
    again = ring_training_record(stored["world_size"], seed=stored["seed"])
    b, h, t, d = stored["shape"]
    for layout, rec in stored["layouts"].items():
        new = again["layouts"][layout]
        assert rec["pairs"] == new["pairs"] == ring_pair_work(t, stored["world_size"], layout=layout)
        assert rec["bytes"] == new["bytes"] == [ring_bytes_per_rank(b, h, t, d, stored["world_size"], 8)] * 4
        assert rec["bytes_backward"] == new["bytes_backward"]
        assert max(rec["max_err"].values()) < 1e-9 and max(new["max_err"].values()) < 1e-9


def test_stored_ulysses_bytes_are_what_a_launch_counts():
    stored = json.loads((RESULTS / "ulysses_bytes.json").read_text())
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 48, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    for w in (2, 4):
        got = distributed_attention(q, k, v, w, methods=("ring", "ulysses"), causal=(True,))
        for method in ("ring", "ulysses"):
            rec = [r for r in stored["runs"] if r["world_size"] == w and r["method"] == method][0]
            assert rec["bytes_per_rank"] == got[method, True][1]
        assert got["ulysses", True][1] == [ulysses_bytes_per_rank(1, 4, 48, 16, w, 8)] * w
