"""The needle grid of lesson 11: the asked pair sits at the requested depth, and on a short prompt the policies find
what the lesson's stored grid says they find."""

import pytest
import torch

from attncourse.kv_needle import needle_batch, needle_cell


def test_needle_batch_places_the_asked_pair_at_its_depth():
    tokens, prompt, answer = needle_batch(torch.Generator().manual_seed(0), 5, 8, 0.5)
    assert tokens.shape == (5, 20) and prompt == 18 and answer.tolist() == [19]
    at = round(0.5 * 7)
    assert (tokens[:, 17] == tokens[:, 2 * at]).all() and (tokens[:, 18] == tokens[:, 2 * at]).all()  # the question
    assert (tokens[:, 19] == tokens[:, 2 * at + 1]).all() and (tokens[:, 16] == 16).all()  # its value; SEP = 2N
    assert all(len(set(row[:16:2].tolist())) == 8 for row in tokens)  # distinct keys
    with pytest.raises(ValueError, match="depth"):
        needle_batch(torch.Generator(), 2, 8, 1.5)


def test_needle_cell_on_a_short_prompt():
    first = needle_cell(0, 8, 0.0, budget=8, batch=8)
    last = needle_cell(0, 8, 1.0, budget=8, batch=8)
    assert first["full"] == last["full"] == first["snapkv"] == first["quest"] == last["quest"] == 1.0
    assert first["window"] == 0.0 and last["window"] == 1.0  # the window holds only the newest pairs
    with pytest.raises(ValueError, match="policy"):
        needle_cell(0, 8, 0.0, ("full", "nope"))
    with pytest.raises(ValueError, match="quest"):
        needle_cell(0, 8, 0.0, ("quest",), budget=6)
