"""Chapter 06's predictions before its two experiments (solutions/06_positions_alibi.ipynb): how much of an
equal-content score RoPE keeps at a distance, written before exercise 8 measures it, and which numbers of kept fast
pairs let the stored character models find a key four training contexts back, written as a rule of the pairs' turns
before exercise 10 measures it."""

from __future__ import annotations

import math

import torch

from attncourse.positions import apply_rope
from . import Case, exercise
from .predictions import NOT_RIGHT


def measured_similarity(m: int, base: float, n: int = 4096) -> float:
    """Mean over `n` random float64 vectors of RoPE's q_m . q_0 / |q|^2 (halves layout, D = 64): what exercise 8
    measures, on more vectors (one fixed generator; a salted grader draws others)."""
    q = torch.randn(n, 64, generator=torch.Generator().manual_seed(806), dtype=torch.float64)  # (N, D)
    rotated = apply_rope(q[:, None], torch.tensor([m]), base=base)[:, 0]  # (N, 1, D) -> (N, D)
    return ((rotated * q).sum(-1) / (q * q).sum(-1)).mean().item()


def _close_share(got, expected):
    if isinstance(got, torch.Tensor) or isinstance(got, bool) or not isinstance(got, (int, float)):
        return f"expected a Python float (a mean normalised score), got {type(got).__name__}"
    return None if abs(got - expected) < 0.03 else NOT_RIGHT


@exercise("06-rope-decay-predict", "predicted_similarity", points=1, category="predict",
          forbid=("attncourse.classroom.checks.ch06.rope_similarity_reference",
                  "attncourse.classroom.checks.ch06_predict.measured_similarity"),
          allow=(), ops=("torch",),
          prop_doc="the prediction is a number in plain Python (math allowed) for a distance and base the check "
                   "draws, judged within 0.03 of a measurement on 4,096 random vectors: any PyTorch operation is "
                   "refused, so the rotation cannot be applied and averaged inside it (exercise 8 does that next); "
                   "constants and a fixed decay curve fail at the distances and bases drawn",
          hint="write the score of a vector with itself rotated pair by pair: what does each pair contribute, and "
               "with what weight on average over random vectors? The exercise's text gives each pair's angle")
def _rope_decay_predict():
    """Predict, before measuring, the mean normalised score of a vector at distance m from itself under RoPE."""
    gen = torch.Generator().manual_seed(68)
    cases = [(1, 10000.0), (16, 100.0), (1024, 500000.0)]
    distances, bases = (2, 3, 8, 40, 100, 300, 2000, 5000), (100.0, 1000.0, 10000.0, 500000.0)
    cases += [(distances[int(torch.randint(len(distances), (1,), generator=gen))],
               bases[int(torch.randint(len(bases), (1,), generator=gen))]) for _ in range(3)]
    return [Case(f"distance {m}, base {base:g}", (m, base), expected=measured_similarity(m, base),
                 compare=_close_share) for m, base in cases]

# turns each pair of the lesson's character models (head dim 16, base 10,000) makes over their training context of
# 64 characters, fastest first: the input the prediction is a rule of (the lesson prints them in section 7)
PAIR_TURNS = tuple(round(64 * 10000.0 ** (-2 * i / 16) / (2 * math.pi), 2) for i in range(8))

# kept (0-8) for which the key 192 back is found (above 0.95 of its symbols) on all three stored models, measured
# with ch06_extension.by_parts_accuracy_reference on window seeds 5 and 6 (the table exercise 10 prints; a test
# re-measures its edges): 0 (PI) 0.41-0.55, 1-3 0.98-1.00, 4 0.64-0.84, 5-8 0.45-0.71
FOUND = (1, 2, 3)


def _kept_rule(got, expected):
    if isinstance(got, (set, frozenset, list, tuple)) and all(isinstance(k, int) and not isinstance(k, bool)
                                                              and 0 <= k <= 8 for k in got):
        return None if sorted(set(got)) == sorted(expected) else NOT_RIGHT
    return f"expected a list of the values of kept (ints from 0 to 8) that find the key, got {got!r}"


@exercise("06-passkey-predict", "predicted_kept", points=1, category="predict",
          forbid=("attncourse.classroom.checks.ch06_extension.by_parts_accuracy_reference",),
          allow=(), ops=("torch",),
          prop_doc="the prediction is a rule in plain Python of the pairs' turns over the training context: any "
                   "PyTorch operation is refused, so it cannot load the models and measure (exercise 10 does that "
                   "next); the answer is judged whole, and a prediction check judges three different wrong answers "
                   "at most, so subsets of 0-8 cannot be tried in turn",
          hint="at four times the training length, which kept pairs reach angles the model never saw, and which "
               "slowed pairs lose what the model used them for? Think of both ends: none kept (PI) and all kept")
def _passkey_predict():
    """Predict, before measuring, the values of `kept` (0-8) for which the by-parts rescaling finds the key."""
    return [Case("the lesson's character models, key 192 back", (list(PAIR_TURNS),), expected=list(FOUND),
                 compare=_kept_rule)]
