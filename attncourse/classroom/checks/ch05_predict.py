"""Chapter 05's prediction before its conversion experiment (solutions/05_mqa_gqa.ipynb, exercise 8a): which
conversion, mean-pooling or keeping each group's first K/V head, stays closer to the MHA layer, as a rule of the
layer's two knobs, written before exercise 8 measures it."""

from __future__ import annotations

from . import Case, exercise
from .predictions import NOT_RIGHT

VERDICTS = ("mean", "first", "tie", "depends")

# (spread, others) -> verdict over seeds, measured with ch05.closer_conversion_reference on seeds 0-11 (a test
# re-measures a few seeds of every row): identical heads convert exactly both ways; with every head reaching W_O
# mean-pooling is closer on all 12 seeds; with only the lead heads reaching it first-head is exact; halfway
# (others 0.5) both verdicts occur among the 12 seeds at every spread tried (0.1, 0.3, 0.5, 1.0).
PREDICT_CASES = {(0.0, 1.0): "tie", (0.0, 0.5): "tie", (0.3, 1.0): "mean", (1.0, 1.0): "mean",
                 (0.5, 0.0): "first", (0.1, 0.0): "first", (0.5, 0.5): "depends", (1.0, 0.5): "depends"}


def _verdict(what: str):
    def rule(got, expected):
        if not isinstance(got, str) or got not in VERDICTS:
            return f"expected one of the four verdicts the exercise names (a str) for {what}, got {got!r}"
        return None if got == expected else NOT_RIGHT
    return rule


@exercise("05-conversion-predict", "predicted_closer", points=1, category="predict",
          forbid=("attncourse.classroom.checks.ch05.closer_conversion_reference",
                  "attncourse.classroom.checks.ch05.conversion_errors_reference"),
          allow=(), ops=("torch",),
          prop_doc="the prediction is a rule in plain Python of the layer's two knobs: any PyTorch operation is "
                   "refused, so the rule cannot build the layer and measure it (exercise 8 does that next); every "
                   "case is judged on its own verdict, and a prediction check judges three different wrong answers "
                   "at most, so the four verdicts cannot be tried in turn on every case",
          hint="for each setting ask: are the heads of a group different at all? if they are, which query heads does "
               "W_O read, with what weight, and what K/V does each conversion leave those heads?")
def _conversion_predict():
    """Predict, before measuring, which conversion of a layer with K/V heads `spread` apart and its non-lead query
    heads reaching W_O at weight `others` stays closer: "mean", "first", "tie" or "depends" (on the seed)."""
    return [Case(f"spread {spread}, others {others}", (spread, others), expected=verdict,
                 compare=_verdict(f"spread {spread}, others {others}"))
            for (spread, others), verdict in PREDICT_CASES.items()]
