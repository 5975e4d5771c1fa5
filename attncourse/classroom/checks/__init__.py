"""Exercise checks: one definition per exercise drives both the learner's check cell and the grader.

An :class:`Exercise` names the object a learner must define (a function or a value), how many points
it is worth, a hint, and a function that builds :class:`Case` objects: inputs plus the *expected*
result, computed here by the reference implementations. Two runners use the same cases:

* :func:`check` runs in the learner's notebook and gives instant, specific feedback;
* :mod:`attncourse.classroom.grade` computes the expected values in its own process, sends only the inputs to
  the student's kernel, and compares what comes back, so nothing the notebook patches or prints can
  change the verdict.

The exercise standard (issue 15; ``tests/test_exercise_standard.py`` enforces it for every chapter)
    Every exercise has a `category` (:data:`CATEGORIES`) and every chapter has one of each.

    * ``implement``: ``forbid=(...)`` names the library functions and PyTorch kernels that would do the job,
      ``shortcuts=(...)`` holds right answers built on them (callables with the exercise's signature). The
      test requires each shortcut to pass with nothing forbidden and to be refused, as a forbidden call, by the
      check cell and by the grader. Both run the answer under :class:`~.forbidden.CallGuard`, which catches
      a forbidden function under every spelling (``torch.X``, ``x.X()``, ``F.X``, ``attncourse.X`` and its
      module) and alias; see :mod:`.forbidden`.
    * ``bug``: ``bug_words=(...)`` are the words that would name the bug; none may appear (at the start of a
      word, any case) in the exercise's title or in the chapter's lesson notebook.
    * ``predict``: ``parts=(...)`` names the parts of the answer (one per item of a tuple; dict keys name
      themselves). :func:`feedback` judges a guess whole: it says what is wrong with its form (not a tuple,
      a missing key), otherwise only that it is not right, never which part or the expected value (see
      :mod:`.predictions`); the test perturbs the expected value and searches every message for it and its parts.
    * ``experiment``: ``kind="function"``: a seeded function the check calls. Each case's ``expected`` is
      what the reference computes for the case's inputs (seed included), even when ``compare`` is a function
      (which may take ``(got)`` or ``(got, expected)``); the test hands each case's expected value back as a
      hand-typed answer and requires the check to refuse it.

    Hints point the way without the code (a heuristic test flags ``@``, calls, ``=``, formulas), no solution
    body may be a near copy of a lesson cell, and a lesson or solution cell that prints a verdict
    (``equal: True``) asserts it.
"""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from . import forbidden, gradients, limits, tries
from .notes import STUB_LINE, WIDTH, install_notes, quiet_note, wrap  # noqa: F401

__all__ = ["CATEGORIES", "Case", "Exercise", "CheckFailed", "ExerciseNotDone", "Run", "check", "exercise", "get",
           "exercises_for", "registry", "compare", "feedback", "to_portable", "render", "passed", "judge_property", "uses",
           "diagnose", "install_notes", "quiet_note"]

# What an exercise asks of the learner. Every chapter has at least one of each (tests/test_exercise_standard.py).
#   implement:  write a function the lesson did not show line by line; `forbid` names the library functions
#               and PyTorch kernels that would do the job, and `shortcuts` holds answers built on them,
#               each of which the check must refuse;
#   bug:        fix a given function; neither the title nor the lesson names the bug (`bug_words`);
#   predict:    commit to a value (shapes, bytes, FLOPs) before computing it; a wrong guess is told that it is
#               wrong (and what is wrong with its form), never which part or the expected value;
#   experiment: a seeded function whose result the check recomputes (never hand-typed numbers).
CATEGORIES = ("implement", "bug", "predict", "experiment")


class CheckFailed(Exception):
    """A learner's answer gave a wrong result; the message says which case, what and why. IPython shows
    :func:`render` (via ``_render_traceback_``) in place of a traceback."""

    def _render_traceback_(self) -> list[str]:
        return render(self)


