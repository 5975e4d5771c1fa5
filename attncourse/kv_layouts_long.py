r"""Chapter 05's longer from-scratch check: MLA-64 against GQA-2 (the same 64 cached numbers per token and layer)
trained twice as long as :mod:`attncourse.kv_layouts`'s 300 steps, at two peak learning rates.

Same model, data, batches and seeds as :mod:`attncourse.kv_layouts`; only the number of steps (600) and the
one-cycle peak (3e-3 as there, and 1e-2) change. ``python -m attncourse.kv_layouts_long LR LAYOUT`` trains one
layout on seeds 0-2 at one rate, one run after the other in this process (one thread), and writes its held-out
curves (every 100 steps) to a part file, so that runs in parallel never write one file; ``python -m
attncourse.kv_layouts_long merge`` gathers the parts into ``notebooks/results/ch05_layouts_long.json``. At 3e-3 the
seed-0 weights of MLA-64 are kept (``ch05_layouts_long_mla64_seed0.pt``), which lesson 05 reloads and measures again.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .char_lm import shakespeare_chars
from .kv_layouts import held_out_windows, train_layout

LONG_LAYOUTS = ("GQA-2", "MLA-64")
LONG_STEPS, LONG_EVAL_EVERY, LONG_SEEDS = 600, 100, (0, 1, 2)
LONG_LRS = ("3e-3", "1e-2")
RESULT, WEIGHTS = "ch05_layouts_long.json", "ch05_layouts_long_mla64_seed0.pt"


def run(lr: str, layout: str, out_dir: str | Path = "notebooks/results") -> list[list[float]]:
    """Train `layout` (one of LONG_LAYOUTS) on every seed at peak rate `lr` (one of LONG_LRS, as text), write the
    held-out curves to a part file; returns them (one per seed)."""
    if lr not in LONG_LRS:
        raise ValueError(f"lr must be one of {LONG_LRS}, got {lr!r}")
    if layout not in LONG_LAYOUTS:
        raise ValueError(f"layout must be one of {LONG_LAYOUTS}, got {layout!r}")
    torch.set_num_threads(1)
    out_dir = Path(out_dir)
    train, held_text, vocab = shakespeare_chars(out_dir.parent / "data" / "shakespeare" / "coriolanus.txt")
    held = held_out_windows(held_text)
    curves = []
    for seed in LONG_SEEDS:
        model, _, curve = train_layout(layout, train, len(vocab), seed, LONG_STEPS, held=held,
                                       eval_every=LONG_EVAL_EVERY, lr=float(lr))
        curves.append(curve)
        print(lr, layout, seed, round(curve[-1], 4), flush=True)
        if lr == "3e-3" and layout == "MLA-64" and seed == 0:
            torch.save(model.state_dict(), out_dir / WEIGHTS)
    part = {"lr": lr, "layout": layout, "curves": curves}
    (out_dir / f"{RESULT[:-5]}.{lr}.{layout}.part.json").write_text(json.dumps(part))
    return curves


def merge(out_dir: str | Path = "notebooks/results") -> dict:
    """Gather the part files written by :func:`run` into the stored JSON and delete them; returns what is stored."""
    out_dir = Path(out_dir)
    path = out_dir / RESULT
    stored = json.loads(path.read_text()) if path.exists() else {
        "layouts": list(LONG_LAYOUTS), "seeds": list(LONG_SEEDS), "steps": LONG_STEPS,
        "eval_every": LONG_EVAL_EVERY, "curves": {}}
    for part_path in sorted(out_dir.glob(f"{RESULT[:-5]}.*.part.json")):
        part = json.loads(part_path.read_text())
        stored["curves"].setdefault(part["lr"], {})[part["layout"]] = part["curves"]
        part_path.unlink()
    stored["curves"] = {lr: stored["curves"][lr] for lr in LONG_LRS if lr in stored["curves"]}
    path.write_text(json.dumps(stored, indent=1))
    return stored


if __name__ == "__main__":  # python -m attncourse.kv_layouts_long LR LAYOUT | merge
    if sys.argv[1:] == ["merge"]:
        merge()
    else:
        run(sys.argv[1], sys.argv[2])
