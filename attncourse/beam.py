"""Beam search for the course's encoder-decoder (:class:`~attncourse.seq2seq.Seq2Seq`, chapters 01-02).

Greedy decoding keeps one prefix and extends it by its most probable token. Beam search keeps the
`width` prefixes with the highest total log-probability, extends each by every token, and keeps the
best `width` of those; width 1 is greedy decoding. The reversal task's output has a known length (no
end token), so every hypothesis has the same number of steps and no length normalisation is needed.
A wider beam is not guaranteed to find a more probable output than a narrower one (the best output's
prefix can fall out of the beam), nor a more *correct* one: measure both.
"""

from __future__ import annotations

import torch

from . import _validate
from .seq2seq import PAD, SOS, Seq2Seq


def _check(model: Seq2Seq, src: torch.Tensor, length: int) -> torch.Tensor:
    if type(model) is not Seq2Seq:
        raise TypeError(f"model must be a Seq2Seq (the course's Luong-style decoder), got {type(model).__name__}")
    if not isinstance(src, torch.Tensor) or src.dtype != torch.long or src.dim() != 1:
        raise ValueError(f"src must be a 1-D long tensor of token ids (one sequence), got "
                         f"{getattr(src, 'dtype', type(src))} of shape {tuple(getattr(src, 'shape', ()))}")
    _validate.positive_int("length", length)
    if length > src.shape[0] or bool((src[:length] == PAD).any()):
        raise ValueError(f"length must count src's real tokens, got length={length} for src of shape "
                         f"{tuple(src.shape)}")
    return src[:length][None]  # (1, S)


@torch.no_grad()
def sequence_logprob(model: Seq2Seq, src: torch.Tensor, length: int, tokens: torch.Tensor) -> float:
    """log p(tokens | src) under `model`, by teacher forcing: the sum over steps of each token's log-probability."""
    src = _check(model, src, length)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(getattr(tokens, 'shape', ()))}")
    logits, _ = model(src, torch.tensor([length]), tokens[None])  # (1, T, V)
    return logits[0].log_softmax(-1).gather(1, tokens[:, None]).sum().item()


@torch.no_grad()
def beam_search(model: Seq2Seq, src: torch.Tensor, length: int, width: int, steps: int | None = None
                ) -> tuple[torch.Tensor, float]:
    """The best of the `width` hypotheses left after `steps` steps (default `length`): tokens (steps,) and
    their total log-probability."""
    src = _check(model, src, length)
    _validate.positive_int("width", width)
    steps = length if steps is None else _validate.positive_int("steps", steps)
    annotations, state = model.encode(src, torch.tensor([length]))  # (1, S, 2E), (1, Dd)
    mask = src != PAD  # (1, S)
    hidden = state[None]  # (1, n, Dd) with n = 1 hypothesis
    last = torch.full((1, 1), SOS)  # (n, 1): each hypothesis's last token
    tokens = torch.zeros(1, 0, dtype=torch.long)  # (n, t)
    scores = torch.zeros(1)  # (n,): total log-probability of each hypothesis
    for t in range(steps):
        n = scores.shape[0]
        out, hidden = model.decoder(model.embed(last), hidden)  # (n, 1, Dd), (1, n, Dd)
        logits, _ = model.readout(out, annotations.expand(n, -1, -1), mask.expand(n, -1), t)  # (n, 1, V)
        logp = logits[:, 0].log_softmax(-1)  # (n, V)
        vocab = logp.shape[1]
        best = (scores[:, None] + logp).flatten().topk(min(width, n * vocab))  # sorted, best first
        parent, token = best.indices // vocab, best.indices % vocab  # (n',), (n',)
        scores, hidden, last = best.values, hidden[:, parent], token[:, None]
        tokens = torch.cat([tokens[parent], token[:, None]], dim=1)  # (n', t + 1)
    return tokens[0], scores[0].item()
