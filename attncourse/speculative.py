"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): the accept/reject rule that lets a large model
verify k draft tokens in one forward and still emit tokens distributed exactly as its own samples.

A draft model proposes tokens x_1 .. x_k, sampled from its distributions q_1 .. q_k; the target model scores all
of them in one forward, giving p_1 .. p_{k+1}. Token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i));
at the first rejection the step emits one token drawn from the residual norm(max(0, p_i - q_i)) and stops; if all k
are accepted it emits a bonus token from p_{k+1}. Every emitted token is then distributed as the target's (the
papers' theorem; :func:`speculative_step` is checked against it empirically in tests/test_ch07_speculative.py and in
chapter 07), and the chance of accepting x_i is sum_x min(p_i(x), q_i(x)) = 1 - TV(p_i, q_i).
"""

from __future__ import annotations

import torch

from . import _validate


def _check_probs(name: str, x: torch.Tensor) -> None:
    _validate.tensor(name, x, floating=True)
    if x.dim() != 2:
        raise ValueError(f"{name} must be (positions, V) probabilities, got shape {tuple(x.shape)}")
    if bool((x < 0).any()) or not torch.allclose(x.sum(-1), torch.ones_like(x[:, 0]), atol=1e-6):
        raise ValueError(f"{name} must hold probabilities (non-negative rows summing to 1), shape {tuple(x.shape)}")


def speculative_step(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One verification step of speculative sampling, for N independent samples at once.

    Args:
        p: (k + 1, V) the target's next-token probabilities at each draft position and one after the last.
        q: (k, V) the draft's probabilities the draft tokens were sampled from.
        draft: (N, k) int64 draft tokens, row n sampled from q position by position.
        generator: for the acceptance tests and the resampling.

    Returns ``(tokens, n_emitted)``: tokens (N, k + 1) int64, the emitted tokens of each sample padded with -1, and
    n_emitted (N,) how many were emitted (accepted drafts + 1: the residual draw or the bonus token).
    The target's distributions here do not depend on the tokens before them (a toy: in a model they would be
    recomputed per prefix, which the one verification forward does). Raises ValueError for shapes that do not
    match or rows that are not probabilities.
    """
    _check_probs("p", p)
    _check_probs("q", q)
    _validate.tensor("draft", draft)
    k, vocab = q.shape
    if p.shape != (k + 1, vocab) or draft.dim() != 2 or draft.shape[1] != k or draft.is_floating_point():
        raise ValueError(f"p must be (k + 1, V), q (k, V) and draft (N, k) integers; got p {tuple(p.shape)}, "
                         f"q {tuple(q.shape)}, draft {tuple(draft.shape)} ({draft.dtype})")
    n = draft.shape[0]
    tokens = torch.full((n, k + 1), -1, dtype=torch.long)
    alive = torch.ones(n, dtype=torch.bool)  # (N,) still accepting
    n_emitted = torch.zeros(n, dtype=torch.long)
    for i in range(k):
        x = draft[:, i]  # (N,)
        ratio = (p[i, x] / q[i, x]).clamp(max=1.0)  # (N,) acceptance probability min(1, p/q)
        accept = alive & (torch.rand(n, generator=generator, dtype=p.dtype) < ratio)
        reject = alive & ~accept
        tokens[accept, i] = x[accept]
        residual = (p[i] - q[i]).clamp(min=0.0)  # (V,) where the target wants more than the draft gave
        if bool(reject.any()):  # a residual of zero mass means p = q: then nothing is ever rejected
            tokens[reject, i] = torch.multinomial(residual / residual.sum(), int(reject.sum()), replacement=True,
                                                  generator=generator)
        n_emitted += accept.long() + reject.long()
        alive = accept
    if bool(alive.any()):  # every draft accepted: a bonus token from the target's next distribution
        tokens[alive, k] = torch.multinomial(p[k], int(alive.sum()), replacement=True, generator=generator)
        n_emitted += alive.long()
    return tokens, n_emitted
