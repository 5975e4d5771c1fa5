r"""Beam search with an end token and length normalisation (chapter 02), for the translation model of chapter 01.

On reversal every output has the input's length, so :mod:`attncourse.beam` never compares outputs of different
lengths. A translation ends when the model writes ``<eos>``, and every word multiplies the probability by a number
below one: ranked by total log-probability, short outputs win. Wu et al. (2016, GNMT, section 7) divide the
log-probability by a length penalty,

.. math::

    \mathrm{score}(Y) = \frac{\log P(Y \mid X)}{lp(Y)}, \qquad lp(Y) = \frac{(5 + |Y|)^\alpha}{(5 + 1)^\alpha},

with :math:`\alpha = 0` the plain log-probability and :math:`\alpha = 1` close to dividing by the length (:math:`|Y|`
counts ``<eos>``). :func:`beam_translate` keeps `width` unfinished hypotheses; at each step it ranks all their
one-word extensions by log-probability, sets aside the ones that end in ``<eos>`` (among the best `width`) as
finished, and keeps the best `width` others. It stops when `width` hypotheses have finished or after `max_len`
words, and returns the finished one (or, if none finished, the unfinished one) with the best score.
"""

from __future__ import annotations

import torch

from . import _validate
from .seq2seq import PAD, SOS, Seq2Seq


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's lp: ((5 + length) / 6) ** alpha."""
    return ((5 + _validate.positive_int("length", length)) / 6) ** float(alpha)


@torch.no_grad()
def beam_translate(model: Seq2Seq, src: torch.Tensor, width: int, alpha: float = 0.0, eos: int = 2,
                   max_len: int = 12) -> tuple[list[int], float]:
    """The best hypothesis for one source `src` (1-D long, no padding): its token ids (``<eos>`` included when it
    finished) and its total log-probability."""
    if type(model) is not Seq2Seq:
        raise TypeError(f"model must be a Seq2Seq (the course's Luong-style decoder), got {type(model).__name__}")
    if not isinstance(src, torch.Tensor) or src.dtype != torch.long or src.dim() != 1 or bool((src == PAD).any()):
        raise ValueError(f"src must be a 1-D long tensor of token ids without padding, got "
                         f"{getattr(src, 'dtype', type(src))} of shape {tuple(getattr(src, 'shape', ()))}")
    _validate.positive_int("width", width)
    _validate.positive_int("max_len", max_len)
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    annotations, state = model.encode(src[None], torch.tensor([src.shape[0]]))  # (1, S, 2E), (1, Dd)
    mask = torch.ones(1, src.shape[0], dtype=torch.bool)  # (1, S)
    hidden, last = state[None], torch.full((1, 1), SOS)  # (1, n, Dd), (n, 1)
    tokens, scores = torch.zeros(1, 0, dtype=torch.long), torch.zeros(1)  # (n, t), (n,)
    finished: list[tuple[float, list[int], float]] = []  # (normalised score, tokens, log-probability)
    for t in range(max_len):
        n = scores.shape[0]
        out, hidden = model.decoder(model.embed(last), hidden)  # (n, 1, Dd), (1, n, Dd)
        logits, _ = model.readout(out, annotations.expand(n, -1, -1), mask.expand(n, -1), t)  # (n, 1, V)
        total = scores[:, None] + logits[:, 0].log_softmax(-1)  # (n, V)
        vocab = total.shape[1]
        best = total.flatten().topk(min(2 * width, n * vocab))  # sorted, best first
        parent, token = best.indices // vocab, best.indices % vocab
        keep = []
        for rank, (p, w, s) in enumerate(zip(parent.tolist(), token.tolist(), best.values.tolist())):
            if w == eos:
                if rank < width:  # an ending among the best `width` extensions: a finished hypothesis
                    ids = tokens[p].tolist() + [eos]
                    finished.append((s / length_penalty(len(ids), alpha), ids, s))
            elif len(keep) < width:
                keep.append(rank)
        if len(finished) >= width or not keep:
            break
        keep_t = torch.tensor(keep)
        parent, token = parent[keep_t], token[keep_t]
        scores, hidden, last = best.values[keep_t], hidden[:, parent], token[:, None]
        tokens = torch.cat([tokens[parent], token[:, None]], dim=1)  # (n', t + 1)
    if not finished:  # nothing ended within max_len: the best unfinished hypothesis
        ids = tokens[0].tolist()
        return ids, scores[0].item()
    _, ids, logprob = max(finished, key=lambda f: f[0])
    return ids, logprob





def translate_all(model: Seq2Seq, corpus, width: int, alpha: float = 0.0, max_len: int = 12,
                  sentences: list[list[str]] | None = None) -> list[str]:
    """Beam translations of `sentences` (default: every held-out English sentence of `corpus`, a
    :class:`~attncourse.translation.Corpus`) as strings, ``<eos>`` and ``<unk>`` left out (as chapter 01 scores
    its greedy translations)."""
    sentences = [e for e, _ in corpus.test_pairs] if sentences is None else sentences
    out = []
    for english in sentences:
        ids, _ = beam_translate(model, torch.tensor(corpus.ids(english)), width, alpha, max_len=max_len)
        out.append(" ".join(w for w in (corpus.words[i] for i in ids) if w not in ("<eos>", "<unk>")))
    return out


SETTINGS = (("greedy", 1, 0.0), ("beam 5", 5, 0.0), ("beam 5, alpha 0.6", 5, 0.6), ("beam 5, alpha 1", 5, 1.0))


def beam_study(models: dict[int, Seq2Seq], corpus, settings=SETTINGS) -> dict:
    """Every held-out sentence of `corpus` translated by every model (``{seed: model}``) under every setting
    ``(label, width, alpha)``: ``{"settings": [...], "hypotheses": {"label seed": [str per sentence]}}``."""
    return {"settings": [list(s) for s in settings],
            "hypotheses": {f"{label} {seed}": translate_all(model, corpus, width, alpha)
                           for label, width, alpha in settings for seed, model in models.items()}}


__all__ = ["SETTINGS", "beam_study", "beam_translate", "length_penalty", "translate_all"]
