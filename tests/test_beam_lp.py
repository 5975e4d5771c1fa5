"""Beam search with an end token and GNMT's length penalty (chapter 02)."""

import pytest
import torch

from attncourse.beam_lp import beam_translate, length_penalty
from attncourse.seq2seq import Seq2SeqConfig, build_model

SMALL = Seq2SeqConfig(num_digits=6, embed_size=8, encoder_size=8, decoder_size=16, attention_size=8)
EOS = 2


def _greedy(model, src, max_len):
    with torch.no_grad():
        out = model(src[None], torch.tensor([src.shape[0]]), steps=max_len)[0][0].argmax(-1).tolist()
    return out[:out.index(EOS) + 1] if EOS in out else out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_width_one_is_greedy(seed):
    model = build_model("additive", Seq2SeqConfig(**{**SMALL.__dict__, "seed": seed})).eval()
    src = torch.randint(3, SMALL.vocab_size, (5,), generator=torch.Generator().manual_seed(seed))
    ids, logprob = beam_translate(model, src, width=1, max_len=6)
    assert ids == _greedy(model, src, 6)
    with torch.no_grad():
        logits, _ = model(src[None], torch.tensor([5]), torch.tensor([ids]))
    torch.testing.assert_close(logprob, logits[0].log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).sum().item())


def test_length_penalty():
    assert length_penalty(1, 0.0) == 1.0 and length_penalty(1, 1.0) == 1.0
    assert length_penalty(7, 1.0) == pytest.approx(2.0) and length_penalty(7, 0.5) == pytest.approx(2 ** 0.5)


def test_bad_input():
    model = build_model("additive", SMALL)
    with pytest.raises(ValueError, match="src"):
        beam_translate(model, torch.tensor([3, 0, 4]), 2)
    with pytest.raises(ValueError, match="alpha"):
        beam_translate(model, torch.tensor([3, 4]), 2, alpha=-1.0)
    with pytest.raises(TypeError, match="model"):
        beam_translate(build_model("bahdanau", SMALL), torch.tensor([3, 4]), 2)


def test_stored_greedy_outputs_are_chapter_01s():
    """ch02_beam_length.json's width-1 outputs are chapter 01's stored greedy translations, seed for seed (the same
    models), and every setting holds one output per held-out sentence."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "notebooks" / "results"
    beam = json.loads((results / "ch02_beam_length.json").read_text(encoding="utf-8"))
    ch01 = json.loads((results / "ch01_translation.json").read_text(encoding="utf-8"))
    for seed in (0, 1, 2):
        assert beam["hypotheses"][f"greedy {seed}"] == ch01["runs"][f"additive {seed}"]["greedy"]
    assert {len(h) for h in beam["hypotheses"].values()} == {259}
    assert len(beam["hypotheses"]) == 3 * len(beam["settings"])
