"""The character-level stand-in for a pretrained model: held-out split, windows, the model's shape, the stored
weights load into it, bad input."""

from pathlib import Path

import pytest
import torch

from attncourse.char_lm import CONTEXT, char_lm, shakespeare_chars, tatoeba_chars, train_char_lm, windows

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "notebooks" / "data" / "tatoeba" / "eng-fra-5000.txt"
STORED = ROOT / "notebooks" / "results" / "char_lm_rope.pt"


def test_split_holds_out_whole_sentences():
    train, held_out, vocab = tatoeba_chars(TEXT)
    assert 8 * len(held_out) < len(train) < 10 * len(held_out)  # one pair in ten, sentences of every length
    assert int(train.max()) < len(vocab) and int(held_out.max()) < len(vocab)
    decode = lambda ids: "".join(vocab[i] for i in ids.tolist())  # noqa: E731
    pair = "\n".join(decode(held_out[:300]).split("\n")[:2])  # the first held-out pair: English, then French
    assert pair.count("\n") == 1 and "\n" + pair + "\n" not in decode(train)  # not trained on (English lines repeat)
    again = tatoeba_chars(TEXT)
    assert torch.equal(again[0], train) and again[2] == vocab  # deterministic


def test_shakespeare_is_one_continuous_text(tmp_path):
    play = ROOT / "notebooks" / "data" / "shakespeare" / "coriolanus.txt"
    train, held_out, vocab = shakespeare_chars(play)
    decode = lambda ids: "".join(vocab[i] for i in ids.tolist())  # noqa: E731
    assert decode(torch.cat([train, held_out])) == play.read_text(encoding="utf-8")  # nothing reordered or dropped
    assert 8.9 * len(held_out) < len(train) < 9.1 * len(held_out)  # the last tenth held out
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ValueError, match="path"):
        shakespeare_chars(short)


def test_windows_and_model():
    data = torch.arange(100)
    w = windows(data, 5, 10, torch.Generator().manual_seed(0))
    assert w.shape == (5, 11) and torch.equal(w[:, 1:] - w[:, :-1], torch.ones(5, 10, dtype=torch.long))
    model = char_lm(20, seed=0)
    assert model.config.position == "rope" and model.config.block_size == CONTEXT
    assert model(torch.randint(0, 20, (2, 3 * CONTEXT))).shape == (2, 3 * CONTEXT, 20)  # RoPE runs past CONTEXT
    _, losses = train_char_lm(torch.randint(0, 20, (500,)), 20, seed=0, steps=2)
    assert len(losses) == 2


def test_stored_weights_load():
    stored = torch.load(STORED, weights_only=True)
    assert stored["seeds"] == [0, 1, 2] and len(stored["state"]) == 3
    model = char_lm(len(stored["vocab"]), seed=0)
    model.load_state_dict(stored["state"][0])  # strict: the stored weights are this model's


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="data must be 1-D"):
        windows(torch.arange(5), 2, 10, torch.Generator())
    with pytest.raises(ValueError, match="length"):
        windows(torch.arange(50), 2, 0, torch.Generator())
    (tmp_path / "x.txt").write_text("no tabs here\n")
    with pytest.raises(ValueError, match="Tatoeba"):
        tatoeba_chars(tmp_path / "x.txt")
