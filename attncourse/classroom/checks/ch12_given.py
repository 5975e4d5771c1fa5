"""Chapter 12's find-the-bug exercises graded as a diagnosis (see :mod:`.edits`): the given functions exactly as the
exercise notebook shows them (tests/test_edits.py compares the two), how far a fix may move from each, and an answer
written afresh that the small-edit property refuses. Kept apart from ch12.py so that each module stays readable."""

from __future__ import annotations

import math

import torch

from . import edits

BUGGY_SIGMOID = '''\
def sigmoid_cross_attention(x, context, w_q, w_k, w_v, n_heads):
    # x (B, Tq, d_model), context (B, Tk, d_model); w_q, w_k, w_v (d_model, d_model) -> (B, Tq, d_model)
    b, tq, d_model = x.shape
    tk, d = context.shape[1], d_model // n_heads
    q = (x @ w_q).view(b, tq, n_heads, d).transpose(1, 2)  # (B, Tq, d_model) -> (B, H, Tq, d)
    k = (context @ w_k).view(b, tk, n_heads, d).transpose(1, 2)  # (B, H, Tk, d)
    v = (context @ w_v).view(b, tk, n_heads, d).transpose(1, 2)  # (B, H, Tk, d)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d) - math.log(tq)  # (B, H, Tq, d) @ (B, H, d, Tk) -> (B, H, Tq, Tk)
    weights = torch.sigmoid(scores)  # (B, H, Tq, Tk)
    out = weights @ v  # (B, H, Tq, Tk) @ (B, H, Tk, d) -> (B, H, Tq, d)
    return out.transpose(1, 2).reshape(b, tq, d_model)  # (B, H, Tq, d) -> (B, Tq, d_model)
'''
FIX_SIGMOID = edits.SmallEdit(BUGGY_SIGMOID, most=4, lines=(8,))

BUGGY_LAMBDA = '''\
def lambda_init_schedule(n_layers):
    # lambda_init of each layer of an n_layers-deep Differential Transformer, first layer first
    inits = [0.8 - 0.6 * math.exp(-0.3 * (layer - 1)) for layer in range(n_layers)]
    return torch.tensor(inits, dtype=torch.float64)
'''
FIX_LAMBDA = edits.SmallEdit(BUGGY_LAMBDA, most=5, lines=(3,))


def _breaker_rewrite_sigmoid(x, context, w_q, w_k, w_v, n_heads):
    """Multi-head sigmoid cross-attention written from the lesson's formula without reading the given code: right
    values, refused as no edit of the given function."""
    b, tq, d_model = x.shape
    tk, d = context.shape[1], d_model // n_heads
    q = (x @ w_q).view(b, tq, n_heads, d).transpose(1, 2)  # (B, H, Tq, d)
    k, v = ((context @ w).view(b, tk, n_heads, d).transpose(1, 2) for w in (w_k, w_v))  # (B, H, Tk, d) each
    weights = torch.sigmoid(q @ k.transpose(-2, -1) / math.sqrt(d) - math.log(tk))  # (B, H, Tq, Tk)
    return (weights @ v).transpose(1, 2).reshape(b, tq, d_model)  # (B, Tq, d_model)


def _breaker_rewrite_lambda(n_layers):
    """The schedule written from the paper's formula without reading the given code: right values, refused."""
    return torch.tensor([0.8 - 0.6 * math.exp(-0.3 * depth) for depth in range(n_layers)], dtype=torch.float64)
