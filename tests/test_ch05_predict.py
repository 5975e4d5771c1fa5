"""Chapter 05's conversion prediction: the stored verdicts agree with the measurement, the rule passes, PyTorch in
the answer is refused, and the likely wrong rules fail."""

from __future__ import annotations

import pytest

from attncourse.classroom import checks
from attncourse.classroom.checks.ch05 import closer_conversion_reference
from attncourse.classroom.checks.ch05_predict import PREDICT_CASES

# seeds of the halfway rows where each verdict occurs (found by measuring seeds 0-11)
SEEDS = {"tie": (0, 1), "mean": (0, 1), "first": (0, 1)}


def predicted_closer(spread, others):
    if spread == 0:
        return "tie"
    return {1.0: "mean", 0.0: "first"}.get(others, "depends")


def test_stored_verdicts_match_the_measurement():
    for (spread, others), verdict in PREDICT_CASES.items():
        if verdict == "depends":
            seen = {closer_conversion_reference(s, spread, others) for s in range(8)}
            assert seen == {"mean", "first"}, (spread, others, seen)
        else:
            assert {closer_conversion_reference(s, spread, others) for s in SEEDS[verdict]} == {verdict}


def test_rule_passes():
    checks.check("05-conversion-predict", predicted_closer)


def by_measuring(spread, others):  # builds the layer: PyTorch is refused in a prediction
    return closer_conversion_reference(0, spread, others)


@pytest.mark.parametrize("wrong", [
    lambda s, o: "tie" if s == 0 else ("mean" if o > 0.4 else "first"),   # halfway taken as a rule
    lambda s, o: "tie" if s == 0 else "mean",                              # mean-pooling always
    lambda s, o: "mean" if o == 1 else ("first" if o == 0 else "depends"),  # identical heads not seen as exact
])
def test_wrong_rules_fail(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check("05-conversion-predict", wrong)


def test_measuring_refused():
    with pytest.raises(checks.CheckFailed) as info:
        checks.check("05-conversion-predict", by_measuring)
    assert "called" in str(info.value) or "PyTorch" in str(info.value)
