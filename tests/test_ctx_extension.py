"""The passkey-in-text extension test: window layout (the key twice, `distance` apart, the targets at the end), the
training loss, what is measured and stored, and bad input. Small sizes only; the experiment itself runs in lesson 06
under FULL=1."""

import json

import pytest
import torch

from attncourse import ctx_extension as cx
from attncourse.char_lm import char_lm

TEXT = torch.randint(0, 20, (3000,), generator=torch.Generator().manual_seed(0))  # a stand-in text of 20 ids


def test_passkey_windows_layout():
    symbols, marker = cx.extra_ids(20)
    assert symbols.tolist() == list(range(20, 30)) and marker == 30
    for distance in (5, 40, 92):
        x = cx.passkey_windows(TEXT, 6, 96, 20, torch.Generator().manual_seed(distance), distance)
        assert x.shape == (6, 97)
        q = 96 - cx.KEY_LEN                                              # the final marker
        assert (x[:, q] == marker).all() and (x[:, q - distance] == marker).all()
        torch.testing.assert_close(x[:, q + 1:], x[:, q - distance + 1:q - distance + 1 + cx.KEY_LEN])
        assert ((x[:, q + 1:] >= 20) & (x[:, q + 1:] < 30)).all()       # the key: key symbols only
        assert (x == marker).sum(1).tolist() == [2] * 6                  # no other marker
    drawn = cx.passkey_windows(TEXT, 50, 64, 20, torch.Generator().manual_seed(1))
    first = (drawn[:, :64 - cx.KEY_LEN] == marker).float().argmax(1)     # drawn distances differ
    assert len(set(first.tolist())) > 10


def test_loss_measure_and_store(tmp_path):
    model = char_lm(31, 0)
    loss = cx.batch_loss(model, TEXT, 64, 20, torch.Generator().manual_seed(0), batch=2)
    loss.backward()
    assert loss.item() > 0 and model.tok.weight.grad is not None
    sets = cx.test_sets(TEXT, 20, distances=(32, 128), n=2)
    assert sets[32].shape == (2, cx.SCALE * cx.CONTEXT + 1) and sets["text"].shape[1] == cx.SCALE * cx.CONTEXT + 1
    m = cx.measure(model.eval(), sets)
    assert len(m["key_loss"]) == len(m["key_acc"]) == 2 and 0 <= min(m["key_acc"]) <= max(m["key_acc"]) <= 1
    results = {name: {"zero-shot": m} for name in cx.METHODS}
    state = {k: v.half() for k, v in model.state_dict().items()}
    out = cx.store({0: results, 1: results}, {0: state, 1: state}, tmp_path / "r.json", tmp_path / "w.pt")
    assert json.loads((tmp_path / "r.json").read_text()) == out
    assert out["results"]["PI"]["zero-shot"]["key_acc"] == [m["key_acc"]] * 2
    assert torch.load(tmp_path / "w.pt", weights_only=True)["seeds"] == [0, 1]


def test_bad_input():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="distance"):
        cx.passkey_windows(TEXT, 2, 64, 20, gen, distance=61)
    with pytest.raises(ValueError, match="vocab_size"):
        cx.passkey_windows(TEXT, 2, 64, 10, gen)
    with pytest.raises(ValueError, match="data"):
        cx.passkey_windows(TEXT[:50], 2, 64, 20, gen)
    with pytest.raises(TypeError, match="measure"):
        cx.fine_tune(char_lm(31, 0), TEXT, 20, 0, measure=None)


def test_stored_run_matches_its_weights():
    from pathlib import Path

    from attncourse.char_lm import shakespeare_chars

    root = Path(__file__).resolve().parent.parent / "notebooks"
    stored = json.loads((root / "results" / "ch06_passkey_text.json").read_text())
    weights = torch.load(root / "results" / "ch06_passkey_text.pt", weights_only=True)
    assert stored["seeds"] == weights["seeds"] == [0, 1, 2] and stored["distances"] == list(cx.DISTANCES)
    _, held, vocab = shakespeare_chars(root / "data" / "shakespeare" / "coriolanus.txt")
    model = char_lm(len(vocab) + 11, 0)
    model.load_state_dict({k: v.float() for k, v in weights["state"][1].items()})
    model.set_rope_scaling(cx.scalings()["YaRN"])
    sets = cx.test_sets(held, len(vocab))
    m = cx.measure(model.eval(), {cx.DISTANCES[-1]: sets[cx.DISTANCES[-1]], "text": sets["text"]})
    zero = stored["results"]["YaRN"]["zero-shot"]
    assert abs(m["key_acc"][0] - zero["key_acc"][1][-1]) < 2e-3 and abs(m["text_first_L"] - zero["text_first_L"][1]) < 2e-3
