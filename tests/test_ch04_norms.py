"""Lesson 04's stored head readings of the char LM (notebooks/results/ch04_char_lm_norms.json): the same three models
as the stored ablation run, and the rank claims the lesson makes hold on the stored numbers."""

import json
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "notebooks" / "results"


def spearman(a, b):
    ra, rb = (t.argsort(-1).argsort(-1).double() for t in (a, b))
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))


def test_stored_readings_match_the_ablation_run_and_the_lesson():
    norms = json.loads((RESULTS / "ch04_char_lm_norms.json").read_text())
    ablation = json.loads((RESULTS / "ch04_char_lm_head_ablation.json").read_text())
    assert norms["seeds"] == ablation["seeds"] == [0, 1, 2] and norms["val_loss"] == ablation["val_loss"]
    reads = torch.tensor(norms["reads"], dtype=torch.float64)
    assert reads.shape == (3, 2, 4, 3)
    by_head, cost = reads.flatten(1, 2), torch.tensor(ablation["change"], dtype=torch.float64).flatten(1)
    rho = torch.stack([spearman(by_head[..., k], cost) for k in range(3)], -1)     # (seeds, 3)
    assert (rho[:, 1] > rho[:, 0]).all() and (rho[:, 1] > 0.7).all() and (rho[:, 0] < 0.6).all()
    assert all((by_head[..., k].argmax(-1) == cost.argmax(-1)).all() for k in range(3))
