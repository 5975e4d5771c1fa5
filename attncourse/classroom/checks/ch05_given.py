"""Chapter 05's first find-the-bug exercise graded as a diagnosis (see :mod:`.edits`): the given function exactly as
the exercise notebook shows it (tests/test_edits.py compares the two), how far a fix may move from it, and an answer
written afresh that the small-edit property refuses. Kept apart from ch05.py so that each module stays readable.

The second (05-find-the-bug-2) is not graded this way: its given code is a module of other weights and shapes, and
the answer a function of GQA's own weights, so no small edit leads from one to the other."""

from __future__ import annotations

import torch

from . import edits

BUGGY_MQA = '''\
def mqa_buggy(x, w_q, w_k, w_v, w_o, n_heads):
    B, T, d = x.shape
    D = d // n_heads
    q = (x @ w_q.T).view(B, T, n_heads, D)                   # (B, T, H, D)
    k = (x @ w_k.T).view(B, T, 1, D)                         # (B, T, 1, D): the one shared key head
    v = (x @ w_v.T).view(B, T, 1, D)                         # (B, T, 1, D)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)          # (B, T, H, D) @ (B, T, D, 1) -> (B, T, H, 1)
    weights = torch.softmax(scores, dim=-1)
    out = (weights @ v).reshape(B, T, d)                     # (B, T, H, 1) @ (B, T, 1, D) -> (B, T, H, D) -> (B, T, d)
    return out @ w_o.T, weights
'''
# Its lines 2 and 3 (the sizes) are right; the layout can be fixed on any of the others.
FIX_MQA = edits.SmallEdit(BUGGY_MQA, most=36, lines=(4, 5, 6, 7, 8, 9, 10),
                          names=("permute", "swapaxes", "swapdims", "movedim", "unflatten", "flatten", "mT",
                                 "contiguous", "unsqueeze", "squeeze", "expand", "einsum"))  # einsum: the
# same fix spelled as two contractions over the right axes, `einsum('bthd,bsd->bhts', q, k[:, :, 0])` and back


def _breaker_rewrite_mqa(x, w_q, w_k, w_v, w_o, n_heads):
    """Multi-query attention written from the lesson's formula without reading the given code: right values,
    refused as no edit of the given function."""
    b, t, d = x.shape
    q = (x @ w_q.T).unflatten(-1, (n_heads, -1)).permute(0, 2, 1, 3)  # (B, H, T, D)
    k, v = ((x @ w.T)[:, None] for w in (w_k, w_v))  # (B, 1, T, D): one KV head for every query head
    weights = (q @ k.mT * q.shape[-1] ** -0.5).softmax(-1)  # (B, H, T, T)
    return (weights @ v).permute(0, 2, 1, 3).flatten(2) @ w_o.T
