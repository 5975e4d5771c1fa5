"""Chapter 01's real-language section: the committed Tatoeba corpus (with its licence), its tokenising and split,
greedy translation with attention weights, and the stored 3-seed run (notebooks/results/ch01_translation.json) is
what the lesson's recipe trains (one model retrained here)."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attncourse.seq2seq import PAD
from attncourse.translation import (CORPUS, EOS, config_for, load_corpus, loss_on, tokenize, train_translation,
                                    translate)

ROOT = Path(__file__).resolve().parents[1]


def test_corpus_is_committed_small_and_attributed():
    readme = (CORPUS.parent / "README.md").read_text(encoding="utf-8")
    assert "CC-BY 2.0" in readme and "tatoeba" in readme.lower()
    assert CORPUS.stat().st_size < 1_000_000
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 5000 and all(line.count("\t") == 2 and "tatoeba.org #" in line for line in lines)


def test_one_target_per_english_sentence(tmp_path):
    path = tmp_path / "pairs.txt"
    path.write_text("Go.\tVa !\tx\nGo.\tMarche.\tx\nHi.\tSalut !\tx\nHi there.\tSalut !\tx\n", encoding="utf-8")
    corpus = load_corpus(path, test_fraction=0.5)
    pairs = corpus.test_pairs + [p for p in [(["go", "."], ["va", "!"]), (["hi", "."], ["salut", "!"]),
                                             (["hi", "there", "."], ["salut", "!"])] if p not in corpus.test_pairs]
    assert len(corpus.train[0]) + len(corpus.test[0]) == 3 and (["go", "."], ["marche", "."]) not in pairs


def test_tokenize_and_split():
    assert tokenize("I'm cold, Tom!") == ["i'm", "cold", ",", "tom", "!"]
    assert tokenize("J\u2019ai gagné.") == ["j'ai", "gagné", "."]
    corpus = load_corpus()
    src, lengths, tgt = corpus.train
    assert len(src) + len(corpus.test[0]) == 2597 and len(corpus.test_pairs) == len(corpus.test[0]) == 259
    assert ((tgt == EOS).sum(1) == 1).all() and (src[torch.arange(len(src)), lengths - 1] != PAD).all()
    assert corpus.words[:4] == ["<pad>", "<sos>", "<eos>", "<unk>"]
    assert config_for(corpus).vocab_size == len(corpus.words)
    with pytest.raises(ValueError, match="test_fraction"):
        load_corpus(test_fraction=1.5)


def test_translate_gives_weights_over_the_source_words():
    corpus = load_corpus()
    model, losses = train_translation("additive", corpus, config_for(corpus, steps=3))
    assert len(losses) == 3
    words, weights = translate(model, corpus, ["i", "am", "cold", "."], max_len=5)
    assert 1 <= len(words) <= 5 and weights.shape == (len(words), 4)
    torch.testing.assert_close(weights.sum(-1), torch.ones(len(words)))
    assert translate(train_translation("none", corpus, config_for(corpus, steps=1))[0], corpus, ["hi", "."])[1] is None


def test_stored_translation_run_is_what_the_recipe_trains():
    stored = json.loads((ROOT / "notebooks" / "results" / "ch01_translation.json").read_text(encoding="utf-8"))
    corpus = load_corpus()
    config = config_for(corpus)
    assert (stored["steps"], stored["batch_size"], stored["vocabulary"]) == (config.steps, config.batch_size, 1152)
    assert sorted(stored["runs"]) == [f"{k} {s}" for k in ("additive", "mean", "none") for s in (0, 1, 2)]
    model, _ = train_translation("additive", corpus, replace(config, seed=1))
    run = stored["runs"]["additive 1"]
    with torch.no_grad():
        assert abs(loss_on(model, corpus.test).item() - run["test_loss"]) < 2e-3
    english = [e.split() for e in stored["examples"]]
    assert [" ".join(translate(model, corpus, e)[0]) for e in english] == run["translations"]


def test_chrf_on_a_hand_example():
    """hyp "ab", ref "a bc" (spaces removed: "abc"): order 1 P = 2/2, R = 2/3, F2 = 5 P R / (4 P + R) = 10/14;
    order 2 P = 1/1, R = 1/2, F2 = 2.5/4.5; orders 3-6 have no hypothesis n-gram and do not count: mean 63.49."""
    from attncourse.translation import chrf

    assert abs(chrf(["ab"], ["a bc"]) - 100 * (10 / 14 + 2.5 / 4.5) / 2) < 1e-9
    assert chrf(["le chat"], ["le chat"]) == 100.0 and chrf(["xyz"], ["abc"]) < 1e-9
    assert chrf(["l e chat"], ["le chat"]) == 100.0  # spaces are removed before counting
    with pytest.raises(ValueError, match="same length"):
        chrf(["a"], [])


def test_stored_translations_give_the_stored_chrf():
    """The stored run keeps every held-out greedy translation; chapter 01 scores them by sentence length."""
    from attncourse.translation import chrf

    stored = json.loads((ROOT / "notebooks" / "results" / "ch01_translation.json").read_text(encoding="utf-8"))
    references = [" ".join(f) for _, f in load_corpus().test_pairs]
    for name, run in stored["runs"].items():
        assert len(run["greedy"]) == len(references) == 259, name
        assert abs(chrf(run["greedy"], references) - run["chrf"]) < 0.006, name
