r"""What the score scale does to attention's gradients and to training: the experiments of chapters 02 and 03.

Two parameterisations of the same attention differ only in the factor on the logits,
:math:`s = c\, q \cdot k` with :math:`c = 1/\sqrt{d_k}` (scaled), :math:`c = 1` (unscaled) or :math:`c = 1/d_k`
(muP's choice). By the chain rule :math:`\partial L/\partial q = c \sum_j (\partial L/\partial s_j)\, k_j`, so the
gradient reaching the queries carries the factor :math:`c` itself: an unscaled model's :math:`\partial L/\partial q`
is :math:`\sqrt{d_k}` times larger than a scaled one's for the same logit gradient, whatever the softmax does.
Comparing :math:`\partial L/\partial q` across parameterisations therefore mixes the factor with saturation. The
gradient with respect to the logits, :math:`\partial L/\partial s`, is the like-for-like quantity:
:func:`score_gradients` returns both.

:func:`train_lookup` trains a small attention (learned query and key projections, Adam) on a key-value lookup
with a chosen scale, so that the lessons can show what the scale does to training rather than argue it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _validate
from .sdpa import safe_softmax


def _scale_factor(scale: str | float, d_k: int) -> float:
    """The factor c on q.k: 'sqrt' -> 1/sqrt(d_k), 'none' -> 1, 'd' -> 1/d_k, or a positive number as given."""
    if isinstance(scale, str):
        table = {"sqrt": 1 / math.sqrt(d_k), "none": 1.0, "d": 1 / d_k}
        if scale not in table:
            raise ValueError(f"scale must be 'sqrt', 'none', 'd' or a positive number, got {scale!r}")
        return table[scale]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be 'sqrt', 'none', 'd' or a positive number, got {scale!r}")
    return float(scale)


def score_gradients(d_k: int, scale: str | float, seed: int, *, n: int = 256, n_keys: int = 32
                    ) -> dict[str, torch.Tensor]:
    r"""Per-query gradient norms of one attention step with random unit-variance q, k, v and a random loss.

    Each of `n` queries (d_k entries, independent, mean 0, variance 1: the assumptions of the variance law)
    attends over its own `n_keys` keys and values; the loss is :math:`L = \sum \mathrm{out} \odot u` for a random
    upstream gradient :math:`u`. The same seed draws the same q, k, v and u for every `scale`, so the
    parameterisations are compared on identical data.

    Args:
        d_k: key (and value) width, a positive int.
        scale: the factor on q.k: ``"sqrt"`` (1/sqrt(d_k)), ``"none"`` (1), ``"d"`` (1/d_k) or a positive number.
        seed: seeds the draws.
        n, n_keys: number of queries and keys per query, positive ints.

    Returns:
        dict of (n,) float32 tensors: ``"logits"`` :math:`\|\partial L/\partial s\|` over the query's keys,
        ``"query"`` :math:`\|\partial L/\partial q\|`, ``"key"`` :math:`\|\partial L/\partial K\|` over its keys,
        and ``"max_weight"``, the largest softmax weight of the row.

    Raises:
        ValueError: if a size is not a positive int or `scale` is not one of the accepted values.
    """
    for name, value in (("d_k", d_k), ("n", n), ("n_keys", n_keys)):
        _validate.positive_int(name, value)
    c = _scale_factor(scale, d_k)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 1, d_k, generator=gen).requires_grad_()          # (n, 1, d_k): one query per row
    k = torch.randn(n, n_keys, d_k, generator=gen).requires_grad_()     # (n, n_keys, d_k)
    v = torch.randn(n, n_keys, d_k, generator=gen)                      # (n, n_keys, d_k)
    upstream = torch.randn(n, 1, d_k, generator=gen)                    # (n, 1, d_k): dL/d(out)
    logits = (q @ k.transpose(-2, -1)) * c                              # (n, 1, d_k) @ (n, d_k, n_keys) -> (n, 1, n_keys)
    logits.retain_grad()
    weights = safe_softmax(logits, dim=-1)                              # (n, 1, n_keys)
    ((weights @ v) * upstream).sum().backward()                         # (n, 1, n_keys) @ (n, n_keys, d_k) -> (n, 1, d_k)
    return {"logits": logits.grad.flatten(1).norm(dim=-1), "query": q.grad.flatten(1).norm(dim=-1),
            "key": k.grad.flatten(1).norm(dim=-1), "max_weight": weights.detach().flatten(1).amax(-1)}


@dataclass
class LookupConfig:
    """The key-value lookup of :func:`train_lookup`."""

    d_in: int = 32        # width of the token vectors the projections read
    n_keys: int = 16      # keys (and values) per example
    d_v: int = 8          # width of the values
    noise: float = 0.5    # the query is a key plus Gaussian noise of this standard deviation
    batch: int = 32
    steps: int = 200
    lr: float = 3e-3      # Adam's learning rate, the same for every scale


def lookup_batch(config: LookupConfig, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One batch of the lookup: tokens (B, n_keys, d_in), values (B, n_keys, d_v), query tokens (B, d_in),
    targets (B, d_v): the value of the key the query is a noisy copy of."""
    B, S = config.batch, config.n_keys
    tokens = torch.randn(B, S, config.d_in, generator=gen)                       # (B, S, d_in)
    values = torch.randn(B, S, config.d_v, generator=gen)                        # (B, S, d_v)
    pick = torch.randint(S, (B,), generator=gen)                                 # (B,) which key is asked for
    rows = torch.arange(B)
    queries = tokens[rows, pick] + config.noise * torch.randn(B, config.d_in, generator=gen)  # (B, d_in)
    return tokens, values, queries, values[rows, pick]


