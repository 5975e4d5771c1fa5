"""Exercise checks: one definition per exercise drives both the learner's check cell and the grader.

An :class:`Exercise` names the object a learner must define (a function or a value), how many points
it is worth, a hint, and a function that builds :class:`Case` objects: inputs plus the *expected*
result, computed here by the reference implementations. Two runners use the same cases:

* :func:`check` runs in the learner's notebook and gives instant, specific feedback;
* :mod:`attncourse.grade` computes the expected values in its own process, sends only the inputs to
  the student's kernel, and compares what comes back, so nothing the notebook patches or prints can
  change the verdict.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["Case", "Exercise", "CheckFailed", "ExerciseNotDone", "check", "exercise", "get",
           "exercises_for", "registry", "compare", "to_portable"]


class CheckFailed(Exception):
    """A learner's answer gave a wrong result; the message says which case, what and why."""


class ExerciseNotDone(NotImplementedError):
    """The exercise's function or value is not defined yet (or is still the stub)."""


@dataclass
class Case:
    """One input and its expected result.

    `compare` is "close" (``torch.testing.assert_close`` semantics with `rtol`/`atol`), "equal"
    (exact, for shapes, ints, booleans), or a function ``(got) -> str | None`` that returns an error
    message, for experiments whose answer is a range rather than a number.
    """

    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    expected: Any = None
    compare: str | Callable[[Any], str | None] = "close"
    rtol: float = 1e-5
    atol: float = 1e-6


@dataclass
class Exercise:
    """An exercise's grading contract (see the module docstring)."""

    id: str
    target: str
    make_cases: Callable[[], list[Case]]
    points: float = 1.0
    hint: str = ""
    kind: str = "function"  # "function": the target is called on each case; "value": it is compared
    numpy: bool = False  # hand the function NumPy arrays instead of tensors
    forbid: tuple[str, ...] = ()  # dotted names that must not be called (replaced while it runs)
    title: str = ""

    @property
    def chapter(self) -> str:
        return self.id.split("-", 1)[0]


_REGISTRY: dict[str, Exercise] = {}


def exercise(id: str, target: str, *, points: float = 1.0, hint: str = "", kind: str = "function",
             numpy: bool = False, forbid: tuple[str, ...] = (), title: str = ""):
    """Decorator registering a case-building function as the exercise `id`."""
    if kind not in ("function", "value"):
        raise ValueError(f"kind must be 'function' or 'value', got {kind!r}")

    def register(make_cases: Callable[[], list[Case]]) -> Callable[[], list[Case]]:
        if id in _REGISTRY:
            raise ValueError(f"exercise id {id!r} is registered twice")
        _REGISTRY[id] = Exercise(id, target, make_cases, float(points), hint, kind, numpy, tuple(forbid),
                                 title or make_cases.__doc__ or "")
        return make_cases

    return register


def _load_all() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("ch"):
            importlib.import_module(f"{__name__}.{info.name}")


def registry() -> dict[str, Exercise]:
    """Every exercise of every chapter, by id."""
    _load_all()
    return dict(_REGISTRY)


def get(exercise_id: str) -> Exercise:
    reg = registry()
    if exercise_id not in reg:
        raise KeyError(f"no exercise {exercise_id!r}; known: {', '.join(sorted(reg))}")
    return reg[exercise_id]


def exercises_for(chapter: str) -> list[Exercise]:
    """The exercises of chapter "03" (say), in registration order."""
    return [ex for ex in registry().values() if ex.chapter == chapter]


# ----------------------------------------------------------------------------- comparison


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
    return f"{type(x).__name__} {x!r}"[:200]


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def compare(got: Any, expected: Any, case: Case) -> str | None:
    """None when `got` matches `expected` under the case's rule, else a specific message."""
    msg = _compare(got, expected, case)
    if msg and msg.startswith("["):  # a difference inside nested tuples: say where, and show both
        msg = f"at {msg}; expected {expected!r}, got {got!r}"[:600]
    return msg


def _compare(got: Any, expected: Any, case: Case) -> str | None:
    if callable(case.compare):
        return case.compare(got)
    if isinstance(expected, (tuple, list)) and not isinstance(got, str):
        if not isinstance(got, (tuple, list)):
            return f"expected a {type(expected).__name__} of {len(expected)} items, got {_describe(got)}"
        if len(got) != len(expected):
            return f"expected {len(expected)} items, got {len(got)}: expected {expected!r}, got {got!r}"
        for i, (g, e) in enumerate(zip(got, expected)):
            msg = _compare(g, e, case)
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
        if case.compare == "equal" or not expected.is_floating_point():
            bad = got != expected
            tol = "exact match"
        else:
            g, e = got.to(torch.float64), expected.to(torch.float64)
            if not torch.isfinite(g).all() and torch.isfinite(e).all():
                n = (~torch.isfinite(g)).sum().item()
                first = tuple(int(i) for i in (~torch.isfinite(g)).nonzero()[0])
                return f"{n} value(s) are NaN or inf, the first at index {first} (expected {_fmt(e[first].item())})"
            bad = ~torch.isclose(g, e, rtol=case.rtol, atol=case.atol, equal_nan=True)
            tol = f"rtol={case.rtol:g}, atol={case.atol:g}"
        if bad.any():
            first = tuple(int(i) for i in bad.nonzero()[0])
            return (f"{int(bad.sum())} of {bad.numel()} values differ ({tol}); first at index {first}: "
                    f"expected {_fmt(expected[first].item())}, got {_fmt(got[first].item())}")
        return None
    if isinstance(expected, float) and case.compare == "close":
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            return f"expected a number close to {_fmt(expected)}, got {_describe(got)}"
        if abs(got - expected) > case.atol + case.rtol * abs(expected):
            return f"expected {_fmt(expected)}, got {_fmt(got)} (rtol={case.rtol:g}, atol={case.atol:g})"
        return None
    if type(got) is not type(expected) and not (isinstance(expected, int) and isinstance(got, int)):
        return f"expected {expected!r} ({type(expected).__name__}), got {_describe(got)}"
    if got != expected:
        return f"expected {expected!r}, got {got!r}"
    return None


