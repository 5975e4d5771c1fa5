"""Speculative sampling's accept/reject rule (attncourse.speculative): the emitted tokens are distributed as the
target model's, position by position, whatever the draft; the acceptance rate is 1 - TV(p, q)."""

from __future__ import annotations

import pytest
import torch

from attncourse.speculative import speculative_step


def _dists(gen, rows, vocab, temperature):
    return torch.softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) / temperature, -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_emitted_tokens_follow_the_target(seed):
    gen = torch.Generator().manual_seed(seed)
    k, vocab, n = 3, 6, 200_000
    p, q = _dists(gen, k + 1, vocab, 1.0), _dists(gen, k, vocab, 0.5)  # a sharper, different draft
    draft = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(k)], dim=1)
    tokens, n_emitted = speculative_step(p, q, draft, gen)
    for i in range(k + 1):
        emitted = tokens[:, i][tokens[:, i] >= 0]  # the samples that reached position i
        freq = torch.bincount(emitted, minlength=vocab).double() / len(emitted)
        # the position's empirical distribution equals the target's: within 5 standard errors, every token
        se = (p[i] * (1 - p[i]) / len(emitted)).sqrt()
        assert bool(((freq - p[i]).abs() < 5 * se + 1e-4).all()), (i, freq, p[i])
    # acceptance rate of the first draft: sum min(p, q) = 1 - TV
    accepted_first = (n_emitted > 1).double().mean()
    assert abs(float(accepted_first) - float(torch.minimum(p[0], q[0]).sum())) < 0.01
    # the residual matters: redrawing a rejected token from p itself (a tempting shortcut) biases the output
    x = draft[:, 0]
    accept = torch.rand(n, generator=gen, dtype=torch.float64) < (p[0, x] / q[0, x]).clamp(max=1.0)
    naive = torch.where(accept, x, torch.multinomial(p[0], n, replacement=True, generator=gen))
    freq = torch.bincount(naive, minlength=vocab).double() / n
    assert bool(((freq - p[0]).abs() > 5 * (p[0] * (1 - p[0]) / n).sqrt()).any())


def test_identical_draft_is_always_accepted_and_bad_input_refused():
    gen = torch.Generator().manual_seed(5)
    p = _dists(gen, 3, 4, 1.0)
    draft = torch.stack([torch.multinomial(p[i], 1000, replacement=True, generator=gen) for i in range(2)], dim=1)
    tokens, n_emitted = speculative_step(p, p[:2], draft, gen)
    assert bool((n_emitted == 3).all()) and torch.equal(tokens[:, :2], draft)
    with pytest.raises(ValueError, match="draft"):
        speculative_step(p, p[:2], draft.double(), gen)
    with pytest.raises(ValueError, match="probabilities"):
        speculative_step(p * 2, p[:2], draft, gen)