def train_lookup(d_k: int, scale: str | float, seed: int, config: LookupConfig | None = None, *,
                 qk_norm: bool = False, cap: float | None = None, zero_q: bool = False) -> dict[str, torch.Tensor]:
    r"""Train query and key projections :math:`W_q, W_k \in \mathbb{R}^{d_{in} \times d_k}` with Adam on the lookup.

    The model is one attention step, :math:`\mathrm{out} = \mathrm{softmax}(c\,(x_q W_q)(X W_k)^\top)\,V`, and the
    loss the squared error against the asked-for value. The projections start with entries of variance
    :math:`1/d_{in}`, so q and k start with independent unit-variance entries, as the variance law assumes.
    The same seed draws the same initial projections and batches for every `scale`.

    Args:
        d_k: query/key width, a positive int.
        scale: ``"sqrt"``, ``"none"``, ``"d"`` or a positive number (see :func:`score_gradients`).
        seed: seeds the initialisation and the batches.
        config: task and optimiser sizes (:class:`LookupConfig`).
        qk_norm: RMS-normalise q and k over their d_k entries, each then times a learned per-channel gain
            (initialised to 1, trained with the projections): QK-norm.
        cap: soft-cap the scaled logits, :math:`s \mapsto \mathrm{cap}\tanh(s/\mathrm{cap})` (a positive float),
            or None.
        zero_q: start W_q at zero (muP's attention initialisation, Yang et al. 2022: every logit 0, attention
            uniform at step 0); W_k and the batches are drawn as without it.

    Returns:
        dict of (steps,) float tensors: ``"loss"`` per step, ``"saturated"`` the share of rows whose largest
        weight exceeds 0.99, ``"logit_grad"`` the median over rows of :math:`\|\partial L/\partial s\|`,
        ``"max_logit"`` the largest :math:`|s|` in the batch (after the scale, the norm and the cap),
        ``"saturated_grad_share"`` the saturated rows' share of :math:`\sum_{\text{rows}} \|\partial L/\partial s\|^2`
        (how much of the step's logit gradient they carry), ``"saturated_wrong"`` the share of rows saturated on a
        key other than the asked-for one, ``"saturated_wrong_loss"`` those rows' share of the batch's loss, ``"entropy"`` the mean over rows of the
        attention row's entropy in nats (at most :math:`\log n_{keys}`; near 0 for one-hot rows).

    Raises:
        ValueError: if `d_k` is not a positive int, `scale` is not accepted or `cap` is not positive.
    """
    _validate.positive_int("d_k", d_k)
    c = _scale_factor(scale, d_k)
    if cap is not None and not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0):
        raise ValueError(f"cap must be a positive number or None, got {cap!r}")
    config = config or LookupConfig()
    gen = torch.Generator().manual_seed(seed)
    w_q = (torch.randn(config.d_in, d_k, generator=gen) / math.sqrt(config.d_in)).requires_grad_()  # (d_in, d_k)
    w_k = (torch.randn(config.d_in, d_k, generator=gen) / math.sqrt(config.d_in)).requires_grad_()  # (d_in, d_k)
    if zero_q:
        w_q.data.zero_()                                            # drawn first, so W_k and the batches match
    gains = [torch.ones(d_k, requires_grad=True) for _ in range(2)] if qk_norm else []  # (d_k,) each
    opt = torch.optim.Adam([w_q, w_k, *gains], lr=config.lr)
    names = ("loss", "saturated", "logit_grad", "max_logit", "saturated_grad_share", "saturated_wrong",
             "saturated_wrong_loss", "entropy")
    trace = {name: torch.empty(config.steps) for name in names}
    for step in range(config.steps):
        tokens, values, queries, target = lookup_batch(config, gen)
        q, k = queries @ w_q, tokens @ w_k                          # (B, d_k), (B, S, d_k)
        if qk_norm:                                                 # unit RMS over d_k, then the learned gains
            q = gains[0] * q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
            k = gains[1] * k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)
        logits = (k @ q[:, :, None]).squeeze(-1) * c                # (B, S, d_k) @ (B, d_k, 1) -> (B, S)
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        logits.retain_grad()
        weights = safe_softmax(logits, dim=-1)                      # (B, S)
        out = (weights[:, None] @ values).squeeze(1)                # (B, 1, S) @ (B, S, d_v) -> (B, d_v)
        row_loss = ((out - target) ** 2).sum(-1)                   # (B,)
        loss = row_loss.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        trace["loss"][step] = loss.item()
        saturated = weights.detach().amax(-1) > 0.99                # (B,)
        trace["saturated"][step] = saturated.float().mean()
        grad_mass = logits.grad.pow(2).sum(-1)                      # (B,): ||dL/ds||^2 per row
        trace["saturated_grad_share"][step] = grad_mass[saturated].sum() / grad_mass.sum().clamp_min(1e-30)
        top = weights.detach().argmax(-1)                           # (B,) the key each row puts most weight on
        wrong = saturated & (values[torch.arange(len(top)), top] != target).any(-1)     # saturated on another key
        trace["saturated_wrong"][step] = wrong.float().mean()
        row_loss = row_loss.detach()
        trace["saturated_wrong_loss"][step] = row_loss[wrong].sum() / row_loss.sum().clamp_min(1e-30)
        trace["logit_grad"][step] = logits.grad.norm(dim=-1).median()
        trace["max_logit"][step] = logits.detach().abs().max()
        w = weights.detach()
        trace["entropy"][step] = -(w * w.clamp_min(1e-30).log()).sum(-1).mean()
    return trace
