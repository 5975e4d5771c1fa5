"""Longer runs of chapter 01's two decoders (the course's and Bahdanau et al.'s), for ``FULL=1``.

:func:`train_checkpointed` trains one model exactly as :func:`~attncourse.seq2seq.run_seeds` does (same seed, same
batches, same Adam) and measures its greedy accuracy by input length at the steps named in `checkpoints`; the
first checkpoints of a long run are therefore the short run's numbers (chapter 01 asserts it against the stored
200-step run). :func:`main` writes ``notebooks/results/ch01_bahdanau_long.json``.
"""

from __future__ import annotations

import io
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

from . import _validate
from ._procs import forked_map
from .seq2seq import Seq2SeqConfig, accuracy_by_length, build_model, train

STORED = Path(__file__).resolve().parents[1] / "notebooks" / "results" / "ch01_bahdanau_long.json"
CHECKPOINTS = (200, 500, 1000)


def train_checkpointed(kind: str, seed: int, config: Seq2SeqConfig | None = None,
                       checkpoints: Sequence[int] = CHECKPOINTS, lengths: Sequence[int] | None = None,
                       n: int = 200) -> dict:
    """Train a fresh `kind` model for ``max(checkpoints)`` steps; return ``{"accuracy": {step: [acc by length]},
    "loss": [mean training loss of each block of 50 steps], "weights": state_dict bytes}``."""
    if not checkpoints or any(_validate.positive_int("checkpoints", c) != c for c in checkpoints):
        raise ValueError(f"checkpoints must be positive ints, got {checkpoints!r}")
    config = replace(config or Seq2SeqConfig(), seed=seed, steps=max(checkpoints))
    lengths = list(range(config.min_len, config.max_len + 1)) if lengths is None else list(lengths)
    model = build_model(kind, config)
    accuracy: dict[int, list[float]] = {}

    def measure(step, m):
        if step in checkpoints:
            accuracy[step] = [round(a, 4) for a in accuracy_by_length(m, lengths, n).values()]
            m.train()

    losses = train(model, progress=False, after_step=measure)
    blocks = torch.tensor(losses).unflatten(0, (-1, 50)).mean(1) if len(losses) % 50 == 0 else torch.tensor([])
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return {"accuracy": accuracy, "loss": [round(x, 4) for x in blocks.tolist()], "weights": buffer.getvalue()}


def _job(job):
    kind, seed = job
    torch.set_num_threads(1)
    out = train_checkpointed(kind, seed)
    out.pop("weights")
    return kind, seed, out


def main(processes: int = 1, path: Path = STORED) -> dict:
    """Both decoders, seeds 0-2, 1,000 steps, accuracy at steps 200, 500 and 1,000 (about 10 minutes on one core)."""
    jobs = [(kind, seed) for kind in ("bahdanau", "additive") for seed in (0, 1, 2)]
    record: dict = {"made_by": "python -m attncourse.decoder_runs (FULL=1 in notebooks/01_additive_attention.ipynb)",
                    "checkpoints": list(CHECKPOINTS), "batch_size": Seq2SeqConfig().batch_size, "runs": {}}
    with forked_map(processes) as run:
        for kind, seed, out in run(_job, jobs):
            record["runs"][f"{kind} {seed}"] = {"accuracy": {str(k): v for k, v in out["accuracy"].items()},
                                                "loss": out["loss"]}
            print(kind, seed, {k: round(sum(v) / len(v), 3) for k, v in out["accuracy"].items()}, flush=True)
    Path(path).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
