"""Find-the-bug exercises graded as a diagnosis: the answer must be the given function with a small edit.

Output equality alone does not show that a bug was found: an attention written from the formula, or pasted from
the lesson, returns the same numbers without a glance at the given code. A :class:`SmallEdit` holds the given
(buggy) function as the exercise notebook shows it and says how far a fix may move from it:

* at most ``most`` changed tokens, counted by :func:`distance` on Python tokens (comments, docstrings, line
  breaks, indentation and the function's own name are not counted; a replaced run counts its longer side);
* only on the lines ``lines`` of the given function (1 is its ``def`` line), where a fix of its mistake can go
  (empty: anywhere);
* no identifier the given function does not use, except those in ``names`` (a fix that needs a new method name):
  a small edit cannot hand the work to a function written elsewhere in the notebook.

:func:`prop` turns a spec into an exercise's ``prop``: the check cell and the grader both run the answer under
the guard, whose :func:`~.forbidden.run` then adds the answer's source to the trace (``policy(source=True)``:
read with ``inspect.getsource`` in the kernel, and kept only if compiling it gives the answer's own bytecode), so
the two judge the same text. The spec lives in the checks module; the notebook shows the given function and says
how many tokens a fix may change, never where.
"""

from __future__ import annotations

import ast
import difflib
import io
import keyword
import textwrap
import tokenize
from dataclasses import dataclass
from typing import Callable

_LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
           tokenize.ENDMARKER}


@dataclass(frozen=True)
class SmallEdit:
    """The given function's source and how far an answer may move from it (see the module docstring)."""

    given: str
    most: int
    lines: tuple[int, ...] = ()
    names: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.given, str) or not self.given.lstrip().startswith("def "):
            raise ValueError(f"given must be the source of one function (starting with 'def'), got {self.given!r:.60}")
        if not isinstance(self.most, int) or self.most < 1:
            raise ValueError(f"most must be a positive int, got {self.most!r}")


def _docstring_lines(source: str) -> set[int]:
    """The lines of every docstring (module, class, function) in `source`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                found.update(range(first.lineno, first.end_lineno + 1))
    return found


def tokens(source: str) -> list[tuple[str, int]]:
    """`source`'s tokens as ``(text, line)``, without layout, comments, docstrings and the first ``def``'s name.
    Raise ``ValueError`` when it is not Python."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a str, got {type(source).__name__}")
    source = textwrap.dedent(source)
    try:
        docs = _docstring_lines(source)
        raw = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (SyntaxError, tokenize.TokenError, IndentationError) as err:
        raise ValueError(f"source is not Python: {err}") from None
    out, named = [], False
    for i, tok in enumerate(raw):
        if tok.type in _LAYOUT:
            continue
        if tok.type == tokenize.STRING and tok.start[0] in docs:
            continue
        if not named and i > 0 and raw[i - 1].string == "def" and tok.type == tokenize.NAME:
            named = True  # the function's own name: a learner renames it
            continue
        out.append((tok.string, tok.start[0]))
    return out


def changes(given: str, answer: str) -> list[tuple[str, int, int, int, int]]:
    """The edits that turn `given`'s tokens into `answer`'s: difflib opcodes other than 'equal'."""
    a, b = [t for t, _ in tokens(given)], [t for t, _ in tokens(answer)]
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return [op for op in ops if op[0] != "equal"]


def distance(given: str, answer: str) -> int:
    """How many tokens an edit of `given` changes to give `answer` (a replaced run counts its longer side)."""
    return sum(max(i2 - i1, j2 - j1) for _, i1, i2, j1, j2 in changes(given, answer))


def outside_lines(given: str, answer: str, allowed) -> list[int]:
    """The lines of `given` (1: its first line) that the edit changes although they are not in `allowed`: a
    replaced or deleted token's line; for an insertion, the line of a neighbouring token when neither is allowed."""
    toks, allowed, outside = tokens(given), set(allowed), set()
    for tag, i1, i2, _, _ in changes(given, answer):
        if tag == "insert":  # between tokens i1 - 1 and i1: either line is the place
            near = {toks[i][1] for i in (i1 - 1, i1) if 0 <= i < len(toks)}
            if not near & allowed:
                outside.update(near)
        else:
            outside.update(toks[i][1] for i in range(i1, i2) if toks[i][1] not in allowed)
    return sorted(outside)


