"""The stored runs of lesson 02's score comparison (notebooks/results/ch02_scores.json) are what the lesson's code
trains: the lesson's training cell (batch 32, 200 steps, the seeds' batches) retrains stored models here and compares.
(The lesson itself retrains seed 0 of each score and compares it with the stored seed 0.)"""
import json
from pathlib import Path

import nbformat
import pytest
import torch

from attncourse.seq2seq import Seq2SeqConfig, accuracy_rows, run_seeds

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kind, seed", [("none", 2), ("general", 1)])
def test_stored_scores_are_what_the_lesson_trains(kind, seed):
    stored = json.loads((ROOT / "notebooks" / "results" / "ch02_scores.json").read_text())
    nb = nbformat.read(ROOT / "notebooks" / "02_luong_attention.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and "STORED_SCORES =" in c.source)
    assert "Seq2SeqConfig(batch_size=32)" in cell and "n=200" in cell and "SEEDS = (0, 1, 2)" in cell
    config = Seq2SeqConfig(batch_size=32)
    lengths = list(range(config.min_len, config.max_len + 1))
    assert stored["batch_size"] == 32 and stored["steps"] == config.steps and stored["lengths"] == lengths
    accuracy = torch.tensor(stored["accuracy"][kind])
    assert accuracy.shape == (3, len(lengths))
    run = run_seeds([kind], (seed,), config, lengths=lengths, n=200, progress=False)[kind]
    torch.testing.assert_close(accuracy_rows(run, lengths)[0], accuracy[seed], rtol=0, atol=0.005)


def test_step_time_samples_returns_every_step_and_validates():
    from attncourse.seq2seq import build_model, step_time_samples, step_times

    models = {"dot": build_model("dot", Seq2SeqConfig(batch_size=4, max_len=5))}
    samples = step_time_samples(models, repeats=3, warmup=0)
    assert list(samples) == ["dot"] and len(samples["dot"]) == 3 and all(t > 0 for t in samples["dot"])
    assert step_times(models, repeats=1, warmup=0)["dot"] > 0
    with pytest.raises(ValueError, match="repeats"):
        step_time_samples(models, repeats=0)


def test_general_identity_starts_as_dot_and_its_stored_run_is_what_the_code_trains():
    """Lesson 02's test of the initialisation guess: "general-identity" is general's model with W = I at step 0 (so
    its scores equal dot's there), and the stored 3-seed run (results/ch02_general_identity.json) is what
    run_seeds trains (seed 2 retrained)."""
    from attncourse.seq2seq import build_model

    config = Seq2SeqConfig(batch_size=32)
    ident, general = build_model("general-identity", config), build_model("general", config)
    assert torch.equal(ident.attention.W.weight, torch.eye(config.decoder_size))
    for (name, a), (_, b) in zip(ident.named_parameters(), general.named_parameters()):
        if name != "attention.W.weight":
            assert torch.equal(a, b), name
    s, h = torch.randn(2, 3, config.decoder_size), torch.randn(2, 5, config.key_size)
    dot = build_model("dot", config).attention
    torch.testing.assert_close(ident.attention.score(s, h), dot.score(s, h))
    with pytest.raises(ValueError, match="decoder_size == key_size"):
        build_model("general-identity", Seq2SeqConfig(decoder_size=48))
    stored = json.loads((ROOT / "notebooks" / "results" / "ch02_general_identity.json").read_text())
    lengths = list(range(config.min_len, config.max_len + 1))
    assert stored["batch_size"] == 32 and stored["steps"] == config.steps and stored["lengths"] == lengths
    run = run_seeds(["general-identity"], (2,), config, lengths=lengths, n=200, progress=False)["general-identity"]
    torch.testing.assert_close(accuracy_rows(run, lengths)[0], torch.tensor(stored["accuracy"][2]), rtol=0, atol=0.005)


def test_stored_input_feeding_run_is_what_the_code_trains():
    """results/ch02_input_feeding.json is what the lesson's cell trains (train_input_feeding; seed 1 without
    feeding retrained here, the faster of the two)."""
    from attncourse.luong import train_input_feeding

    nb = nbformat.read(ROOT / "notebooks" / "02_luong_attention.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and "STORED_FEED =" in c.source)
    assert "Seq2SeqConfig(batch_size=32)" in cell and "train_input_feeding(flag, seed, feed_config, lengths, 200)" in cell
    stored = json.loads((ROOT / "notebooks" / "results" / "ch02_input_feeding.json").read_text())
    config = Seq2SeqConfig(batch_size=32)
    lengths = list(range(config.min_len, config.max_len + 1))
    assert stored["batch_size"] == 32 and stored["steps"] == config.steps and stored["lengths"] == lengths
    assert all(torch.tensor(a).shape == (3, len(lengths)) for a in stored["accuracy"].values())
    row = train_input_feeding(False, 1, config, lengths, 200)
    torch.testing.assert_close(torch.tensor(row), torch.tensor(stored["accuracy"]["no feeding"][1]), rtol=0, atol=0.005)


def test_stored_dot_input_feeding_run_is_what_the_code_trains():
    """results/ch02_input_feeding_dot.json (the same comparison with the dot score and batches of 64) is what the
    lesson's cell trains: seed 2 without feeding retrained here."""
    from attncourse.luong import train_input_feeding

    nb = nbformat.read(ROOT / "notebooks" / "02_luong_attention.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and "STORED_FEED_DOT =" in c.source)
    assert "dot_config = Seq2SeqConfig()" in cell
    assert 'train_input_feeding(flag, seed, dot_config, lengths, 200, score="dot")' in cell
    stored = json.loads((ROOT / "notebooks" / "results" / "ch02_input_feeding_dot.json").read_text())
    config = Seq2SeqConfig()
    lengths = list(range(config.min_len, config.max_len + 1))
    assert (stored["batch_size"], stored["steps"], stored["score"]) == (64, config.steps, "dot")
    assert stored["lengths"] == lengths
    assert all(torch.tensor(a).shape == (3, len(lengths)) for a in stored["accuracy"].values())
    row = train_input_feeding(False, 2, config, lengths, 200, score="dot")
    torch.testing.assert_close(torch.tensor(row), torch.tensor(stored["accuracy"]["no feeding"][2]), rtol=0, atol=0.005)


def test_stored_dot_models_are_the_stored_runs_models():
    """results/ch02_dot_models.pt (lesson 02's beam-search cell loads seeds 1 and 2 from it) holds the dot models of
    the stored score comparison: their greedy accuracy at every length is the stored one (no retraining)."""
    from attncourse.seq2seq import accuracy_by_length, build_model

    config = Seq2SeqConfig(batch_size=32)
    lengths = list(range(config.min_len, config.max_len + 1))
    saved = torch.load(ROOT / "notebooks" / "results" / "ch02_dot_models.pt", weights_only=True)
    assert (saved["batch_size"], saved["steps"], saved["kind"], sorted(saved["state_dicts"])) == (32, 200, "dot", [1, 2])
    stored = json.loads((ROOT / "notebooks" / "results" / "ch02_scores.json").read_text())
    model = build_model("dot", config)
    model.load_state_dict(saved["state_dicts"][2])
    accuracy = accuracy_by_length(model.eval(), lengths, 200)
    torch.testing.assert_close(torch.tensor([accuracy[n] for n in lengths]), torch.tensor(stored["accuracy"]["dot"][2]),
                               rtol=0, atol=0.005)


def test_general_identity_file_has_its_writer_in_the_lesson():
    """RETRAIN=1 re-creates results/ch02_general_identity.json: the lesson's cell that reads it also writes it, with
    the run the stored-run test above retrains one seed of (batch 32, 200 steps, seeds 0-2)."""
    nb = nbformat.read(ROOT / "notebooks" / "02_luong_attention.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and "STORED_ID =" in c.source)
    assert 'run_seeds(["general-identity"], SEEDS, config, lengths=lengths, n=200' in cell
    assert "if retrain and not FULL:" in cell and "STORED_ID.write_text(" in cell
    assert "if FULL:" in cell  # FULL=1 trains on batches of 64: the batch-32 comparison is not made there
