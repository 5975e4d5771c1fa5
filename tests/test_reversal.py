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


def test_mirrored_attention_reads_the_stored_tuned_model():
    """The stored seed-0 Transformer's cross-attention summary is the one its results file records."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "notebooks" / "results"
    record = json.loads((results / "ch04_reversal_tuned.json").read_text())
    model = reversal.load(reversal.KINDS[0], (results / "ch04_reversal_tuned_tf_seed0.pt").read_bytes())
    weight, hits = reversal.mirrored_attention(model)
    assert weight == pytest.approx(record["mirror_12_digits"]["weight_per_layer"][0], abs=1e-4)
    assert hits == record["mirror_12_digits"]["rows_argmax_last_layer"][0]
    assert weight[-1] > 4 / 12 and hits >= 8                  # far from uniform (1/12): it learned the mirror


def test_compare_records_every_seeds_mirror():
    torch.set_num_threads(1)
    record, weights = reversal.compare(lrs=(1e-3,), seeds=(0, 1), steps=2, warmup=1, lengths=(4,))
    mirror = record["mirror_12_digits"]
    assert len(mirror["weight_per_layer"]) == 2 and all(len(w) == 2 for w in mirror["weight_per_layer"])
    assert all(0 <= h <= 12 for h in mirror["rows_argmax_last_layer"])
    assert mirror["weight_per_layer"][0] == pytest.approx(
        reversal.mirrored_attention(reversal.load(reversal.KINDS[0], weights))[0], abs=1e-4)
