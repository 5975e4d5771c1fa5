"""A gradient case for every implement exercise whose library answer is differentiable.

The guard's read-out budget counts the floats an answer takes out of PyTorch (``item``, ``tolist``, a repr at high
precision, ``torch.save``), but not integers: ``(t * 2**40).long().tolist()`` carries every float out, and a plain
Python loop can then compute the answer where no operator trace sees it (README, "What the guard cannot see"). The
defence that does not depend on how the numbers left is autograd: a result computed outside PyTorch and put back
carries no gradient, and one glued to the inputs by a term that is zero carries the wrong one.

:func:`gradient_case` builds, for an implement exercise's cases, one more: its smallest case again, with inputs that
require gradients (:data:`forbidden.BACKWARD`); the expected value is what the exercise's shortcuts (the library
functions doing the same job, run unguarded) give for the result and for the gradients of every real-valued floating
input, for one fixed upstream gradient. The case is added only when some shortcut returns a floating tensor (or a
tuple whose first item is one) with an autograd graph and every shortcut that has one agrees on the gradients, so an
exercise whose job has no gradient (indices, a gradient zero everywhere) gets none. A tuple is judged by its first
item's gradients (the items after it are judged by the declared cases). An exercise whose right answers autograd
cannot follow (a Triton kernel, state updated in place) sets ``gradient=False``. Inputs that are masks or positions
stored as floats (every value an integer, or some not finite) are left out of the comparison: an answer may read them
as booleans. Chapters 01-03 write their gradient cases by hand (:mod:`.graphs`); an exercise with a backward case of
its own gets no second one.
"""

from __future__ import annotations

import functools

import torch

from . import forbidden


def with_gradient_case(make_cases, exercise):
    """`make_cases` followed by the gradient case of ``exercise()`` where one applies; it keeps `make_cases`'s name and
    module (the grader's watch maps a module to its exercises by it) and holds it as ``.declared``."""
    def cases():
        declared = make_cases()
        extra = gradient_case(exercise(), declared)
        return declared if extra is None else [*declared, extra]

    functools.update_wrapper(cases, make_cases)
    cases.declared = make_cases
    return cases


def _real_valued(x) -> bool:
    """A floating tensor whose gradient the case compares: finite, not every value an integer (not a mask)."""
    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 0 and bool(torch.isfinite(x).all())
            and not bool((x == x.round()).all()))


def _reference(shortcut, args, kwargs):
    """``(out, *grads)`` of `shortcut` for the case's inputs made leaves, or None when it has no gradient."""
    leaves, call = [], []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            a = a.detach().clone().requires_grad_()
            leaves.append(a)
        call.append(a)
    try:  # a shortcut that builds a module draws its initial weights: the notebook's random stream must not move
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            out = _first(shortcut(*call, **kwargs))
            if not (isinstance(out, torch.Tensor) and out.is_floating_point() and out.requires_grad):
                return None
            return forbidden.with_gradients(out, leaves)
    except Exception:  # a shortcut that cannot run with gradients: no gradient case
        return None


def _first(result):
    """A tuple's first item (the one the gradient case judges), anything else itself."""
    return result[0] if isinstance(result, tuple) and result else result


def _smallest(cases):
    def size(case):
        return sum(a.numel() for a in case.args if isinstance(a, torch.Tensor))

    plain = [c for c in cases if not (c.kwargs or {}).get(forbidden.BACKWARD) and c.compare in ("close", "equal")
             and isinstance(_first(c.expected), torch.Tensor) and _first(c.expected).is_floating_point()
             and any(_real_valued(a) for a in c.args)]
    return min(plain, key=size) if plain else None


def gradient_case(ex, cases):
    """The gradient case for `ex` given its `cases`, or None (see the module docstring)."""
    from . import Case

    if ex.category != "implement" or ex.kind != "function" or ex.numpy or ex.stream or not ex.shortcuts or \
            not ex.gradient or any((c.kwargs or {}).get(forbidden.BACKWARD) for c in cases):
        return None
    base = _smallest(cases)
    if base is None:
        return None
    kwargs = dict(base.kwargs or {})
    refs = [r for r in (_reference(s, base.args, kwargs) for s in ex.shortcuts) if r is not None]
    if not refs:  # no library answer has a gradient (a kernel, a module copied under no_grad): no case
        return None
    floats = [a for a in base.args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    judged = [i for i, a in enumerate(floats) if _real_valued(a)]
    first = refs[0]
    for other in refs[1:]:
        if len(other) != len(first) or any(_differs(other[1 + i], first[1 + i]) for i in judged):
            return None  # the library answers disagree on the gradient: nothing to hold an answer to
    if not any(bool(first[1 + i].abs().gt(0).any()) for i in judged):
        return None  # the job passes no gradient (a rounding, a selection): a case would judge nothing
    names = [f"argument {i + 1}" for i, a in enumerate(base.args)
             if isinstance(a, torch.Tensor) and a.is_floating_point()]  # aligned with the gradients
    case = Case(f"{base.name}, gradients too", tuple(base.args), {**kwargs, forbidden.BACKWARD: True},
                expected=first, compare=_judge(judged, names, base), rtol=base.rtol, atol=base.atol)
    case.added = True  # not one of the exercise's declared cases: "all N case(s) passed" counts those
    return case


def _differs(got, ref) -> bool:
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    far = bool(((got.double() - ref.double()).abs() > 1e-3 * scale + 1e-6).any())
    return far or not bool(torch.isfinite(got).all())


def _judge(judged, names, base):
    def compare(got, expected):
        if not isinstance(got, tuple) or len(got) != len(expected):
            return "the result carries no gradient"
        out, grads = got[0], got[1:]
        if not isinstance(out, torch.Tensor) or out.shape != expected[0].shape or \
                not torch.allclose(out.double(), expected[0].double(), rtol=base.rtol, atol=base.atol):
            return "with inputs that require gradients, the result differs from the one the other cases accept"
        for i in judged:
            g = grads[i]
            if not isinstance(g, torch.Tensor) or g.shape != expected[1 + i].shape or _differs(g, expected[1 + i]):
                zero = isinstance(g, torch.Tensor) and not bool(g.abs().gt(0).any())
                return (f"the gradient of the result with respect to {names[i]} is "
                        f"{'zero' if zero else 'wrong'}: the result must be computed from the inputs with PyTorch "
                        "operations (a number taken out of a tensor with .item(), float(), .tolist() or a print, "
                        "and put back, carries no gradient; nor does anything under torch.no_grad() or .detach())")
        return None

    return compare


def is_added(case) -> bool:
    """Whether `case` is a gradient case added here (not counted among the exercise's declared cases)."""
    return bool(getattr(case, "added", False))


def declared(cases) -> int:
    """How many of `cases` the exercise declares (a gradient case added here is not counted)."""
    return sum(not is_added(c) for c in cases)
