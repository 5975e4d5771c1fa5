"""Guards of chapter 09's exercise 1 (the backward of one key block): the gradients come from the chain rule, not
from evaluating the block many times (finite differences, complex steps), and a breaker that shows it."""

from __future__ import annotations

import math

import torch

from . import forbidden


def _numel(shape) -> int:
    return math.prod(shape)


def _no_numeric_differentiation(runs) -> str | None:
    """The gradients come from the chain rule, not from evaluating the block many times: the operators run stay
    below twice the number of input entries (finite differences need two evaluations per entry, several operators
    each), and none takes a tensor larger than 4x the block's largest (perturbations stacked into one tensor)."""
    for run in runs:
        q, k, v, _out, _lse, d_out = run.case.args[:6]
        entries = sum(x.numel() for x in (q, k, v))
        largest = max(x.numel() for x in (q, k, v, d_out)) + q.shape[:-1].numel() * k.shape[-2]  # + (..., Tq, Bk)
        ran = sum(n for op, n in run.trace["counts"].items()
                  if not forbidden.DATA_OPS.match(forbidden.normalise(op)))
        if ran > 2 * entries:
            return (f"case '{run.case.name}': your code ran {ran} operators for a block of {entries} input entries: the "
                    "work grows with the number of entries, as numerical differentiation's does. Derive the "
                    "gradients with the chain rule through the two products instead")
        for name, _launch, _helper, tensors in run.trace["ops"]:
            for _label, _offset, shape, _stride in tensors:
                if _numel(shape) > 4 * largest:
                    return (f"case '{run.case.name}': an operator ({name}) took a tensor of shape {tuple(shape)}, far "
                            "larger than anything in the block (one copy per input entry, as stacked numerical "
                            "differentiation makes). Derive the gradients with the chain rule instead")
    return None


def _breaker_complex_step(q, k, v, out, lse, d_out, scale):
    """Right to machine precision with no chain rule: the complex-step derivative of the block's surrogate
    <dO, P V> - <D, rowsum P>, every entry's perturbation stacked on a leading axis."""
    delta = (d_out * out).sum(-1, keepdim=True)  # (..., Tq, 1)
    grads = []
    for which, x in enumerate((q, k, v)):
        n = x.numel()
        steps = (torch.eye(n, dtype=torch.complex128) * 1e-30j).view(n, *x.shape)  # (n, *x.shape)
        args = [t.to(torch.complex128).expand(n, *t.shape) for t in (q, k, v)]
        args[which] = args[which] + steps
        p = torch.exp(args[0] @ args[1].transpose(-2, -1) * scale - lse[..., None])  # (n, ..., Tq, Bk)
        g = (d_out * (p @ args[2])).flatten(1).sum(-1) - (delta * p).flatten(1).sum(-1)  # (n,)
        grads.append((g.imag / 1e-30).view_as(x))
    return tuple(grads)
