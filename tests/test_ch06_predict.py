"""Chapter 06's predictions (RoPE's equal-content score at a distance; the kept pairs that find the passkey): the
stored verdict agrees with a re-measured edge, the rules pass, PyTorch in the answer is refused, and the likely wrong
rules fail."""

from __future__ import annotations

import math

import pytest

from attncourse.classroom import checks
from attncourse.classroom.checks.ch06_extension import by_parts_accuracy_reference
from attncourse.classroom.checks.ch06_predict import FOUND, measured_similarity


def predicted_kept(turns):  # keep at least one fast pair, and only pairs that turn at least once within L
    return list(range(1, sum(t >= 1 for t in turns) + 1))


def test_stored_verdict_matches_the_measurement():
    # the edges of FOUND on model seed 2 (the weakest), window seed 5: 3 kept finds the key, 4 and 0 do not
    assert by_parts_accuracy_reference(2, 3, 192, 5) > 0.95
    assert by_parts_accuracy_reference(2, 4, 192, 5) < 0.9 and by_parts_accuracy_reference(2, 0, 192, 5) < 0.9
    assert FOUND == (1, 2, 3)


def test_rule_passes():
    checks.check("06-passkey-predict", predicted_kept)


def by_measuring(turns):  # loads the models: PyTorch is refused in a prediction
    return [k for k in range(9) if by_parts_accuracy_reference(0, k, 192, 5) > 0.95]


@pytest.mark.parametrize("wrong", [
    lambda turns: list(range(9)),                                   # any by-parts split works
    lambda turns: [k for k in range(9) if k <= sum(t >= 1 for t in turns)],   # PI (none kept) included
    lambda turns: [1],                                              # only YaRN's single kept pair
    lambda turns: [k for k in range(1, 9) if k <= sum(t >= 0.1 for t in turns)],   # pairs short of a turn kept
    lambda turns: "1-3",                                            # not a list
])
def test_wrong_rules_fail(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check("06-passkey-predict", wrong)


def test_measuring_refused():
    with pytest.raises(checks.CheckFailed) as info:
        checks.check("06-passkey-predict", by_measuring)
    assert "called" in str(info.value) or "PyTorch" in str(info.value)


def predicted_similarity(m, base):  # the mean of the 32 pairs' cosines
    return sum(math.cos(m * base ** (-2 * i / 64)) for i in range(32)) / 32


def test_similarity_rule_passes_and_matches_the_measurement():
    checks.check("06-rope-decay-predict", predicted_similarity)
    assert abs(measured_similarity(64, 100.0) - predicted_similarity(64, 100.0)) < 0.01


@pytest.mark.parametrize("wrong", [
    lambda m, base: 1.0,                                                          # no decay
    lambda m, base: math.exp(-m / 100),                                           # a fixed decay curve
    lambda m, base: sum(math.cos(m * base ** (-2 * i / 64)) for i in range(32)),  # a sum, not normalised
    lambda m, base: sum(math.cos(m * base ** (-i / 64)) for i in range(32)) / 32,  # theta_i from base^(-i/D)
    lambda m, base: math.cos(m),                                                  # the fastest pair alone
])
def test_similarity_wrong_rules_fail(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check("06-rope-decay-predict", wrong)


def test_similarity_measuring_refused():
    def by_measuring(m, base):
        return measured_similarity(m, base)

    with pytest.raises(checks.CheckFailed):
        checks.check("06-rope-decay-predict", by_measuring)
