"""Cases that ask for the gradients too, for the "one batched expression" exercises of chapters 01 and 02.

Output equality alone lets an answer read the numbers out of the tensors (``repr`` at 17 digits, ``torch.save`` to
bytes) and do the arithmetic in plain Python, where the operator trace sees nothing, so no count can grow with the
input. A backward case (:data:`forbidden.BACKWARD`) hands the answer inputs that require gradients and compares the
gradients of every floating input, for one fixed upstream gradient, with the reference's: an output computed outside
PyTorch carries no autograd graph and fails there, and so does one glued to the inputs by a term that is zero.

The backward cases come in two sizes, and a property judges the forward and the backward runs apart (a backward run
also counts autograd's operators, so the two kinds cannot share one count): an answer that computes only when the
inputs require gradients is judged on a count of its own.
"""

from __future__ import annotations

import torch

from . import Case, forbidden

# a custom autograd function would let an answer compute its output (and its gradients) in plain Python and hand
# them to autograd; none of these exercises needs one
NO_CUSTOM_GRADIENT = ("torch.autograd.Function.apply",)


def holding(module: torch.nn.Module, weights: dict) -> torch.nn.Module:
    """`module` with each named layer's ``weight`` replaced by the given tensor itself (not a copy), so gradients
    reach the tensors: ``holding(m, {"query_proj": W_q})``."""
    for name, w in weights.items():
        layer = module.get_submodule(name)
        del layer.weight
        layer.weight = w
    return module


def backward_case(name: str, args: tuple, reference, rtol: float = 1e-8, atol: float = 1e-10) -> Case:
    """A case asking for ``reference(*args)`` and the gradients of its floating tensor arguments (in order)."""
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    leaves = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for a in args]
    with torch.enable_grad():
        out = reference(*leaves)
    expected = forbidden.with_gradients(out, [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad])
    return Case(name, args, kwargs={forbidden.BACKWARD: True}, expected=expected, rtol=rtol, atol=atol)


def is_backward(run) -> bool:
    return bool((run.case.kwargs or {}).get(forbidden.BACKWARD))


def apart(prop):
    """`prop` judged on the forward runs, then on the backward runs (each group of two or more)."""
    def judge(runs) -> str | None:
        for group in ([r for r in runs if not is_backward(r)], [r for r in runs if is_backward(r)]):
            if len(group) > 1 and (detail := prop(group)):
                return detail
        return None

    judge.__doc__ = prop.__doc__
    return judge
