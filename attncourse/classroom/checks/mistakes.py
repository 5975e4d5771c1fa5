"""Common wrong answers, recognised from what a learner's function returned, and named without the code.

A wrong answer's feedback says which case failed and where the numbers differ; this module adds *why* when the
result is exactly what a well-known mistake produces on that case's inputs: the scale forgotten, the softmax
taken over the queries instead of the keys, the mask read the wrong way round, every value off by one constant
factor, the last two axes swapped. :func:`diagnose` recomputes each candidate mistake on the case's inputs (in
float64, from the inputs alone) and compares: a match is named in the hint line, in place of the exercise's
general hint, by the check cell and the grader alike.

* :data:`RETURNS` names the items of the tuple an exercise returns ("output", "weights"), so that feedback says
  "weights: 16 of 16 values differ" rather than "at [1]";
* :data:`ATTENTION` says which exercises compute attention and where their arguments are (queries, keys, values,
  a mask): those get the attention mistakes below. Keyed by exercise id: a new chapter adds its own lines.
* the generic mistakes (a constant factor, swapped axes, a sign) apply to every implement exercise whose answer is
  a floating-point tensor.

Find-the-bug exercises get no diagnosis: their most common wrong answer is the bug itself, and naming it would
find the bug for the learner.

A candidate is only used on a case where the *right* computation, done the same way here, reproduces the case's
expected value: a recogniser that misreads an exercise stays silent rather than misleads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from . import Case, Exercise

# The items of a returned tuple, by exercise id (predictions name theirs with `parts=`).
RETURNS: dict[str, tuple[str, ...]] = {
    "01-find-the-bug": ("context", "weights"),
    "03-sdpa-numpy": ("output", "weights"),
    "03-masked-attention": ("output", "the gradient of q", "the gradient of k", "the gradient of v"),
    "07-cache-update": ("keys", "values"),
    "08-merge-many": ("running max", "running sum"),
    "08-find-the-bug-1": ("max", "sum", "output"),
    "09-tile-backward": ("dq", "dk", "dv"),
    "10-online-update": ("output", "log-sum-exp"),
    "11-merge-ranks": ("output", "log-sum-exp"),
}


def returns(exercise_id: str) -> tuple[str, ...]:
    return RETURNS.get(exercise_id, ())


@dataclass(frozen=True)
class AttentionArgs:
    """Where an attention exercise's arguments are: q, k, v positions, a boolean `keep` mask (True: may attend)
    if any, whether keys/values are shared by groups of query heads (GQA), and whether it returns the weights."""

    q: int = 0
    k: int = 1
    v: int = 2
    keep: int | None = None
    grouped: bool = False
    with_weights: bool = False
    causal: bool = False  # causal from the end: query i of T sees the keys up to S - T + i


ATTENTION: dict[str, AttentionArgs] = {
    "03-sdpa-numpy": AttentionArgs(with_weights=True),
    "03-masked-attention": AttentionArgs(keep=3),
    "05-grouped-attention": AttentionArgs(grouped=True, causal=True),
    "12-sigmoid": AttentionArgs(),  # kwargs (is_causal) are passed: the attention recognisers stay silent there
}


def _attention(q, k, v, *, scale: float | None = None, dim: int = -1, keep=None, transpose: bool = False,
               grouped: bool = False, with_weights: bool = False, causal: bool = False):
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    if grouped and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if transpose:
        scores = scores.transpose(-2, -1)
    if causal:
        t, s_len = scores.shape[-2], scores.shape[-1]
        future = torch.ones(t, s_len, dtype=torch.bool).triu(s_len - t + 1)
        keep = ~future if keep is None else keep & ~future
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    weights = torch.softmax(scores, dim=dim)
    if keep is not None:
        weights = torch.nan_to_num(weights, nan=0.0)
    out = weights @ v
    return (out, weights) if with_weights else out


@dataclass(frozen=True)
class Mistake:
    name: str
    message: str
    make: Callable[[tuple, "AttentionArgs"], Any]  # the wrong answer's result on a case's arguments


def _call(spec: AttentionArgs, args: tuple, **change):
    keep = args[spec.keep] if spec.keep is not None and spec.keep < len(args) else None
    kw = dict(keep=keep, grouped=spec.grouped, with_weights=spec.with_weights, causal=spec.causal)
    kw.update(change)
    return _attention(args[spec.q], args[spec.k], args[spec.v], **kw)


ATTENTION_MISTAKES = (
    Mistake("no scale", "your result is what attention gives without dividing the scores by √d_k: the scores' spread "
            "then grows with the width, and the softmax is far too peaked",
            lambda a, s: _call(s, a, scale=1.0)),
    Mistake("scale d_k", "your scores look divided by d_k rather than by its square root √d_k",
            lambda a, s: _call(s, a, scale=1 / a[s.q].shape[-1])),
    Mistake("scale sqrt(d_v)", "your scores look divided by the square root of the values' width, not of the "
            "queries' and keys' width d_k", lambda a, s: _call(s, a, scale=1 / math.sqrt(a[s.v].shape[-1]))),
    Mistake("softmax over queries", "your weights sum to 1 along the queries (down each column), not along the "
            "keys: each query's row should be a distribution over the keys", lambda a, s: _call(s, a, dim=-2)),
    Mistake("transposed scores", "your scores are transposed: row i should hold query i against every key, and "
            "you have key i against every query", lambda a, s: _call(s, a, transpose=True)),
)
MASK_MISTAKES = (
    Mistake("mask polarity", "your mask is the wrong way round: True in `keep` means the query MAY attend to that "
            "key, and you blocked exactly those", lambda a, s: _call(s, a, keep=~a[s.keep])),
    Mistake("mask ignored", "your result ignores the mask: the blocked keys still get weight",
            lambda a, s: _call(s, a, keep=None)),
)


def _close(got: Any, want: Any) -> bool:
    if isinstance(want, (tuple, list)):
        return isinstance(got, (tuple, list)) and len(got) == len(want) and all(map(_close, got, want))
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)) or got.shape != want.shape:
        return False
    g, w = got.to(torch.float64), want.to(torch.float64)
    return bool(torch.allclose(g, w, rtol=1e-4, atol=1e-6, equal_nan=True))


def _attention_diagnosis(ex: Exercise, got: Any, case: Case) -> str | None:
    spec = ATTENTION.get(ex.id)
    if spec is None or case.kwargs:
        return None
    args = tuple(case.args)
    try:
        if not _close(_call(spec, args), case.expected):  # we misread this exercise or case: say nothing
            return None
    except Exception:
        return None
    candidates = ATTENTION_MISTAKES + (MASK_MISTAKES if spec.keep is not None else ())
    for mistake in candidates:
        try:
            wrong = mistake.make(args, spec)
        except Exception:
            continue
        if not _close(wrong, case.expected) and _close(got, wrong):
            return mistake.message
    return None


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def _generic_diagnosis(got: Any, expected: Any) -> str | None:
    """A constant factor, swapped last axes or a flipped sign, over every tensor returned."""
    gots, wants = _tensors(got), _tensors(expected)
    if not wants or len(gots) != len(wants) or not all(w.is_floating_point() for w in wants):
        return None
    for g, w in zip(gots, wants):
        if g.dim() >= 2 and g.shape != w.shape and g.shape == w.transpose(-2, -1).shape and \
                _close(g, w.transpose(-2, -1)):
            return "your result has its last two axes swapped (the right numbers, transposed)"
    ratios = []
    for g, w in zip(gots, wants):
        if g.shape != w.shape or not g.is_floating_point():
            return None
        g, w = g.to(torch.float64), w.to(torch.float64)
        big = w.abs() > 1e-6 * max(1.0, float(w.abs().max()) if w.numel() else 1.0)
        if not big.any():
            continue
        r = g[big] / w[big]
        if not torch.isfinite(r).all() or float(r.max() - r.min()) > 1e-4 * max(1.0, float(r.abs().max())):
            return None
        if not torch.allclose(g[~big], torch.zeros_like(g[~big]), atol=1e-6):
            return None
        ratios.append(float(r.mean()))
    if not ratios or max(ratios) - min(ratios) > 1e-4 * max(1.0, max(abs(x) for x in ratios)):
        return None
    c = ratios[0]
    if abs(c) < 1e-6:  # an all-zero answer is not "0 times the right one"
        return None
    if abs(c - 1) < 1e-4:
        return None
    if abs(c + 1) < 1e-4:
        return "every value you return has the right size and the wrong sign"
    return (f"every value you return is {c:.4g} times the right one: the computation is right up to one constant "
            "factor (a scale, a normalisation, a count)")


def diagnose(ex: Exercise, got: Any, case: Case) -> str | None:
    """The name of the mistake `got` shows on `case`, or None. Implement exercises only: a find-the-bug exercise's
    wrong answer is often the bug itself, and naming it would do the exercise for the learner."""
    if ex.category not in ("implement", None) or callable(case.compare):
        return None
    try:
        return _attention_diagnosis(ex, got, case) or _generic_diagnosis(got, case.expected)
    except Exception:  # a diagnosis must never break a check
        return None
