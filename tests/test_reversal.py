"""The shared recipe of chapter 04's reversal comparison (attncourse.reversal): schedule, training, bad input."""

import pytest
import torch

from attncourse import reversal


def test_lr_factor_warms_up_then_decays_to_a_tenth():
    factors = [reversal.lr_factor(s, 100, 10) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(factors[:10], factors[1:10]))          # linear warm-up
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))          # then a monotone decay
    assert factors[-1] == pytest.approx(0.1)
    assert reversal.lr_factor(0, 100, 0) == pytest.approx(1.0)              # no warm-up: the peak at once


@pytest.mark.parametrize("kind", reversal.KINDS)
def test_a_few_steps_train_and_reload(kind):
    torch.set_num_threads(1)
    acc, weights = reversal._one(kind, 0, 3e-3, 3, 1, [4, 5])
    assert len(acc) == 2 and all(0.0 <= a <= 1.0 for a in acc)
    model = reversal.load(kind, weights)
    assert reversal.accuracy(kind, model, [4, 5]) == pytest.approx(acc, abs=1e-4)   # the same model, rebuilt


def test_bad_input():
    with pytest.raises(ValueError, match="kind"):
        reversal.build("LSTM", 0)
    with pytest.raises(ValueError, match="warmup"):
        reversal.train(reversal.KINDS[0], 0, steps=10, lr=1e-3, warmup=10)
    with pytest.raises(TypeError, match="steps"):
        reversal.train(reversal.KINDS[0], 0, steps=10.0, lr=1e-3, warmup=1)