def new_names(given: str, answer: str) -> list[str]:
    """Identifiers (not keywords) in `answer` that `given` does not use, in order of appearance."""
    def names(source):
        return [t for t, _ in tokens(source) if t.isidentifier() and not keyword.iskeyword(t)]

    known, seen = set(names(given)), []
    for name in names(answer):
        if name not in known and name not in seen:
            seen.append(name)
    return seen


def judge(spec: SmallEdit, answer: str, target: str = "your function") -> str | None:
    """None when `answer` (a function's source) is `spec.given` with an edit the spec allows, else why not.
    The message never says where the given function is wrong."""
    try:
        n = distance(spec.given, answer)
    except ValueError as err:
        return f"the check could not read {target} as Python ({err})"
    extra = [name for name in new_names(spec.given, answer) if name not in spec.names]
    if n > spec.most:
        return (f"{target} differs from the given function in {n} tokens (comments, docstrings, spacing and the "
                f"function's name not counted); a fix needs at most {spec.most}: start from a copy of the given "
                "function under the new name and change only what is wrong in it, in place (a rewrite, or a "
                "wrapper that calls or corrects the given function, is not accepted even when its values are right: "
                "the check judges the edit that locates the bug)")
    if extra:
        return (f"{target} uses names the given function does not ({', '.join(extra[:5])}): fix the given function "
                "itself, with a small edit, rather than calling other code")
    outside = outside_lines(spec.given, answer, spec.lines) if spec.lines else []
    if outside:
        return (f"{target} gives the right values, but by changing line(s) {', '.join(map(str, outside))} of the "
                "given function (its def line is 1), where it is not wrong: find the line that is")
    return None


def prop(spec: SmallEdit, target: str = "your function", also: Callable[[list], str | None] | None = None
         ) -> Callable[[list], str | None]:
    """An exercise's ``prop`` judging the answer's source (from the guard's trace) against `spec`; `also`: the
    exercise's own property of the runs, judged first (a trace-reading check keeps it)."""

    def small_edit(runs: list) -> str | None:
        why = also(runs) if also is not None else None
        if why:
            return why
        trace = runs[0].trace if runs else None
        source = trace.get("source") if isinstance(trace, dict) else None
        if not isinstance(source, str):
            why = source.get("why") if isinstance(source, dict) else "no source was recorded"
            return (f"the check compares {target} with the given function token by token and could not read its "
                    f"source ({why}): define it with `def` at the top level of a cell, and run that cell")
        return judge(spec, source, target)

    small_edit.needs_source = True
    small_edit.spec = spec
    return small_edit


def needs_source(prop_fn) -> bool:
    """Whether an exercise's ``prop`` judges the answer's source (the guard must record it)."""
    return bool(getattr(prop_fn, "needs_source", False))


def _undecorated(source: str) -> str:
    """`source` from its ``def`` line on (a kernel's ``@triton.jit`` line dropped)."""
    lines = textwrap.dedent(source).splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("def ")), 0)
    return "".join(lines[start:])


def kernel_prop(spec: SmallEdit, judged: str, also: Callable[[list], str | None] | None = None
                ) -> Callable[[list], str | None]:
    """An exercise's ``prop`` for a fix that lives in a Triton kernel the answer launches: every kernel launched
    (its source, from the guard's trace) must be `spec.given` with a small edit. `judged`: the kernel's name as the
    exercise asks for it; `also`: the exercise's own property of the runs, judged first."""
    target = f"`{judged}`"

    def small_edit(runs: list) -> str | None:
        why = also(runs) if also is not None else None
        if why:
            return why
        kernels = [k for run in runs for k in ((run.trace or {}).get("kernels") or [])]
        if not kernels:
            return f"no Triton kernel was launched: the fix is a corrected {target}, launched by your answer"
        for source in kernels:
            if not isinstance(source, str):
                why = source.get("why") if isinstance(source, dict) else "no source was recorded"
                return (f"the check compares the kernel your answer launched with the given kernel token by token "
                        f"and could not read its source ({why}): define it with `@triton.jit` and `def` at the top "
                        "level of a cell, and run that cell")
            why = judge(spec, _undecorated(source), f"the kernel your answer launched ({target})")
            if why:
                return why
        return None

    small_edit.needs_source = True
    small_edit.spec = spec
    small_edit.judged = judged
    return small_edit