def to_numpy_args(args: tuple) -> tuple:
    return tuple(a.numpy() if isinstance(a, torch.Tensor) else a for a in args)


class _Forbidden:
    """Replaces a function the learner must not call while their answer runs."""

    def __init__(self, dotted: str):
        self.dotted = dotted

    def __call__(self, *args, **kwargs):
        raise CheckFailed(f"your code called {self.dotted}, which this exercise asks you not to use")


def _patch_forbidden(names: tuple[str, ...]) -> list[tuple[Any, str, Any]]:
    saved = []
    for dotted in names:
        module_name, attr = dotted.rsplit(".", 1)
        owner = importlib.import_module(module_name)
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, _Forbidden(dotted))
    return saved


def _restore(saved: list[tuple[Any, str, Any]]) -> None:
    for owner, attr, original in reversed(saved):
        setattr(owner, attr, original)


class _CallGuard:
    """Catches a forbidden function however it is reached, including through an alias bound before the
    check ran (``from torch.nn.functional import scaled_dot_product_attention as sdpa``), which replacing
    the module attribute alone cannot see: PyTorch's built-in ops through a TorchFunctionMode, Python
    functions through a call hook on their code objects."""

    def __init__(self, saved: list[tuple[Any, str, Any]]):
        # Only the library's own functions: a learner who assigned their own function to a forbidden name
        # (attncourse.scaled_dot_product_attention = mine) is still running their own code.
        originals = {f"{owner.__name__}.{attr}": fn for owner, attr, fn in saved
                     if (getattr(fn, "__module__", None) or "").split(".")[0] == owner.__name__.split(".")[0]}
        self.codes = {code: name for code, name in
                      ((getattr(fn, "__code__", None), name) for name, fn in originals.items()) if code is not None}
        self.builtins = {fn: name for name, fn in originals.items() if not hasattr(fn, "__code__")}
        self.mode = None
        self.previous_trace = None

    def _trace(self, frame, event, arg):
        if event == "call" and frame.f_code in self.codes:
            raise CheckFailed(f"your code called {self.codes[frame.f_code]}, which this exercise asks you not to use")
        return None

    def __enter__(self) -> "_CallGuard":
        import sys

        from torch.overrides import TorchFunctionMode

        builtins = self.builtins

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in builtins:
                    raise CheckFailed(f"your code called {builtins[func]}, which this exercise asks you not to use")
                return func(*args, **(kwargs or {}))

        if builtins:
            self.mode = Mode()
            self.mode.__enter__()
        self.previous_trace = sys.gettrace()
        if self.codes and self.previous_trace is None:  # never displace a debugger's tracer
            sys.settrace(self._trace)
        return self

    def __exit__(self, *exc) -> None:
        import sys

        if self.codes and self.previous_trace is None:
            sys.settrace(None)
        if self.mode is not None:
            self.mode.__exit__(None, None, None)


def evaluate(ex: Exercise, answer: Any, case: Case) -> Any:
    """Run the learner's `answer` on one case (in the current process) and return a portable result."""
    if ex.kind == "value":
        return to_portable(answer)
    args = to_numpy_args(case.args) if ex.numpy else case.args
    saved = _patch_forbidden(ex.forbid)
    try:
        with _CallGuard(saved):
            result = answer(*args, **case.kwargs)
        return to_portable(result)
    finally:
        _restore(saved)


def _failure(ex: Exercise, case: Case, detail: str) -> CheckFailed:
    lines = [f"✗ {ex.id}: case '{case.name}' failed", f"  {detail}"]
    if ex.hint:
        lines.append(f"  hint: {ex.hint}")
    return CheckFailed("\n".join(lines))


_MISSING = object()


def check(exercise_id: str, answer: Any = _MISSING) -> None:
    """Check the learner's answer to `exercise_id` and print a pass line, or raise with the reason.

    Without `answer`, the exercise's target name is looked up in the calling notebook's namespace.
    """
    ex = get(exercise_id)
    if answer is _MISSING:
        caller = inspect.currentframe().f_back.f_globals  # the notebook's namespace
        if ex.target not in caller:
            raise ExerciseNotDone(f"{ex.id}: `{ex.target}` is not defined yet: run (or finish) "
                                  "the exercise cell above, then this one")
        answer = caller[ex.target]
    if ex.kind == "function" and not callable(answer):
        raise CheckFailed(f"✗ {ex.id}: `{ex.target}` should be a function, got {_describe(answer)}")
    cases = ex.make_cases()
    for case in cases:
        try:
            got = evaluate(ex, answer, case)
        except (NotImplementedError, CheckFailed):
            raise
        except Exception as err:  # the learner's code raised: say which case, keep the cause
            raise _failure(ex, case, f"your code raised {type(err).__name__}: {err}") from err
        detail = compare(got, case.expected, case)
        if detail:
            raise _failure(ex, case, detail) from None
    print(f"✓ {ex.id}: all {len(cases)} case(s) passed")
