"""Cross-entropy over a large vocabulary without the logits: the online log-sum-exp over vocabulary chunks.

A language model's loss is ``F.cross_entropy(h @ W.T, y)``: for N tokens and a vocabulary of V that builds an
(N, V) logit matrix (and its gradient), often the largest tensor of a training step. The loss needs only, per
token, the log-sum-exp of its row and the logit of its target, and the log-sum-exp is chapter 08's online
(max, sum) state: so the vocabulary can be walked in chunks of C columns, each chunk's logits made, folded into the
state and dropped. The backward walks the chunks again and rebuilds each chunk's softmax from the saved lse, as
FlashAttention's backward rebuilds P. Peak extra memory: O(N C) instead of O(N V). Cut Cross-Entropy (Wijmans et al.
2024) walks the vocabulary in blocks like this, on chip; Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024)
chunks the tokens instead. Written for clarity, not speed.
"""
from __future__ import annotations

from typing import Callable

import torch

from ._validate import positive_int
from .chunked import _StorageTracker

__all__ = ["chunked_cross_entropy", "fwd_bwd_peak_bytes"]


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    for name, x in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden (N, d) and weight (V, d), got hidden {tuple(hidden.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1] or targets.is_floating_point():
        raise ValueError(f"targets must be N={hidden.shape[0]} integer class ids, got shape {tuple(targets.shape)}, "
                         f"dtype {targets.dtype}")


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):
        n = hidden.shape[0]
        m = torch.full((n,), float("-inf"), dtype=torch.float32)     # (N,) running max
        s = torch.zeros(n, dtype=torch.float32)                      # (N,) running sum, relative to m
        target_logit = torch.empty(n, dtype=torch.float32)           # (N,)
        for c0 in range(0, weight.shape[0], chunk_size):
            logits = (hidden @ weight[c0:c0 + chunk_size].T).float()  # (N, d) @ (d, C) -> (N, C), then dropped
            m_new = torch.maximum(m, logits.amax(-1))
            s = s * torch.exp(m - m_new) + torch.exp(logits - m_new[:, None]).sum(-1)
            m = m_new
            here = (targets >= c0) & (targets < c0 + logits.shape[1])
            target_logit[here] = logits[here, targets[here] - c0]
        lse = m + torch.log(s)                                       # (N,)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size = chunk_size
        return (lse - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        n, c = hidden.shape[0], ctx.chunk_size
        d_hidden = torch.zeros(hidden.shape, dtype=torch.float32)
        d_weight = torch.empty(weight.shape, dtype=torch.float32)
        rows = torch.arange(n)
        for c0 in range(0, weight.shape[0], c):
            w = weight[c0:c0 + c]                                    # (C, d)
            p = torch.exp((hidden @ w.T).float() - lse[:, None])     # (N, C): this chunk of the softmax
            here = (targets >= c0) & (targets < c0 + w.shape[0])
            p[rows[here], targets[here] - c0] -= 1.0                 # d loss / d logits = softmax - one-hot
            p *= grad / n                                            # the mean over tokens
            d_hidden += p @ w.float()                                # (N, C) @ (C, d)
            d_weight[c0:c0 + c] = p.T @ hidden.float()               # (C, N) @ (N, d)
        return d_hidden.to(hidden.dtype), d_weight.to(weight.dtype), None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_size: int = 1024) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` (N, V) against `targets` (N,), never holding more than
    `chunk_size` columns of the logits; differentiable in `hidden` (N, d) and `weight` (V, d). Logits, the
    running max and sum are float32 whatever the input dtype."""
    _check(hidden, weight, targets)
    positive_int("chunk_size", chunk_size)
    return _ChunkedCE.apply(hidden, weight, targets, chunk_size)


def fwd_bwd_peak_bytes(loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                       hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> int:
    """Peak bytes of tensors alive at once while ``loss_fn(hidden, weight, targets)`` runs forward and backward
    (gradients of hidden and weight included, inputs not). Exact and machine-independent."""
    _check(hidden, weight, targets)
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    tracker = _StorageTracker()
    with tracker:
        torch.autograd.grad(loss_fn(h, w, targets), (h, w))
    return tracker.peak
