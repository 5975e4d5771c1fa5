"""How an answer is compared with the expected value, and what the learner is told (part of
:mod:`attncourse.classroom.checks`, which re-exports every name here)."""

from __future__ import annotations

import inspect
import math
import re
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

if TYPE_CHECKING:
    from . import Case, Exercise


def to_portable(x: Any) -> Any:
    """Turn a learner's result into tensors, tuples, dicts and plain scalars (what the grader can load
    safely with ``torch.load(weights_only=True)``); anything else becomes a description string."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, torch.Size):
        return tuple(int(d) for d in x)
    if isinstance(x, (tuple, list)):
        return type(x)(to_portable(v) for v in x) if type(x) in (tuple, list) else tuple(map(to_portable, x))
    if isinstance(x, dict):
        return {str(k): to_portable(v) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return f"<unsupported object of type {type(x).__name__}>"


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__} {_brief(x)}"


def _brief(x: Any, limit: int = 160) -> str:
    """A short repr of `x`, cut between items (with "…"), never in the middle of a number."""
    if isinstance(x, torch.Tensor):
        return f"tensor({x.tolist()})" if x.numel() <= 6 else f"tensor of shape {tuple(x.shape)}"
    if isinstance(x, (tuple, list, dict)):
        items = [f"{_brief(k, limit)}: {_brief(v, limit)}" for k, v in x.items()] if isinstance(x, dict) else \
            [_brief(v, limit) for v in x]
        kept, used = [], 0
        for item in items:
            if used + len(item) > limit:
                kept.append("…")
                break
            kept.append(item)
            used += len(item) + 2
        ends = "{}" if isinstance(x, dict) else "()" if isinstance(x, tuple) else "[]"
        comma = "," if isinstance(x, tuple) and len(x) == 1 else ""
        return f"{ends[0]}{', '.join(kept)}{comma}{ends[1]}"
    return _cut(repr(x), limit)


def _cut(text: str, limit: int) -> str:
    """`text`, or its start cut at a space or comma with " …" when longer than `limit`."""
    if len(text) <= limit:
        return text
    cut = max(text.rfind(sep, 0, limit) for sep in " ,")
    return text[: cut if cut > limit // 2 else limit] + " …"


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def _fmt_pair(e: float, g: float) -> tuple[str, str]:
    """Expected and got with as many digits as it takes to see them differ (6, else up to 17)."""
    for digits in (6, 9, 12, 17):
        shown = f"{e:.{digits}g}", f"{g:.{digits}g}"
        if shown[0] != shown[1]:
            return shown
    return shown


def compare(got: Any, expected: Any, case: Case, reveal: bool = True, names: tuple[str, ...] = ()) -> str | None:
    """None when `got` matches `expected` under the case's rule, else a specific message. With ``reveal=False``
    the message never shows an expected value: it says what is wrong (a shape, a type, how far off), not what
    is right. `names` names the items of a returned tuple ("output", "weights"): a difference inside one starts
    with its name (else "item 1 of what you returned"); both tuples are shown only when their shapes differ."""
    msg = _compare(got, expected, case, reveal)
    if msg and msg.startswith("["):  # a difference inside nested tuples: say where
        path = [int(i) for i in re.findall(r"\[(\d+)\]", msg.split(":", 1)[0])]
        rest = msg.split(":", 1)[1].strip() if ":" in msg else msg
        where = _part_name(path, names)
        msg = f"{where}: {rest}"
        shown_e, shown_g = _brief(expected), _brief(got)
        if reveal and shown_e != shown_g:  # the layout differs (a shape, a type): show both
            msg += f"; expected {shown_e}, got {shown_g}"
    return msg


def _part_name(path: list[int], names: tuple[str, ...]) -> str:
    """"output" for path [0] with names ("output", "weights"); "item 1 of item 0 of what you returned" else."""
    if len(path) == 1 and path[0] < len(names):
        return names[path[0]]
    if path and path[0] < len(names):
        return " of ".join([f"item {i}" for i in reversed(path[1:])] + [names[path[0]]])
    return " of ".join([f"item {i}" for i in reversed(path)]) + " of what you returned"


def _call_compare(rule: Callable, got: Any, expected: Any) -> str | None:
    """A case's own rule: ``rule(got)``, or ``rule(got, expected)`` when it takes two arguments."""
    try:
        params = [p for p in inspect.signature(rule).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        params = [None]
    return rule(got, expected) if len(params) >= 2 else rule(got)


def _off_by(got: float, expected: float) -> str:
    """How far `got` is from `expected`, without saying which way or showing `expected`."""
    if not math.isfinite(got):
        return f"your value is {got}"
    if expected == 0:
        return f"off by {abs(got):.2g} (absolute)"
    rel = abs(got - expected) / abs(expected)
    return f"off by about {rel:.0%} (relative)" if rel >= 0.01 else f"off by about {rel:.1g} (relative)"


def _compare(got: Any, expected: Any, case: Case, reveal: bool = True) -> str | None:
    if callable(case.compare):
        return _call_compare(case.compare, got, expected)
    if isinstance(expected, (tuple, list)) and not isinstance(got, str):
        if not isinstance(got, (tuple, list)):
            return f"expected a {type(expected).__name__} of {len(expected)} items, got {_describe(got)}"
        if len(got) != len(expected):
            return f"expected {len(expected)} items, got {len(got)}" + \
                (f": expected {_brief(expected)}, got {_brief(got)}" if reveal else "")
        for i, (g, e) in enumerate(zip(got, expected)):
            msg = _compare(g, e, case, reveal)
            if msg:
                return f"[{i}]{msg}" if msg.startswith("[") else f"[{i}]: {msg}"
        return None
    if isinstance(expected, torch.Tensor):
        if isinstance(got, (int, float)) and expected.numel() == 1:
            got = torch.tensor(got, dtype=expected.dtype)
        if not isinstance(got, torch.Tensor):
            return f"expected a {_describe(expected)}, got {_describe(got)}"
        if tuple(got.shape) != tuple(expected.shape):
            return f"wrong shape: expected {tuple(expected.shape)}, got {tuple(got.shape)}"
        if got.device != expected.device:  # a GPU answer (chapter 10 on a GPU) against the check's CPU reference
            got = got.detach().to(expected.device)
        if case.compare == "equal" or not expected.is_floating_point():
            bad = got != expected
            tol = "exact match"
        else:
            g, e = got.to(torch.float64), expected.to(torch.float64)
            if not torch.isfinite(g).all() and torch.isfinite(e).all():
                n = (~torch.isfinite(g)).sum().item()
                first = tuple(int(i) for i in (~torch.isfinite(g)).nonzero()[0])
                return f"{n} value(s) are NaN or inf, the first at index {first}" + \
                    (f" (expected {_fmt(e[first].item())})" if reveal else "")
            bad = ~torch.isclose(g, e, rtol=case.rtol, atol=case.atol, equal_nan=True)
            tol = f"rtol={case.rtol:g}, atol={case.atol:g}"
        if bad.any():
            first = tuple(int(i) for i in bad.nonzero()[0])
            if reveal and expected.numel() > 1:
                shown_e, shown_g = _fmt_pair(expected[first].item(), got[first].item())
                return (f"{int(bad.sum())} of {bad.numel()} values differ ({tol}); first at index {first}: "
                        f"expected {shown_e}, got {shown_g}")
            where = f"; first at index {first}" if expected.numel() > 1 else ""
            off = _off_by(float(got[first]), float(expected[first])) if expected.is_floating_point() else "wrong"
            return f"{int(bad.sum())} of {bad.numel()} values differ ({tol}){where}: {off}"
        return None
    if isinstance(expected, float) and case.compare == "close":
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            return f"expected a number, got {_describe(got)}"
        if abs(got - expected) > case.atol + case.rtol * abs(expected):
            return f"{_off_by(float(got), expected)} (rtol={case.rtol:g}, atol={case.atol:g})"
        return None
    if type(got) is not type(expected) and not (isinstance(expected, int) and isinstance(got, int)):
        return f"expected a {type(expected).__name__}, got {_describe(got) if reveal else type(got).__name__}"
    if got != expected:
        if isinstance(expected, int) and not isinstance(expected, bool):
            return f"your {_brief(got)} is {_off_by(float(got), float(expected))}"
        return f"your {_brief(got)} is not right"
    return None


def feedback(ex: Exercise, got: Any, case: Case) -> str | None:
    """What the learner is told about `got` on `case`: None when right, else what is wrong. It shows an
    expected value only for the numbers of a tensor an implement or bug exercise returns; a prediction is told
    which parts are wrong (or, for yes/no and choice parts, how many), an experiment how far off it is."""
    from .mistakes import returns

    detail = compare(got, case.expected, case, reveal=ex.reveals, names=ex.parts or returns(ex.id))
    if detail is not None and ex.numpy:  # the learner works with NumPy arrays: call them so
        detail = re.sub(r"\btensor\b", "array", detail).replace("a array", "an array")
    if detail is None or ex.category != "predict" or callable(case.compare):
        return detail
    return _wrong_parts(ex, got, case)


def _few_valued(x: Any) -> bool:
    """A part with few possible values (yes/no, a choice among a few words, None): naming it would tell it."""
    return x is None or isinstance(x, (bool, str)) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool)


def _wrong_parts(ex: Exercise, got: Any, case: Case) -> str:
    expected = case.expected
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            return f"expected a {type(expected).__name__} of {len(expected)} items, got {_describe_kind(got)}"
    elif isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"expected a dict with keys {sorted(expected)}, got {_describe_kind(got)}"
        missing = sorted(set(expected) - set(map(str, got)))
        if missing:
            return f"your dict has no entry for {', '.join(map(repr, missing))}"
    else:
        return f"that prediction is not right (a {_describe_kind(got)}); think it through again"
    from .predictions import NOT_RIGHT  # judged whole: naming the wrong parts lets a learner search part by part

    return NOT_RIGHT


def _describe_kind(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)}"
    if isinstance(x, (tuple, list, dict)):
        return f"{type(x).__name__} of {len(x)} items"
    return type(x).__name__


