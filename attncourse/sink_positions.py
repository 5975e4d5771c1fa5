r"""Chapter 12's position control: do the BOS sinks of section 2's tiny GPTs need learned absolute positions?

Section 2 trains :class:`~attncourse.gpt.GPT` (2 pre-norm blocks with MLPs, 4 heads, ``d = 64``, learned positions)
on repeated random segments that start with a BOS token, and finds sinks on BOS with nothing massive in the stream
that block 2's attention reads. With learned absolute positions, position 0 has a vector of its own, so key 0 is
marked twice (its token and its position). This module trains the same GPT with the same recipe, data and seeds, but
with RoPE (relative positions: no absolute marker) or with no position information at all (NoPE), and measures what
section 2 measures: the loss on each half, the mean weight on BOS per layer and head over the first and the second
copy (test sequences and random ones), and the largest residual-stream magnitude after each block against the
median.

``python -m attncourse.sink_positions run POSITION SEED`` trains one run (about 100 s of CPU for NoPE, 250 s for
RoPE, whose rotation is recomputed at every step; not yet run for lesson 12) and writes
``notebooks/results/ch12_sink_positions/POSITION_SEED.json`` (seed 0 also its weights);
``python -m attncourse.sink_positions combine`` gathers them into ``notebooks/results/ch12_sink_positions.json`` and
``ch12_sink_positions_seed0.pt`` (for the lesson to load and re-measure seed 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from .gpt import GPT, GPTConfig, train_lm
from .heads import attention_maps, repeated_segment_tokens, repeated_tokens, sink_scores

V, T = 32, 24  # vocabulary and training length of chapter 12's sections 1-2
L = T // 2
BOS = V
SEEDS = (0, 1, 2)
RECIPE = dict(steps=3000, lr=5e-3)  # section 2's GPT_RECIPE
POSITIONS = ("rope", "none")
RESULTS = Path(__file__).resolve().parent.parent / "notebooks" / "results"
STORED = RESULTS / "ch12_sink_positions.json"
STORED_STATES = RESULTS / "ch12_sink_positions_seed0.pt"


def with_bos(x: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, 1 + T): the BOS id V in front of every row."""
    return torch.cat([torch.full((x.shape[0], 1), BOS), x], dim=1)


def new_gpt(seed: int, position: str) -> GPT:
    """Section 2's GPT with `position` ("learned", "rope" or "none"), initial weights of `seed`."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return GPT(GPTConfig(vocab_size=V + 1, block_size=T + 1, d_model=64, n_heads=4, n_layers=2,
                             position=position))


def train(seed: int, position: str) -> tuple[GPT, list[float]]:
    """Section 2's recipe and batches (data seed 100 + seed) for the GPT with `position`."""
    model, data = new_gpt(seed, position), torch.Generator().manual_seed(100 + seed)
    losses = train_lm(model, lambda step: with_bos(repeated_segment_tokens(64, T, V, generator=data)[0]), **RECIPE)
    return model.eval(), losses


def test_batches() -> tuple[torch.Tensor, torch.Tensor]:
    """The lesson's test sequences (a segment of L, then again; seed 2) and random ones (seed 8): (128, 2L) each."""
    test = repeated_tokens(128, L, V, generator=torch.Generator().manual_seed(2))
    rand = torch.randint(0, V, (128, 2 * L), generator=torch.Generator().manual_seed(8))
    return test, rand


@torch.no_grad()
def measure(model: GPT) -> dict:
    """What section 2 measures, as plain lists: losses per half; weight on BOS (layers, H) over queries 2..L-1 of the
    first copy (sf) and over the second copy (ss), on test and random (rf, rs) sequences; per block the largest
    batch-mean absolute activation of the residual stream over its median (ratio) and the number of entries over 100x."""
    test, rand = test_batches()
    tokens = with_bos(test)
    per_token = F.cross_entropy(model(tokens)[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")  # (B, 2L)
    out = dict(repeat=per_token[:, L + 1:].mean().item(), first=per_token[:, 1:L].mean().item())
    for name, data in (("s", test), ("r", rand)):
        maps = attention_maps(model, with_bos(data))  # 2 x (B, H, 1 + 2L, 1 + 2L)
        out[name + "f"] = [sink_scores(w[:, :, 3:L + 1]).mean(0).tolist() for w in maps]
        out[name + "s"] = [sink_scores(w[:, :, L + 1:]).mean(0).tolist() for w in maps]
    streams = []
    hooks = [b.register_forward_hook(lambda mod, args, o: streams.append(o)) for b in model.blocks]
    model(tokens)
    for h in hooks:
        h.remove()
    out["ratio"], out["count"] = [], []
    for h in streams:
        mag, median = h.abs().mean(0), h.abs().median()  # (1 + 2L, d), scalar
        out["ratio"].append((mag.max() / median).item())
        out["count"].append(int((mag > 100 * median).sum()))
    return out


def _part(position: str, seed: int) -> Path:
    return RESULTS / "ch12_sink_positions" / f"{position}_{seed}.json"


def run_one(position: str, seed: int) -> dict:
    """Train and measure one run; write its part file (seed 0: also its weights)."""
    if position not in POSITIONS or seed not in SEEDS:
        raise ValueError(f"position must be one of {POSITIONS} and seed one of {SEEDS}, got {position!r}, {seed!r}")
    torch.set_num_threads(1)
    model, losses = train(seed, position)
    row = dict(position=position, seed=seed, train_first=losses[0], train_last20=sum(losses[-20:]) / 20,
               **measure(model))
    path = _part(position, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row))
    if seed == 0:
        torch.save(model.state_dict(), path.with_suffix(".pt"))
    return row


def combine() -> dict:
    """Gather the part files into STORED (all runs' measurements) and STORED_STATES (seed 0's weights)."""
    done = [p for p in POSITIONS if all(_part(p, s).exists() for s in SEEDS)]  # positions with all three seeds
    rows = {f"{p}/{s}": json.loads(_part(p, s).read_text()) for p in done for s in SEEDS}
    STORED.write_text(json.dumps({"made_by": "python -m attncourse.sink_positions", "recipe": RECIPE,
                                  "runs": rows}, indent=1))
    torch.save({p: torch.load(_part(p, 0).with_suffix(".pt")) for p in done}, STORED_STATES)
    return rows


def load() -> tuple[dict, dict[str, GPT]]:
    """The stored measurements ("position/seed" -> row) and seed 0's trained GPT per position."""
    stored = json.loads(STORED.read_text())
    if stored["recipe"] != RECIPE:
        raise ValueError(f"stored recipe {stored['recipe']} is not {RECIPE}")
    states = torch.load(STORED_STATES)
    models = {}
    for p in states:
        models[p] = new_gpt(0, p)
        models[p].load_state_dict(states[p])
        models[p].eval()
    return stored["runs"], models


if __name__ == "__main__":  # pragma: no cover - a training script
    if sys.argv[1:2] == ["run"]:
        print(json.dumps(run_one(sys.argv[2], int(sys.argv[3]))))
    elif sys.argv[1:2] == ["combine"]:
        combine()
    else:
        raise SystemExit("usage: python -m attncourse.sink_positions run POSITION SEED | combine")