class ExerciseNotDone(NotImplementedError):
    """The exercise's function or value is not defined yet (or is still the stub): two lines in a notebook."""

    def _render_traceback_(self) -> list[str]:
        return render(self)


def render(err: BaseException) -> list[str]:
    """What a learner sees for a failed check: the message, then the learner's own frames of its cause, each line
    wrapped between words."""
    lines = str(err).split("\n")
    cause = err.__cause__
    if cause is not None and cause.__traceback__ is not None:
        frames = [f for f in traceback.extract_tb(cause.__traceback__)  # notebook cells only
                  if "ipykernel_" in f.filename or f.filename.startswith(("<ipython-input", "<cell"))]
        at = next((i for i, line in enumerate(lines) if line.startswith("  hint:")), len(lines))
        lines[at:at] = [f"  your code{'' if f.name == '<module>' else f' in {f.name}'}, line {f.lineno} of its "
                        f"cell: {(f.line or '').strip()}" for f in frames[-3:]]
    return [part for line in lines for part in wrap(line)]


@dataclass
class Case:
    """One input and its expected result.

    `compare` is "close" (``torch.testing.assert_close`` semantics with `rtol`/`atol`), "equal"
    (exact, for shapes, ints, booleans), or a function ``(got) -> str | None`` or
    ``(got, expected) -> str | None`` that returns an error message, for answers a tolerance alone cannot
    judge. An experiment's case still sets `expected` to what the reference computes for the case's
    inputs (seed included): the standard's test hands that value back as a hand-typed answer and requires
    the check to refuse it.
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
    category: str | None = None  # one of CATEGORIES
    shortcuts: tuple[Callable, ...] = ()  # answers that call the library instead of doing the work: all refused
    parts: tuple[str, ...] = ()  # predict: a name for each part of the answer, used in place of its value
    bug_words: tuple[str, ...] = ()  # bug: words naming the bug, kept out of the title and the lesson
    allow: tuple[str, ...] = ()  # course library code the answer may enter (functions, classes, modules)
    ops: tuple[str, ...] | None = None  # PyTorch operator families the answer may not run (None: from `forbid`)
    prop: Callable[[list], str | None] | None = None  # the property taught, judged from the runs (see `Run`)
    prop_doc: str = ""  # that property in one line, or why output equality is the property
    stream: tuple | None = None  # (arg index, dim, chunk size or "argN"): that argument arrives as a one-shot stream
    trace: bool | None = None  # record the operators the answer runs (default: when `prop` is declared)
    aliases: tuple[str, ...] = ()  # earlier ids of this exercise, still accepted by the grader
    breakers: tuple[Callable, ...] = ()  # right outputs computed the wrong way: `prop` must refuse each
    gradient: bool = True  # implement: add a case comparing gradients with the shortcuts' (see .gradients)

    @property
    def reveals(self) -> bool:
        """Whether feedback may show an expected value: only the numbers inside a tensor an implement or bug
        exercise returns (a prediction, an experiment, a scalar or a choice never shows it)."""
        return self.category in (None, "implement", "bug")

    @property
    def forbidden_ops(self) -> tuple[str, ...]:
        """The operator families this exercise refuses: declared, else read off `forbid`; plus NumPy wherever the
        answer is judged by what it runs in PyTorch (implement and bug exercises on tensors) or is a rule in plain
        Python (a prediction written as a function): NumPy would run the same arithmetic where no trace sees it."""
        families = tuple(self.ops) if self.ops is not None else implied_ops(self.forbid, self.numpy)
        judged_by_trace = self.category in ("implement", "bug") and not self.numpy
        rule = self.category == "predict" and self.kind == "function"
        if (judged_by_trace or rule) and "numpy" not in families:
            families += ("numpy",)
        return families

    @property
    def policy(self) -> dict:
        """What the guard enforces while the answer runs (plain data: the grader sends it to the kernel)."""
        return forbidden.policy(forbid=self.forbid, allow=self.allow, ops=self.forbidden_ops, library=True,
                                trace=self.prop is not None if self.trace is None else self.trace,
                                stream=self.stream, source=needs_source(self.prop))

    @property
    def chapter(self) -> str:
        return self.id.split("-", 1)[0]


_REGISTRY: dict[str, Exercise] = {}
_ALIASES: dict[str, str] = {}  # an exercise's earlier id -> its id
_PASSED: set[str] = set()  # the exercises whose check passed in this process (see `passed`)


def passed(exercise_id: str) -> bool:
    """Whether `exercise_id`'s check has passed in this kernel: a prediction's verify cell computes and shows
    the answer only then (``if passed("05-predict-kv-cache"): ...``)."""
    return _ALIASES.get(exercise_id, exercise_id) in _PASSED


class uses:
    """``with checks.uses("03-implement-sdpa"):`` around a cell that runs a learner's answer (a demo, a plot of
    their function): while that answer is not written yet (its stub raises ``NotImplementedError``, or its name
    is not defined), the cell prints one note and stops quietly instead of showing a traceback, so Run All on an
    untouched exercise notebook stays calm. Every other error is shown as usual."""

    def __init__(self, *exercise_ids: str):
        if not exercise_ids:
            raise TypeError("uses() needs at least one exercise id, e.g. uses('03-implement-sdpa')")
        self.exercises = [get(i) for i in exercise_ids]

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        targets = {ex.target for ex in self.exercises}
        if err is None:
            return False
        waiting = isinstance(err, NotImplementedError) or (isinstance(err, NameError)
                                                           and getattr(err, "name", None) in targets)
        if not waiting:
            return False
        names = ", ".join(f"`{ex.target}` ({ex.id})" for ex in self.exercises)
        print("\n".join(wrap(f"note: this cell runs your answer {names}; it will show its result once that answer "
                             "is written.")))
        return True


def exercise(id: str, target: str, *, points: float = 1.0, hint: str = "", kind: str = "function",
             numpy: bool = False, forbid: tuple[str, ...] = (), title: str = "", category: str | None = None,
             shortcuts: tuple[Callable, ...] = (), parts: tuple[str, ...] = (), bug_words: tuple[str, ...] = (),
             allow: tuple[str, ...] = (), ops: tuple[str, ...] | None = None,
             prop: Callable[[list], str | None] | None = None, prop_doc: str = "", stream: tuple | None = None,
             trace: bool | None = None, aliases: tuple[str, ...] = (), breakers: tuple[Callable, ...] = (),
             gradient: bool = True):
    """Decorator registering a case-building function as the exercise `id` (see :data:`CATEGORIES`)."""
    if kind not in ("function", "value"):
        raise ValueError(f"kind must be 'function' or 'value', got {kind!r}")
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"category must be one of {CATEGORIES}, got {category!r}")
    unknown = [f for f in (ops or ()) if f not in forbidden.FAMILIES and not f.startswith("aten::")]
    if unknown:
        raise ValueError(f"ops must be families {sorted(forbidden.FAMILIES)} or 'aten::name', got {unknown}")

    def register(make_cases: Callable[[], list[Case]]) -> Callable[[], list[Case]]:
        for name in (id, *aliases):
            if name in _REGISTRY or name in _ALIASES:
                raise ValueError(f"exercise id {name!r} is registered twice")
        cases = gradients.with_gradient_case(make_cases, lambda: _REGISTRY[id])

        _REGISTRY[id] = Exercise(id, target, cases, float(points), hint, kind, numpy, tuple(forbid),
                                 title or make_cases.__doc__ or "", category, tuple(shortcuts), tuple(parts),
                                 tuple(bug_words), tuple(allow), None if ops is None else tuple(ops), prop,
                                 prop_doc, None if stream is None else tuple(stream), trace, tuple(aliases),
                                 tuple(breakers), bool(gradient))
        for old in aliases:
            _ALIASES[old] = id
        return make_cases

    return register


def implied_ops(forbid: tuple[str, ...], numpy: bool = False) -> tuple[str, ...]:
    """The operator families a list of forbidden names stands for (an exercise that forbids ``torch.softmax``
    refuses the softmax family under every spelling; a NumPy exercise refuses every PyTorch operator)."""
    families = []
    if numpy:
        families.append("torch")
    for name in forbid:
        if not name.startswith("torch."):  # the course's own functions: the library rule refuses them
            continue
        last = name.rsplit(".", 1)[-1].lower()
        fam = "attention" if last in ("multiheadattention", "transformerencoderlayer", "transformer") else \
            forbidden.family_of(last, ("attention", "softmax", "logsumexp"))
        if fam and fam not in families:
            families.append(fam)
    return tuple(families)


def _load_all() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("ch"):
            importlib.import_module(f"{__name__}.{info.name}")


def registry() -> dict[str, Exercise]:
    """Every exercise of every chapter, by id."""
    _load_all()
    return dict(_REGISTRY)


def get(exercise_id: str) -> Exercise:
    """The exercise `exercise_id` (an earlier id of it too: old submissions keep grading)."""
    reg = registry()
    exercise_id = _ALIASES.get(exercise_id, exercise_id)
    if exercise_id not in reg:
        raise KeyError(f"no exercise {exercise_id!r}; known: {', '.join(sorted(reg))}")
    return reg[exercise_id]


def exercises_for(chapter: str) -> list[Exercise]:
    """The exercises of chapter "03" (say), in registration order."""
    return [ex for ex in registry().values() if ex.chapter == chapter]


# ----------------------------------------------------------------------------- comparison and feedback

from .mistakes import diagnose  # noqa: E402
from .edits import needs_source  # noqa: E402
from .comparing import (_brief, _compare, _cut, _describe, _describe_kind, _few_valued, _fmt, _off_by,  # noqa: E402
                        _wrong_parts, compare, feedback, to_portable)


def to_numpy_args(args: tuple) -> tuple:
    return tuple(a.numpy() if isinstance(a, torch.Tensor) else a for a in args)


@dataclass
class Run:
    """One case as the answer ran it: what it returned and, when the exercise traces, what it ran
    (:func:`forbidden.run`'s trace: ``ops``, a list of ``(operator, in_triton_launch, in_allowed_helper,
    tensors)`` with each tensor ``(input label or None, offset from the input's start, shape, stride)``;
    ``counts`` per operator; ``launches`` of Triton kernels; ``chunks`` taken from a stream)."""

    case: Case
    got: Any
    trace: dict | None


def evaluate(ex: Exercise, answer: Any, case: Case, namespace: dict | None = None) -> Any:
    """Run the learner's `answer` on one case (in the current process) and return a portable result."""
    return evaluate_run(ex, answer, case, namespace).got


