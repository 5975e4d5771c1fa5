r"""Does the best learning rate move with the width? Chapter 03's width-transfer sweep (muP vs standard).

The model is :func:`attncourse.scaling.train_lookup`'s one attention step: query and key projections
:math:`W_q, W_k \in \mathbb{R}^{32 \times d_k}` read 32-wide tokens, the values are given, and the logit is
:math:`c\, q \cdot k`. Only :math:`d_k` grows. In muP's table for Adam (Yang et al. 2022, Tensor Programs V,
Table 3) both projections are *input* weights (their fan-in, 32, does not grow): initial variance
:math:`1/\text{fan-in}` and a learning rate that does not depend on the width, exactly as the standard
parameterisation (SP) has them. The model has no hidden (width x width) matrix and no learned output layer, so
the one rule in which muP and SP differ here is the attention scale: :math:`c = 1/d_k` (muP) against
:math:`c = 1/\sqrt{d_k}` (SP). The sweep therefore tests that rule alone, on a model where it is the whole of muP.

``python -m attncourse.mup_transfer`` runs the sweep (3 widths x 2 scales x 7 rates x 3 seeds, a few minutes on
one core) and writes ``notebooks/results/ch03_mup_transfer.json``; lesson 03 reads it and reruns a slice.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .scaling import LookupConfig, train_lookup

WIDTHS = (64, 256, 1024)
SCALES = ("d", "sqrt")                     # muP's 1/d_k, SP's 1/sqrt(d_k)
RATES = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
SEEDS = (0, 1, 2)
STEPS, LAST = 200, 40
RESULT = Path(__file__).resolve().parent.parent / "notebooks" / "results" / "ch03_mup_transfer.json"


def final_loss(d_k: int, scale: str, lr: float, seed: int, *, steps: int = STEPS, last: int = LAST) -> float:
    """Mean loss over the last `last` of `steps` Adam steps of :func:`train_lookup` at width `d_k` (4 decimals).

    A run whose loss is not finite counts as ``float('inf')`` (diverged)."""
    if not isinstance(last, int) or isinstance(last, bool) or not 0 < last <= steps:
        raise ValueError(f"last must be an int in 1..steps={steps}, got {last!r}")
    trace = train_lookup(d_k, scale, seed, LookupConfig(lr=lr, steps=steps))
    value = trace["loss"][-last:].mean().item()
    return round(value, 4) if value == value and value != float("inf") else float("inf")


def best_rates(losses: dict[str, list[float]], rates=RATES) -> dict[str, list[float]]:
    """Per seed, the rate with the lowest final loss: ``{"<scale> <width>": [rate per seed]}``.

    `losses` maps ``"<scale> <width> <rate>"`` to one loss per seed (the JSON layout of :func:`sweep`)."""
    keys = sorted({" ".join(k.split()[:2]) for k in losses})
    out = {}
    for key in keys:
        per_rate = [losses[f"{key} {lr:g}"] for lr in rates]                     # (rates, seeds)
        n_seeds = len(per_rate[0])
        out[key] = [rates[min(range(len(rates)), key=lambda i: per_rate[i][s])] for s in range(n_seeds)]
    return out


def sweep(widths=WIDTHS, scales=SCALES, rates=RATES, seeds=SEEDS) -> dict:
    """Every (scale, width, rate, seed) run of :func:`final_loss`; returns the JSON-ready record."""
    losses = {}
    for d_k in widths:
        for scale in scales:
            for lr in rates:
                losses[f"{scale} {d_k} {lr:g}"] = [final_loss(d_k, scale, lr, s) for s in seeds]
                print(scale, d_k, lr, losses[f"{scale} {d_k} {lr:g}"], flush=True)
    return {"widths": list(widths), "scales": list(scales), "rates": list(rates), "seeds": list(seeds),
            "steps": STEPS, "last": LAST, "loss_last40": losses, "best_rate": best_rates(losses, rates),
            "made_by": "python -m attncourse.mup_transfer (or FULL=1 in notebooks/03)"}


if __name__ == "__main__":                                        # pragma: no cover - the stored run
    torch.set_num_threads(1)
    record = sweep()
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULT
    path.write_text(json.dumps(record, indent=1))
    print(json.dumps(record["best_rate"]))
