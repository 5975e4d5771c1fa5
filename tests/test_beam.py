"""Beam search on the course's encoder-decoder: width 1 is greedy, a full-width beam is exhaustive search."""

import itertools

import pytest
import torch

from attncourse.beam import beam_search, sequence_logprob
from attncourse.seq2seq import PAD, Seq2SeqConfig, build_model, reverse_batch

SMALL = dict(min_len=2, max_len=6, embed_size=8, encoder_size=6, decoder_size=12, attention_size=5)


@pytest.mark.parametrize("kind", ["none", "dot", "additive", "general"])
def test_width_one_is_greedy_decoding_exactly(kind):
    model = build_model(kind, Seq2SeqConfig(**SMALL, seed=3)).eval()
    batch = reverse_batch(6, 2, 6, generator=torch.Generator().manual_seed(0))
    for src, n in zip(batch.src, batch.lengths.tolist()):
        with torch.no_grad():
            logits, _ = model(src[None, :n], torch.tensor([n]), steps=n)  # the model's own greedy loop
        greedy = logits[0].argmax(-1)
        tokens, score = beam_search(model, src, n, width=1)
        assert torch.equal(tokens, greedy)
        assert score == pytest.approx(sequence_logprob(model, src, n, greedy), abs=1e-5)


def test_full_width_beam_is_exhaustive_search_and_scores_are_teacher_forced_logprobs():
    model = build_model("dot", Seq2SeqConfig(**SMALL, num_digits=2, seed=1)).eval()
    vocab = model.config.vocab_size
    src, n = torch.tensor([3, 2, 3]), 3
    every = {seq: sequence_logprob(model, src, n, torch.tensor(seq))
             for seq in itertools.product(range(vocab), repeat=n)}
    best = max(every, key=every.get)
    tokens, score = beam_search(model, src, n, width=vocab ** (n - 1))  # keeps every prefix: exhaustive
    assert tuple(tokens.tolist()) == best and score == pytest.approx(every[best], abs=1e-5)
    greedy, greedy_score = beam_search(model, src, n, width=1)
    assert score >= greedy_score - 1e-6
    for width in (2, 3):
        tokens, score = beam_search(model, src, n, width=width)
        assert score == pytest.approx(every[tuple(tokens.tolist())], abs=1e-5)


def test_beam_search_rejects_bad_input():
    model = build_model("dot", Seq2SeqConfig(**SMALL))
    src = torch.tensor([2, 3, 4, PAD])
    with pytest.raises(ValueError, match="length must count"):
        beam_search(model, src, 4, width=2)
    with pytest.raises(ValueError, match="width must be positive"):
        beam_search(model, src, 3, width=0)
    with pytest.raises(ValueError, match="src must be a 1-D long tensor"):
        beam_search(model, src[None], 3, width=2)
    with pytest.raises(TypeError, match="model must be a Seq2Seq"):
        beam_search(build_model("bahdanau", Seq2SeqConfig(**SMALL)), src, 3, width=2)