def evaluate_run(ex: Exercise, answer: Any, case: Case, namespace: dict | None = None) -> Run:
    """Run the learner's `answer` on one case under the exercise's guard: a :class:`Run`, or raise
    :class:`CheckFailed` for a forbidden call, or the answer's own exception."""
    if ex.kind == "value":
        return Run(case, to_portable(answer), None)
    args = to_numpy_args(case.args) if ex.numpy else case.args
    ran = forbidden.run(answer, args, case.kwargs, ex.policy, namespace)
    if ran["used"]:
        raise CheckFailed(forbidden.message(ran["used"][0])) from None
    if ran["error"] is not None:
        raise ran["error"]
    return Run(case, to_portable(ran["result"]), to_portable(ran["trace"]))


def judge_property(ex: Exercise, runs: list[Run]) -> str | None:
    """The exercise's property over the runs of its cases (None when it holds or none is declared)."""
    runs = [r for r in runs if not gradients.is_added(r.case)]  # a property judges the declared cases
    if ex.prop is None or not runs:
        return None
    return ex.prop(runs)


def case_label(case: Case) -> str:
    """A case's name as feedback quotes it (in “…”, so that a name holding ' or " reads right)."""
    return f"“{case.name}”"


def _failure(ex: Exercise, case: Case, detail: str, mistake: str | None = None) -> CheckFailed:
    """A failed case: what differs, then a hint: the mistake recognised in the answer (see :mod:`.mistakes`),
    else the exercise's general hint."""
    lines = [f"✗ {ex.id}: case {case_label(case)} failed", f"  {_cut(detail, 400)}"]
    if mistake:
        lines.append(f"  hint: {mistake}")
    elif ex.hint:
        lines.append(f"  hint: {ex.hint}")
    return CheckFailed("\n".join(lines))


_MISSING = object()


def not_attempted(ex: Exercise, why: str) -> ExerciseNotDone:
    """The two lines a learner sees for an exercise not attempted yet."""
    return ExerciseNotDone(f"exercise {ex.id}: not attempted yet; write your answer in the cell above\n  ({why})")


def check(exercise_id: str, answer: Any = _MISSING) -> None:
    """Check the learner's answer to `exercise_id` (by default the target name in the calling notebook's
    namespace): print a pass line, or raise :class:`ExerciseNotDone` / :class:`CheckFailed` (shown without a
    traceback, see :func:`render`; exercise notebooks tag the cell ``raises-exception`` so Run All goes on)."""
    ex = get(exercise_id)
    if answer is _MISSING:
        caller = inspect.currentframe().f_back.f_globals  # the notebook's namespace
        if ex.target not in caller:
            raise not_attempted(ex, f"`{ex.target}` is not defined yet: write it, run that cell, then this one")
        answer = caller[ex.target]
    if ex.kind == "function" and not callable(answer):
        raise CheckFailed(f"✗ {ex.id}: `{ex.target}` should be a function, got {_describe(answer)}")
    spent = tries.exhausted(ex.id, ex.category)
    if spent:  # a prediction's or a fix's tries are used up: judging more answers would make it a search (.tries)
        raise CheckFailed(spent)
    cases = ex.make_cases()
    runs = []
    for case in cases:
        try:
            with limits.time_limit(ex.id):
                run = evaluate_run(ex, answer, case, inspect.currentframe().f_back.f_globals)
            got = run.got
            runs.append(run)
        except ExerciseNotDone:
            raise
        except NotImplementedError:
            raise not_attempted(ex, f"`{ex.target}` still raises NotImplementedError: replace that line "
                                "with your code") from None
        except (CheckFailed, limits.TooSlow) as err:  # a forbidden call, or a case past its time limit
            raise _failure(ex, case, str(err)) from None
        except Exception as err:  # the learner's code raised: say which case, keep the cause
            raise _failure(ex, case, f"your code raised {type(err).__name__}: {err}") from err
        detail = feedback(ex, got, case)
        if detail:
            failure = _failure(ex, case, detail, diagnose(ex, got, case))
            if ex.category in ("predict", "bug") and not tries.is_form_error(detail):
                note = tries.record(ex.id, tries.fingerprint(case.name, got), ex.category)
                failure = CheckFailed(f"{failure}\n  {note}".rstrip())
            raise failure from None
    detail = judge_property(ex, runs)
    if detail:
        raise CheckFailed("\n".join([f"✗ {ex.id}: every case gives the right result, but not the way this exercise "
                                     f"asks", f"  {_cut(detail, 400)}"] + ([f"  hint: {ex.hint}"] if ex.hint else [])))
    _PASSED.add(ex.id)
    print(f"✓ {ex.id}: all {gradients.declared(cases)} case(s) passed")


install_notes()
