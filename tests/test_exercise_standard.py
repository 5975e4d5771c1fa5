"""The exercise standard (issue 15), enforced for every chapter, existing and future.

Every chapter's exercises (the registry in ``attncourse.classroom.checks``) and notebooks are walked:

* every exercise has a category, and each chapter has at least one implement, bug, predict and
  experiment exercise;
* implement: ``forbid`` and at least one shortcut; every shortcut is a right answer (it passes the grader's
  judging path with nothing forbidden, so refusing it proves something) and is refused as a forbidden call
  both by the check cell's ``check()`` and by the grader's judging path;
* experiment: a function (``kind="function"``) whose check recomputes: every case carries the
  ``expected`` the reference computes for its inputs, and an answer that returns one case's expected
  value whatever it is given (a hand-typed number) fails;
* predict: a wrong answer (every part perturbed, then only the first part perturbed) is told it is wrong
  by ``checks.feedback``, the check cell and the grader, and none of those messages (the hint included)
  shows the expected value or, where distinctive, one of its parts;
* bug: ``bug_words`` are declared (words or phrases: "forgets to rescale" names the bug where "rescale"
  names the lesson's subject), and none of them appears, at the start of a word and in any case, in the
  exercise's title or in the chapter's lesson notebook (markdown and code);
* hints point the way without the code: a heuristic flags hints holding code or a whole formula;
* no solution body is a near copy of a lesson cell (lines, and runs of 8+ tokens, with names normalised:
  the kind of matching ``tests/test_release.py`` uses for leaks);
* verification cells: a lesson or solution cell whose output prints a verdict (``equal: True``,
  ``match: False``) asserts it (``assert`` or ``torch.testing.assert_close``) in its source, and every
  boolean expression it prints (``torch.allclose(a, b)``, ``bool((w < 0).any())``) is what an ``assert``
  checks (or its arguments are what an ``assert_close`` compares).

Every test is parametrized by chapter and reports every finding of that chapter at once, naming the
exercise, notebook and cell: ``pytest tests/test_exercise_standard.py -k 05`` on a chapter's branch.
Roots come from the installed package, so a copy of this file runs against the checkout it is installed
from. The grader's judging path is exercised without a kernel: the grader's own kernel-side function runs
in this process on the shortcut, and the grader's own judge reads its reply.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import io
import keyword
import math
import re
import sys
import tokenize
from pathlib import Path
from typing import Any

import nbformat
import pytest
import torch

from attncourse.classroom import checks
from attncourse.classroom.nbtools import BEGIN_SOLUTION, END_SOLUTION, ROOT

try:  # the grader's judging path, wherever this checkout keeps it
    from attncourse.classroom.grading.remote import KERNEL_SIDE, judge
except ImportError:  # pragma: no cover - a branch from before the grader was split
    from attncourse.classroom.grade import KERNEL_SIDE, _judge as judge

REGISTRY = checks.registry()
NOTEBOOKS, SOLUTIONS = ROOT / "notebooks", ROOT / "solutions"


def _chapters_with(folder: Path) -> set[str]:
    return {p.name[:2] for p in folder.glob("*.ipynb") if p.name[:2].isdigit()}


EXERCISE_CHAPTERS = sorted({ex.chapter for ex in REGISTRY.values()} | _chapters_with(SOLUTIONS))
ALL_CHAPTERS = sorted(set(EXERCISE_CHAPTERS) | _chapters_with(NOTEBOOKS))


def exercises(chapter: str) -> list[checks.Exercise]:
    return checks.exercises_for(chapter)


def of_category(chapter: str, category: str) -> list[checks.Exercise]:
    return [ex for ex in exercises(chapter) if ex.category == category]


def notebooks(folder: Path, chapter: str) -> list[Path]:
    return sorted(p for p in folder.glob("*.ipynb") if p.name[:2] == chapter)


def read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def report(chapter: str, what: str, problems: list[str]) -> None:
    assert not problems, f"chapter {chapter}: {what}:\n  " + "\n  ".join(problems)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


# ----------------------------------------------------------------------------- categories


@pytest.mark.parametrize("chapter", EXERCISE_CHAPTERS)
def test_every_exercise_has_a_category(chapter):
    report(chapter, "exercises without a category (one of implement, bug, predict, experiment)",
           [f"{ex.id}" for ex in exercises(chapter) if ex.category not in checks.CATEGORIES])


@pytest.mark.parametrize("chapter", EXERCISE_CHAPTERS)
def test_each_chapter_has_every_category(chapter):
    have = {ex.category for ex in exercises(chapter)}
    report(chapter, "categories with no exercise", [c for c in checks.CATEGORIES if c not in have])


# ----------------------------------------------------------------------------- the grader's judging path, in this process


_KERNEL: dict = {}


def _kernel_grade():
    """The grader's kernel-side function, built once from its source as the grader sends it."""
    if not _KERNEL:
        exec(KERNEL_SIDE, _KERNEL)
    return next(v for k, v in _KERNEL.items() if k.endswith("_grade") and callable(v))


def _kernel_run():
    """The guard's `run` as the grader's kernel has it (compiled from the source the grader sends)."""
    if "run" not in _KERNEL:
        namespace = {"__name__": "attncourse_call_guard", "copies": checks.copies}  # as remote.py gives it
        source = Path(checks.forbidden.__file__).read_text(encoding="utf-8")
        exec(compile(source, "<attncourse call guard>", "exec"), namespace)
        _KERNEL["run"] = namespace["run"]
    return _KERNEL["run"]


def grader_reply(ex: checks.Exercise, answer: Any, cases: list[checks.Case], tmp_path: Path, monkeypatch,
                 forbid: tuple[str, ...] | None = None) -> dict:
    """What the grader's kernel-side function replies for `answer` on `cases` (run here, not in a kernel)."""
    grade_fn = _kernel_grade()
    monkeypatch.setitem(sys.modules["__main__"].__dict__, ex.target, answer)
    src, out = tmp_path / f"{ex.id}.in.pt", tmp_path / f"{ex.id}.out.pt"
    torch.save([(tuple(c.args), dict(c.kwargs)) for c in cases], src)
    policy = ex.policy if forbid is None else checks.forbidden.policy(forbid=forbid, library=False, trace=True,
                                                                       stream=ex.stream)
    grade_fn(str(src), str(out), ex.target, ex.kind, ex.numpy, policy)
    return torch.load(out, weights_only=True)


def as_learner(fn: Any) -> Any:
    """`fn` as if the learner had typed it in a notebook cell: the same code (nested functions and lambdas
    included), filed under a notebook cell's name, so the guard judges what it calls, not where it was written.
    A shortcut written in a checks module would otherwise be refused for entering check code, or as a copy of
    check code (the guard knows the course's code by its names and constants), which proves nothing about the calls
    it makes: each code object gets one unused constant more, as a learner's own version of it would differ."""
    import types

    code = getattr(fn, "__code__", None)
    if code is None or code.co_filename.startswith("<cell"):  # typed in a cell already (test_edits.cell_function)
        return fn

    def refile(c):
        consts = tuple(refile(k) if isinstance(k, types.CodeType) else k for k in c.co_consts)
        return c.replace(co_filename="<cell learner>", co_consts=consts + ("<typed by the learner>",))

    new = types.FunctionType(refile(code), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = getattr(fn, "__qualname__", fn.__name__)
    return new


def checked(ex: checks.Exercise, answer: Any) -> str | None:
    """None when the check cell's check() passes `answer`, else its message."""
    try:
        checks.check(ex.id, answer)
    except (checks.CheckFailed, NotImplementedError) as err:
        return str(err)
    except Exception as err:  # a check must never crash on an answer
        return f"the check itself raised {type(err).__name__}: {err}"
    return None


# ----------------------------------------------------------------------------- implement: shortcuts refused


class Grader:
    """The grader's judging path in this process (see :func:`grader_reply`)."""

    def __init__(self, tmp_path: Path, monkeypatch):
        self.tmp_path, self.monkeypatch = tmp_path, monkeypatch

    def __call__(self, ex, answer, cases, forbid=None) -> tuple[str, str]:
        return judge(ex, cases, grader_reply(ex, answer, cases, self.tmp_path, self.monkeypatch, forbid))


def outputs_right(ex: checks.Exercise, cases: list[checks.Case], reply: dict) -> bool:
    """Whether the grader's reply holds the right output for every declared case (the property aside; a gradient
    case added by checks.gradients asks more than a right output: a shortcut through a module copied under no_grad
    has none)."""
    return reply.get("status") == "ok" and len(reply["results"]) == len(cases) and all(
        checks.gradients.is_added(c) or (r[0] == "ok" and checks.feedback(ex, r[1], c) is None)
        for c, r in zip(cases, reply["results"]))


def implement_problems(ex: checks.Exercise, grader: Grader) -> list[str]:
    problems = []
    if not ex.forbid:
        problems.append(f"{ex.id}: declares no forbid=(...) (the library functions and kernels that do the job)")
    if not ex.shortcuts:
        problems.append(f"{ex.id}: declares no shortcuts=(...) (answers built on the forbidden functions)")
    if ex.kind != "function":
        return problems + [f"{ex.id}: an implement exercise must be kind='function', not {ex.kind!r}"]
    cases = ex.make_cases()
    for shortcut in map(as_learner, ex.shortcuts):
        name = _name(shortcut)
        reply = grader_reply(ex, shortcut, cases, grader.tmp_path, grader.monkeypatch, forbid=())
        if not outputs_right(ex, cases, reply):
            status, message = judge(ex, cases, reply)
            problems.append(f"{ex.id}: shortcut {name} is not a right answer even with nothing forbidden "
                            f"({status}: {message[:200]}), so refusing it proves nothing")
        msg = checked(ex, shortcut)
        if msg is None:
            problems.append(f"{ex.id}: the check cell accepts shortcut {name}")
        elif "called" not in msg:
            problems.append(f"{ex.id}: the check cell fails shortcut {name}, but not as a forbidden call: {msg[:200]}")
        status, message = grader(ex, shortcut, cases)
        if status != "failed" or "called" not in message:
            problems.append(f"{ex.id}: the grader does not refuse shortcut {name} as a forbidden call "
                            f"({status}: {message[:200]})")
    return problems


@pytest.mark.parametrize("chapter", EXERCISE_CHAPTERS)
def test_implement_exercises_refuse_their_shortcuts(chapter, tmp_path, monkeypatch, capsys):
    grader = Grader(tmp_path, monkeypatch)
    problems = [p for ex in of_category(chapter, "implement") for p in implement_problems(ex, grader)]
    capsys.readouterr()
    report(chapter, "implement exercises that can be passed by calling the library", problems)


# ----------------------------------------------------------------------------- experiments recompute


def experiment_problems(ex: checks.Exercise) -> list[str]:
    if ex.kind != "function":
        return [f"{ex.id}: kind={ex.kind!r}: an experiment is a seeded function the check calls and recomputes, "
                "never a hand-typed value"]
    problems = []
    cases = ex.make_cases()
    with_expected = [c for c in cases if c.expected is not None]
    if len(with_expected) < len(cases) or not cases:
        problems.append(f"{ex.id}: case(s) {[c.name for c in cases if c.expected is None]} carry no expected value "
                        "(what the reference computes for the case's inputs and seed)")
    for case in with_expected:
        def hand_typed(*args, _value=case.expected, **kwargs):
            return _value

        if checked(ex, hand_typed) is None:
            problems.append(f"{ex.id}: an answer that returns case '{case.name}''s expected value whatever its "
                            "inputs passes every case: the check does not recompute")
            break
    return problems


@pytest.mark.parametrize("chapter", EXERCISE_CHAPTERS)
def test_experiments_recompute_from_the_learners_function(chapter, capsys):
    problems = [p for ex in of_category(chapter, "experiment") for p in experiment_problems(ex)]
    capsys.readouterr()
    report(chapter, "experiment exercises that accept numbers without recomputing", problems)


# ----------------------------------------------------------------------------- predictions never revealed


def perturb(x: Any, only_first: bool = False) -> tuple[Any, bool]:
    """A wrong version of `x` (every leaf changed, or only the first); the flag says a leaf was changed."""
    if isinstance(x, bool):
        return (not x), True
    if isinstance(x, int):
        return x + 1, True
    if isinstance(x, float):
        return (x * 1.5 + 1.0) if math.isfinite(x) else 0.0, True
    if isinstance(x, str):
        return x + "?", True
    if x is None:
        return 0, True
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool:
            return ~x, True
        return x + 1, True
    if isinstance(x, (tuple, list)):
        out, changed = [], False
        for v in x:
            if only_first and changed:
                out.append(v)
            else:
                v2, c = perturb(v, only_first)
                out.append(v2)
                changed = changed or c
        return type(x)(out) if type(x) in (tuple, list) else tuple(out), changed
    if isinstance(x, dict):
        out, changed = {}, False
        for k, v in x.items():
            if only_first and changed:
                out[k] = v
            else:
                out[k], c = perturb(v, only_first)
                changed = changed or c
        return out, changed
    return x, False


def leaves(x: Any) -> list[Any]:
    if isinstance(x, dict):
        return [v for item in x.values() for v in leaves(item)]
    if isinstance(x, (tuple, list)):
        inner = [v for item in x for v in leaves(item)]
        return ([x] if all(isinstance(v, int) for v in x) and x else []) + inner  # a shape is a part too
    return [x]


def spellings(v: Any) -> set[str]:
    if isinstance(v, bool) or v is None:
        return set()
    if isinstance(v, int):
        return {str(v), f"{v:,}", f"{v:_}"}
    if isinstance(v, float):
        return {repr(v), f"{v:.6g}", f"{v:g}", f"{v:.4g}"} | ({str(int(v)), f"{int(v):,}"} if v.is_integer() else set())
    if isinstance(v, (tuple, list)):
        return {repr(tuple(v)), repr(list(v))}
    if isinstance(v, str):
        return {v}
    return set()


def predict_problems(ex: checks.Exercise) -> list[str]:
    problems = []
    cases = ex.make_cases()
    for case in cases:
        if case.expected is None:
            problems.append(f"{ex.id}: case '{case.name}' has no expected value to keep hidden")
            continue
        known = " ".join([case.name, ex.title, *ex.parts])  # what the learner is told anyway (not the hint)
        for only_first in (False, True):
            wrong, changed = perturb(case.expected, only_first)
            if not changed or checks.compare(wrong, case.expected, case) is None:
                continue
            shown_to_learner = []
            detail = checks.feedback(ex, wrong, case)
            if detail is None:
                problems.append(f"{ex.id}: feedback() accepts the wrong answer {wrong!r}")
                continue
            shown_to_learner.append(("feedback()", detail))
            if len(cases) == 1:  # check() and the grader stop at the first failing case
                msg = checked(ex, wrong)
                if msg is None:
                    problems.append(f"{ex.id}: the check cell accepts the wrong answer {wrong!r}")
                else:
                    shown_to_learner.append(("the check cell", msg))
                reply = {"status": "ok", "results": [("ok", checks.to_portable(wrong))]}
                status, message = judge(ex, cases, reply)
                if status == "passed":
                    problems.append(f"{ex.id}: the grader accepts the wrong answer {wrong!r}")
                shown_to_learner.append(("the grader", message))
            secret = {s for v in leaves(case.expected) for s in spellings(v)
                      if len(s) >= 2 and s not in known and s not in repr(wrong)}
            for where, text in shown_to_learner:
                if repr(case.expected) in text:
                    problems.append(f"{ex.id}: {where} shows the whole expected value: {text[:300]!r}")
                elif found := sorted(s for s in secret if re.search(rf"(?<![\w.^*]){re.escape(s)}(?![\w])", text)):
                    problems.append(f"{ex.id}: {where} shows part(s) {found} of the expected value: {text[:300]!r}")
    return sorted(set(problems))


@pytest.mark.parametrize("chapter", EXERCISE_CHAPTERS)
def test_predictions_never_reveal_the_expected_value(chapter, capsys):
    problems = [p for ex in of_category(chapter, "predict") for p in predict_problems(ex)]
    capsys.readouterr()
    report(chapter, "predictions whose feedback reveals the answer", problems)


# ----------------------------------------------------------------------------- find-the-bug: the bug is not named


def lesson_text(chapter: str) -> list[tuple[str, int, str]]:
    """(notebook, cell index, source) of every markdown and code cell of the chapter's lesson(s)."""
    return [(p.name, i, c.source) for p in notebooks(NOTEBOOKS, chapter) for i, c in enumerate(read(p).cells)
            if c.cell_type in ("markdown", "code")]


def names_the_bug(word: str, text: str) -> bool:
    """`word` at the start of a word, case-insensitively ("rescale" finds "Rescaled", not "prescale")."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(word)}", text, flags=re.IGNORECASE) is not None


def exercise_text(chapter: str) -> list[tuple[str, int, str]]:
    """(notebook, cell index, text) of every markdown and code cell of the chapter's exercise notebook(s), and of
    the outputs stored in them: what a learner reads while doing the exercise."""
    out = []
    for p in notebooks(ROOT / "exercises", chapter):
        for i, c in enumerate(read(p).cells):
            if c.cell_type in ("markdown", "code"):
                out.append((p.name, i, c.source))
            if c.cell_type == "code" and c.get("outputs"):
                out.append((p.name, i, output_text(c)))
    return out


def bug_problems(ex: checks.Exercise, lesson: list[tuple[str, int, str]]) -> list[str]:
    problems = []
    if not ex.bug_words:
        problems.append(f"{ex.id}: declares no bug_words=(...) (the words that would name the bug)")
    if not re.fullmatch(r"\d\d-find-the-bug(-\d+)?", ex.id):
        problems.append(f"{ex.id}: a bug exercise's id is neutral (NN-find-the-bug-K; keep the old id in aliases)")
    for word in ex.bug_words:
        for what, text in (("title", ex.title), ("id", ex.id.replace("-", " ")), ("hint", ex.hint),
                           ("property message", ex.prop_doc)):
            if names_the_bug(word, text):
                problems.append(f"{ex.id}: the {what} names the bug ({word!r}): {text[:120]!r}")
        for name, index, source in lesson:
            if names_the_bug(word, source):
                line = next(line for line in source.splitlines() if names_the_bug(word, line))
                problems.append(f"{ex.id}: {name} cell {index} names the bug ({word!r}): {line.strip()[:120]!r}")
    return problems


@pytest.mark.parametrize("chapter", EXERCISE_CHAPTERS)
def test_bug_exercises_are_not_named_by_title_or_lesson(chapter):
    lesson = lesson_text(chapter) + exercise_text(chapter)
    problems = [p for ex in of_category(chapter, "bug") for p in bug_problems(ex, lesson)]
    report(chapter, "find-the-bug exercises whose bug is named", problems)


# ----------------------------------------------------------------------------- hints


HINT_SMELLS = (
    (r"@", "a matrix product (@)"),
    (r"[A-Za-z_]\w*\s*\.\s*[A-Za-z_]\w*\s*\(", "a method call (.name()"),
    (r"\b(?:sqrt|exp|log|softmax|sum|max|min|mean|matmul|einsum|where|masked_fill|transpose|reshape|view|"
     r"repeat_interleave|cumsum|tril|triu|arange|zeros|ones|full|cat|stack)\s*\(", "a call of a named function"),
    (r"(?<![<>=!])=(?!=)", "an assignment or an equation (=)"),
    (r"\b(?:torch|np|F|math)\.\w+", "a library function by its dotted name"),
    (r"(?:\b\w+\b(?:\s*[*/+]\s*|\s+-\s+|-(?=\d)|(?<=\d)-)){2,}\b\w+\b", "a formula (two or more operators)"),
    (r"(?:\b\w+(?:\s+\w+)?\s+x\s+){2,}\w+", "a formula in words (a x b x c)"),
)


def hint_smells(hint: str) -> list[str]:
    return [why for pattern, why in HINT_SMELLS if re.search(pattern, hint)]


def test_hint_smells_flag_code_and_pass_prose():
    assert hint_smells("scores = Q @ K.T / sqrt(d_k)")
    assert hint_smells("use torch.softmax over the keys")
    assert hint_smells("2 (K and V) x layers x KV heads x head dim x tokens")
    assert hint_smells("alpha * l + beta * r")
    assert not hint_smells("each query's weights must sum to 1 over the keys: which axis of (..., Tq, Tk) is that?")
    assert not hint_smells("think about what happens to the running sum when the maximum grows")
    assert not hint_smells("attention mixes over the second-to-last axis: the layout is (B, heads, T, D)")


@pytest.mark.parametrize("chapter", EXERCISE_CHAPTERS)
def test_hints_point_the_way_without_the_code(chapter):
    problems = [f"{ex.id}: {', '.join(smells)}: {ex.hint!r}" for ex in exercises(chapter)
                if (smells := hint_smells(ex.hint))]
    report(chapter, "hints that hand over code or a formula (heuristic: rephrase as a question or a pointer)", problems)


# ----------------------------------------------------------------------------- no lesson retyped


def code_only(source: str) -> str:
    """Cell source without IPython magics and shell lines (so the tokenizer accepts it)."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


KEPT_NAMES = set(dir(builtins)) | {"torch", "np", "numpy", "math", "F", "nn"}
PUNCTUATION = set(",()[]{}:=.")


def tokens(source: str) -> list[str]:
    """Python tokens, comments dropped, strings' contents and local names normalised (a name is kept when it
    is an attribute, a builtin or a library module: renaming variables does not make the code different)."""
    out = []
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(code_only(source)).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source.split()
    previous = ""
    for tok in toks:
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                        tokenize.ENDMARKER):
            continue
        if (tok.type == tokenize.NAME and not keyword.iskeyword(tok.string) and previous != "."
                and tok.string not in KEPT_NAMES):
            text = "N"
        elif tok.type == tokenize.STRING:
            text = "S"
        else:
            text = tok.string
        out.append(text)
        previous = tok.string
    return out


def lines(source: str) -> set[str]:
    """Normalised lines as in tests/test_release.py (comments dropped, whitespace collapsed, >= 20 chars),
    names normalised as well."""
    found = set()
    for line in code_only(source).splitlines():
        text = " ".join(line.split("#")[0].split())
        toks = tokens(text)
        if len(text) >= 20 and sum(t != "N" and t not in PUNCTUATION for t in toks) >= 3:  # not just `a = f(b, c)`
            found.add(" ".join(toks))
    return found


BLOCK = 8  # tokens: a run this long in common is a retyped expression, not a shared idiom
COPY_SHARE = 0.6  # of a solution's tokens in such runs (or of its lines) found in one lesson cell: a near copy


def covered(mine: list[str], theirs: list[str]) -> float:
    """The share of `mine`'s tokens lying in runs of at least BLOCK tokens that `theirs` also holds, in order."""
    import difflib

    blocks = difflib.SequenceMatcher(None, mine, theirs, autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks if b.size >= BLOCK) / max(1, len(mine))


def solution_bodies(chapter: str) -> list[tuple[str, int, str, str]]:
    """(notebook, cell index, grade id, body) of every code solution region of the chapter."""
    found = []
    for path in notebooks(SOLUTIONS, chapter):
        for index, cell in enumerate(read(path).cells):
            if cell.cell_type != "code" or BEGIN_SOLUTION not in cell.source:
                continue
            body, inside = [], False
            for line in cell.source.splitlines():
                if line.strip() == BEGIN_SOLUTION:
                    inside = True
                elif line.strip() == END_SOLUTION:
                    inside = False
                elif inside:
                    body.append(line)
            gid = cell.metadata.get("nbgrader", {}).get("grade_id", "")
            found.append((path.name, index, gid.removesuffix("-answer"), "\n".join(body)))
    return found


def near_copies(body: str, lesson: list[tuple[str, int, str]]) -> list[str]:
    """The lesson cell the solution `body` retypes most (if it is a near copy), with the evidence."""
    import textwrap

    body = textwrap.dedent(body)
    mine_tok, mine_ln = tokens(body), lines(body)
    if len(mine_tok) < 2 * BLOCK:
        return []
    best = (0.0, 0.0, "")
    for name, index, source in lesson:
        share_tok = covered(mine_tok, tokens(source))
        same_ln = len(mine_ln & lines(source))
        share_ln = same_ln / len(mine_ln) if same_ln >= 2 else 0.0  # one common line (a loop header) is no copy
        if max(share_tok, share_ln) > max(best[:2]):
            best = (share_tok, share_ln, f"{name} cell {index}")
    if max(best[:2]) < COPY_SHARE:
        return []
    return [f"{best[2]} ({best[0]:.0%} of its tokens in runs of {BLOCK}+ the cell also has, {best[1]:.0%} of its "
            "lines; names normalised)"]


def test_near_copy_detection_sees_through_renaming():
    lesson = [("lesson.ipynb", 4, "scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # (B, T, T)\n"
                                  "weights = torch.softmax(scores, dim=-1)\nout = weights @ v\n")]
    renamed = "s = query @ key.transpose(-2, -1) / math.sqrt(dk)\nw = torch.softmax(s, dim=-1)\nreturn w @ value\n"
    assert near_copies(renamed, lesson) and "cell 4" in near_copies(renamed, lesson)[0]
    other = "w = torch.sigmoid(query @ key.transpose(-2, -1) - math.log(key.shape[-2]))\nreturn w @ value\n"
    assert not near_copies(other, lesson)


@pytest.mark.parametrize("chapter", EXERCISE_CHAPTERS)
def test_no_solution_is_the_lesson_retyped(chapter):
    lesson = [(name, index, source) for name, index, source in lesson_text(chapter)
              if any(c.cell_type == "code" and c.source == source for c in read(NOTEBOOKS / name).cells)]
    problems = []
    for name, index, gid, body in solution_bodies(chapter):
        for match in near_copies(body, lesson):
            problems.append(f"{gid or name + ' cell ' + str(index)}: the solution is a near copy of {match}")
    report(chapter, "solutions that retype the lesson (ask for a step the lesson did not show)", problems)


# ----------------------------------------------------------------------------- verification cells assert


VERDICT = re.compile(
    r"(?<!['\"])(?:\b\w[\w .()\-/<>=!]*?)\s*:\s*(?:True|False)\b"  # "... equal: True", "match: False"
    r"|^\s*(?:True|False)\s*$"  # a bare True / False (an expression's value)
    r"|\b(?:equal|equals|match|matches|close|same|agree|agrees|identical)\b\s*[:=]?\s*(?:True|False)\b",
    flags=re.MULTILINE | re.IGNORECASE)
ASSERTS = re.compile(r"\bassert\b|assert_close|assert_allclose|assert_equal|\bpytest\.raises\b")


def output_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream" and out.get("name") == "stdout":
            parts.append(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data"):
            parts.append(str(out.get("data", {}).get("text/plain", "")))
    return "".join(parts)


BOOLEAN_CALLS = {"allclose", "equal", "isclose", "array_equal", "bool", "all", "any", "is_contiguous",
                 "isfinite", "isnan", "startswith", "endswith", "issubset"}
ASSERTING_CALLS = {"assert_close", "assert_allclose", "assert_equal", "assert_array_equal"}


def _is_boolean(node) -> bool:
    if isinstance(node, (ast.Compare, ast.BoolOp)) or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        return (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) in BOOLEAN_CALLS
    return False


def printed_but_not_asserted(source: str) -> list[str]:
    """The boolean expressions a cell prints (``print("equal:", torch.equal(a, b))``, f-strings too) that no
    ``assert`` (or ``assert_close`` of the same arguments) in the cell checks."""
    try:
        tree = ast.parse(code_only(source))
    except SyntaxError:
        return []
    asserted = [ast.unparse(n.test) for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and (getattr(n.func, "attr", None) or getattr(n.func, "id", None)) in ASSERTING_CALLS:
            asserted.append(" ".join(ast.unparse(a) for a in n.args))
    found = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"):
            continue
        values = [v.value if isinstance(v, ast.FormattedValue) else v for a in n.args
                  for v in (a.values if isinstance(a, ast.JoinedStr) else [a])]
        for v in values:
            if not _is_boolean(v):
                continue
            text = ast.unparse(v)
            args = [ast.unparse(x) for x in getattr(v, "args", [])]
            if any(text in t for t in asserted) or (args and any(all(x in t for x in args) for t in asserted)):
                continue
            found.append(text)
    return found


def unasserted_verdicts(path: Path) -> list[str]:
    found = []
    for index, cell in enumerate(read(path).cells):
        if cell.cell_type != "code":
            continue
        text = output_text(cell)
        match = VERDICT.search(text)
        if not match:
            continue
        line = next((line for line in text.splitlines() if VERDICT.search(line)), match.group(0)).strip()[:100]
        where = f"{path.parent.name}/{path.name} cell {index}"
        if not ASSERTS.search(cell.source):
            found.append(f"{where}: prints {line!r} without asserting it")
        elif loose := printed_but_not_asserted(cell.source):
            found.append(f"{where}: prints {line!r}; no assert checks {', '.join(loose)}")
    return found


def test_verdict_detection():
    assert VERDICT.search("gqa == sdpa(enable_gqa=True): True")
    assert VERDICT.search("all weights equal 1: True")
    assert VERDICT.search("match False")
    assert VERDICT.search("True\n")
    assert not VERDICT.search("{'causal': True}")
    assert not VERDICT.search("MultiheadAttention(batch_first=True)")
    assert not VERDICT.search("✓ 05-grouped-attention: all 4 case(s) passed")
    assert printed_but_not_asserted("w = f(x)\nprint('rows sum to 1:', torch.allclose(w.sum(-1), one))") == \
        ["torch.allclose(w.sum(-1), one)"]
    assert printed_but_not_asserted("torch.testing.assert_close(w.sum(-1), one)\n"
                                    "print('rows sum to 1:', torch.allclose(w.sum(-1), one))") == []
    assert printed_but_not_asserted("ok = bool((w < 0).any())\nassert ok\nprint(f'negative: {ok}')") == []
    assert printed_but_not_asserted("print(f'negative: {bool((w < 0).any())}')") == ["bool((w < 0).any())"]


@pytest.mark.parametrize("chapter", ALL_CHAPTERS)
def test_verification_cells_assert_what_they_print(chapter):
    problems = [p for folder in (NOTEBOOKS, SOLUTIONS) for path in notebooks(folder, chapter)
                for p in unasserted_verdicts(path)]
    report(chapter, "cells that print a verdict without asserting it (add an assert or assert_close)", problems)


# ----------------------------------------------------------------------------- the guard: policies, properties, corpus


def policy_problems(ex: checks.Exercise) -> list[str]:
    problems = []
    for name in ex.allow:
        if checks.forbidden.lookup(name) is None:
            problems.append(f"{ex.id}: allow names {name!r}, which does not exist")
    if ex.category in ("implement", "bug") and ex.kind == "function":
        if ex.ops is None:
            problems.append(f"{ex.id}: declares no ops=(...) (the PyTorch operator families that would do the job)")
        if ex.prop is None and not ex.prop_doc:
            problems.append(f"{ex.id}: declares neither prop= (the property it teaches beyond the output) nor "
                            "prop_doc= (why output equality is the property)")
        if ex.prop is not None and not ex.breakers:
            problems.append(f"{ex.id}: declares prop= but no breakers=(...) (right outputs computed the wrong way)")
    return problems


@pytest.mark.parametrize("chapter", EXERCISE_CHAPTERS)
def test_every_exercise_declares_its_policy_and_property(chapter):
    report(chapter, "exercises whose guard or property is undeclared",
           [p for ex in exercises(chapter) for p in policy_problems(ex)])


def breaker_problems(ex: checks.Exercise, grader: Grader) -> list[str]:
    problems = []
    cases = ex.make_cases()
    for breaker in map(as_learner, ex.breakers):
        name = _name(breaker)
        reply = grader_reply(ex, breaker, cases, grader.tmp_path, grader.monkeypatch)
        if not outputs_right(ex, cases, reply):
            problems.append(f"{ex.id}: breaker {name} does not give the right output on every case "
                            f"({judge(ex, cases, reply)[1][:200]}), so refusing it proves nothing about the property")
            continue
        status, message = judge(ex, cases, reply)
        if status != "failed" or "not the way" not in message:
            problems.append(f"{ex.id}: the grader does not refuse breaker {name} by the property ({status}: "
                            f"{message[:200]})")
        msg = checked(ex, breaker)
        if msg is None or "not the way" not in msg:
            problems.append(f"{ex.id}: the check cell does not refuse breaker {name} by the property: {msg!r:.200}")
    return problems


@pytest.mark.parametrize("chapter", EXERCISE_CHAPTERS)
def test_properties_refuse_their_breakers(chapter, tmp_path, monkeypatch, capsys):
    grader = Grader(tmp_path, monkeypatch)
    problems = [p for ex in exercises(chapter) for p in breaker_problems(ex, grader)]
    capsys.readouterr()
    report(chapter, "properties that let a right output computed the wrong way pass", problems)


@functools.lru_cache(maxsize=None)
def library_callables() -> list[tuple[str, Any]]:
    """Every function and class the package defines, public and private, the checks' own included."""
    import importlib
    import inspect
    import pkgutil

    import attncourse

    found, seen = [], set()
    for info in pkgutil.walk_packages(attncourse.__path__, "attncourse."):
        if info.name.endswith(("__main__", ".grade", ".cli")) or ".grading" in info.name:
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:  # chapter 10's modules without Triton
            continue
        for name, obj in vars(module).items():
            target = getattr(obj, "__wrapped__", obj)
            if (inspect.isfunction(target) or inspect.isclass(target)) and \
                    getattr(obj, "__module__", "").startswith("attncourse") and id(obj) not in seen:
                seen.add(id(obj))
                found.append((f"{obj.__module__}.{name}", obj))
    return sorted(found, key=lambda item: item[0])


def _calling(fn):
    def answer(*args, **kwargs):
        return fn(*args, **kwargs)

    return as_learner(answer)


def _op_spellings() -> dict[str, list[tuple[str, Any]]]:
    """Answers that run one spelling of a forbidden PyTorch operator on small tensors (then return nothing)."""
    F = torch.nn.functional
    aten = torch.ops.aten
    x = lambda: torch.randn(2, 3, 4, 8)  # noqa: E731
    m = lambda: torch.ones(2, 3, 4, 4, dtype=torch.bool)  # noqa: E731

    def disabled(fn):
        def call():
            with torch._C.DisableTorchFunction():
                return fn()
        return call

    softmax = [
        ("torch.softmax", lambda: torch.softmax(x(), -1)), ("Tensor.softmax", lambda: x().softmax(-1)),
        ("F.softmax", lambda: F.softmax(x(), -1)), ("torch.special.softmax", lambda: torch.special.softmax(x(), -1)),
        ("torch.log_softmax", lambda: torch.log_softmax(x(), -1)), ("F.log_softmax", lambda: F.log_softmax(x(), -1)),
        ("Tensor.log_softmax", lambda: x().log_softmax(-1)), ("F.softmin", lambda: F.softmin(x(), -1)),
        ("nn.Softmax", lambda: torch.nn.Softmax(-1)(x())), ("torch._safe_softmax", lambda: torch._safe_softmax(x(), -1)),
        ("aten._softmax", lambda: aten._softmax(x(), -1, False)),
        ("aten._softmax.default", lambda: aten._softmax.default(x(), -1, False)),
        ("aten.softmax.int", lambda: aten.softmax.int(x(), -1)),
        ("aten._safe_softmax", lambda: aten._safe_softmax(x(), -1)),
        ("aten._log_softmax", lambda: aten._log_softmax(x(), -1, False)),
        ("aten._softmax without torch function", disabled(lambda: aten._softmax.default(x(), -1, False))),
        ("F.gumbel_softmax", lambda: F.gumbel_softmax(x(), tau=1e-9)),
    ]
    logsumexp = [
        ("torch.logsumexp", lambda: torch.logsumexp(x(), -1)), ("Tensor.logsumexp", lambda: x().logsumexp(-1)),
        ("torch.special.logsumexp", lambda: torch.special.logsumexp(x(), -1)),
        ("aten.logsumexp", lambda: aten.logsumexp(x(), [-1])), ("torch.logaddexp", lambda: torch.logaddexp(x(), x())),
        ("torch.logcumsumexp", lambda: torch.logcumsumexp(x(), -1)),
        ("aten.logsumexp without torch function", disabled(lambda: aten.logsumexp.default(x(), [-1]))),
    ]
    attention = [
        ("F.scaled_dot_product_attention", lambda: F.scaled_dot_product_attention(x(), x(), x())),
        ("aten.scaled_dot_product_attention", lambda: aten.scaled_dot_product_attention(x(), x(), x())),
        ("aten._scaled_dot_product_attention_math", lambda: aten._scaled_dot_product_attention_math(x(), x(), x())),
        ("aten._scaled_dot_product_flash_attention_for_cpu",
         lambda: aten._scaled_dot_product_flash_attention_for_cpu(x(), x(), x())),
        ("aten.sdpa with a mask", lambda: aten.scaled_dot_product_attention(x(), x(), x(), m())),
        ("nn.MultiheadAttention", lambda: torch.nn.MultiheadAttention(8, 2, batch_first=True)(
            x()[0], x()[0], x()[0])),
        ("F.multi_head_attention_forward", lambda: torch.nn.MultiheadAttention(8, 2)(x()[0], x()[0], x()[0])),
        ("math SDPA without torch function",
         disabled(lambda: aten._scaled_dot_product_attention_math.default(x(), x(), x()))),
    ]
    try:
        from torch.nn.attention.flex_attention import flex_attention

        attention.append(("flex_attention", lambda: flex_attention(x(), x(), x())))
    except ImportError:  # pragma: no cover - an older PyTorch
        pass
    anything = [("torch.from_numpy", lambda: torch.from_numpy(__import__("numpy").ones(3)) * 2),
                ("torch.tensor arithmetic", lambda: torch.tensor([1.0, 2.0]).exp())]
    return {"softmax": softmax, "logsumexp": logsumexp, "attention": attention, "torch": anything + softmax}


def _running(call):
    def answer(*args, **kwargs):
        call()
        return None

    return as_learner(answer)


# Modules of the package that are tooling, not lessons (kernels, files, subprocesses, benchmarks): the corpus checks
# the guard's decision on entering their code rather than running it with an exercise's arguments.
SYSTEM_MODULES = ("attncourse.classroom.nbtools", "attncourse.classroom.release", "attncourse.classroom.workspace",
                  "attncourse.classroom.timing",
                  "attncourse.nbtools",
                  "attncourse.release", "attncourse.bench", "attncourse.utils", "attncourse.ring_train",
                  "attncourse.ring.run_distributed", "attncourse.seq2seq",
                  # start a fork Pool of `processes` workers: handed (x, 4) as 08-one-pass-log-softmax's answer,
                  # run_all forked 4 workers that hung the corpus test (seen 2026-11-29, f12-0709)
                  "attncourse.variant_claims.run_all", "attncourse.variant_claims.run_gpts")


_PROCESS_WORDS = ("subprocess", "multiprocessing", "ProcessPoolExecutor", "forked_map", "mp.spawn")


@functools.lru_cache(maxsize=None)
def _module_starts_processes(module: str) -> bool:
    source = inspect.getsource(sys.modules[module]) if module in sys.modules else ""
    return any(word in source for word in _PROCESS_WORDS)


def _starts_processes(obj) -> bool:
    """Whether a library callable lives in a module that starts processes (a FULL=1 script's pool, a subprocess):
    run with an exercise's arguments it could fork workers the guard refuses inside, or run a test suite, so the
    corpus checks the guard's decision on entering it instead (lesson 12's `variant_claims.run_all` forked a pool
    whose workers died refused and left the test waiting: CI's timeout of 2026-11-29)."""
    module = getattr(obj, "__module__", None) or ""  # functions only: a class's inherited methods may be allowed
    return inspect.isfunction(obj) and module.startswith("attncourse") and _module_starts_processes(module)


def corpus_problems(ex: checks.Exercise, grader: Grader) -> tuple[list[str], int]:
    """Every library callable (and every spelling of the operators the exercise forbids) handed in as the
    answer: none may pass; every one the answer enters that the exercise does not allow is refused as a call."""
    problems, tried = [], 0
    cases = ex.make_cases()[:1]  # the first case decides (check() and the grader stop at a refusal)
    allowed = {checks.forbidden.lookup(name) for name in ex.allow}
    answers = []
    decide = checks.forbidden.Guard(ex.policy)
    # an answer of plain data (a prediction or an experiment written as a function of its configuration: numbers
    # and names): a library function handed them may simulate in Python, or train a model, for minutes
    # (13-recall-capacity's ("linear", 24, 16, 0) ran `mqar_tokens.train_zoology` for 180 s per call), and the
    # guard's decision is taken on entering its code, so that decision is checked without running it
    numbers_only = all(isinstance(a, (int, float, str, tuple, list)) and not isinstance(a, bool)
                       for a in cases[0].args) and not cases[0].kwargs
    for name, obj in library_callables():
        if numbers_only and obj not in allowed:  # library code the guard refuses on entry: not run (see above)
            codes = checks.forbidden._codes_of(obj, "attncourse")
            if codes and all(decide._kind(c) == "library" for c in codes):
                tried += 1
                continue
        if name.startswith(SYSTEM_MODULES) or _starts_processes(obj):  # tooling that starts kernels or processes,
            # writes files, benchmarks: the guard's
            codes = checks.forbidden._codes_of(obj, "attncourse")  # decision on entering it, without running it
            tried += 1
            if obj not in allowed and any(decide._kind(c) != "library" for c in codes):
                problems.append(f"{ex.id}: the guard would let the answer enter {name}")
            continue
        if name.startswith("attncourse.plot.") and obj not in allowed:
            # a drawing function returns a figure or None, which no check accepts, and its cost grows with the
            # input: 08-rescale-cost's 4,096-entry row drawn as 4,096 labels took 225 s per call
            tried += 2
            continue
        answers.append((name, obj, obj in allowed))
        answers.append((f"a call of {name}", _calling(obj), obj in allowed))
    spell = _op_spellings()
    for family in ex.forbidden_ops:
        for name, call in spell.get(family, ()):
            answers.append((f"{name} ({family})", _running(call), False))
    for name, answer, is_allowed in answers:
        tried += 1
        try:
            checks.evaluate_run(ex, answer, cases[0])
            cell = "ran"
        except checks.CheckFailed as err:
            cell = "refused" if "called" in str(err) else "failed"
        except Exception:
            cell = "raised"
        # the grader's kernel side: the guard's source as the grader sends it, called as its kernel code calls it
        # (the file round trip of grader_reply is exercised by the other tests)
        ran = _kernel_run()(answer, checks.to_numpy_args(cases[0].args) if ex.numpy else cases[0].args,
                            cases[0].kwargs, ex.policy, sys.modules["__main__"].__dict__)
        if ran["used"]:
            status, message = "failed", ran["used"][0]
        elif ran["error"] is not None:
            status, message = "error", repr(ran["error"])[:200]
        else:
            reply = {"status": "ok", "results": [("ok", checks.to_portable(ran["result"]),
                                                  checks.to_portable(ran["trace"]))]}
            status, message = judge(ex, cases, reply)
        if status == "passed" and not is_allowed:
            problems.append(f"{ex.id}: the grader accepts {name} handed in as the answer")
        if cell == "ran":
            run_got = None
            try:
                run_got = checks.evaluate_run(ex, answer, cases[0]).got
            except Exception:
                pass
            if checks.feedback(ex, run_got, cases[0]) is None and not is_allowed:
                problems.append(f"{ex.id}: the check cell accepts {name} on case '{cases[0].name}'")
        if " (" in name and not name.startswith("a call") and (cell != "refused" or status != "failed"):
            problems.append(f"{ex.id}: {name} is not refused as a forbidden call (check cell: {cell}; grader: "
                            f"{status}: {message[:120]})")
    return problems, tried


@pytest.mark.parametrize("chapter", EXERCISE_CHAPTERS)
def test_adversarial_corpus_is_refused(chapter, tmp_path, monkeypatch, capsys):
    if chapter == "10":
        pytest.importorskip("triton")
    grader = Grader(tmp_path, monkeypatch)
    problems, total = [], 0
    for ex in exercises(chapter):
        if ex.kind != "function":
            continue
        found, tried = corpus_problems(ex, grader)
        problems += found
        total += tried
    capsys.readouterr()
    print(f"chapter {chapter}: {total} adversarial answers tried")
    report(chapter, "library callables or operator spellings that pass or escape the guard", problems)


# ----------------------------------------------------------------------------- the enforcement itself can fail


def _softmax_cases():
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 5, generator=gen, dtype=torch.float64), torch.randn(2, 4, 7, generator=gen, dtype=torch.float64)]
    return [checks.Case(f"x {tuple(x.shape)}", (x,), expected=torch.softmax(x, -1)) for x in xs]


def _by_hand(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def _variance_cases():  # an experiment: the reference recomputes for each seed
    def reference(seed, d):
        g = torch.Generator().manual_seed(seed)
        q, k = torch.randn(2000, d, generator=g, dtype=torch.float64), torch.randn(2000, d, generator=g, dtype=torch.float64)
        return float((q * k).sum(-1).var())

    return [checks.Case(f"seed {s}, d {d}", (s, d), expected=reference(s, d), rtol=1e-9) for s, d in ((0, 16), (1, 64))]


def _measure(seed, d):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2000, d, generator=g, dtype=torch.float64), torch.randn(2000, d, generator=g, dtype=torch.float64)
    return float((q * k).sum(-1).var())


def _in_range(got):
    return None if isinstance(got, float) and 10 < got < 20 else "expected a variance near 16"


@pytest.fixture
def fake(monkeypatch):
    """Register an exercise of a fake chapter 99 for the length of one test."""
    def register(id, target, make_cases, **kwargs):
        ex = checks.Exercise(f"99-{id}", target, make_cases, **kwargs)
        monkeypatch.setitem(checks._REGISTRY, ex.id, ex)
        return ex

    return register


def test_shortcut_enforcement_can_fail(fake, tmp_path, monkeypatch, capsys):
    grader = Grader(tmp_path, monkeypatch)
    shortcuts = (lambda x: torch.softmax(x, -1), lambda x: x.softmax(-1), lambda x: torch.nn.functional.softmax(x, dim=-1))
    good = fake("good", "softmax_rows", _softmax_cases, category="implement", forbid=("torch.softmax",),
                shortcuts=shortcuts)
    assert implement_problems(good, grader) == []
    assert checked(good, _by_hand) is None  # the learner's own work passes
    open_door = fake("open", "softmax_rows", _softmax_cases, category="implement", shortcuts=shortcuts[:1])
    found = " ".join(implement_problems(open_door, grader))
    assert "declares no forbid" in found and "check cell accepts" in found and "grader does not refuse" in found
    wrong = fake("wrong", "softmax_rows", _softmax_cases, category="implement", forbid=("torch.softmax",),
                 shortcuts=(lambda x: torch.softmax(x, 0),))
    assert "not a right answer" in " ".join(implement_problems(wrong, grader))
    capsys.readouterr()


def test_experiment_enforcement_can_fail(fake, capsys):
    assert experiment_problems(fake("exp", "measure", _variance_cases, category="experiment")) == []
    assert checked(checks.get("99-exp"), _measure) is None
    typed = fake("typed", "variance", lambda: [checks.Case("var", compare=_in_range)], category="experiment", kind="value")
    assert "never a hand-typed value" in experiment_problems(typed)[0]
    ranged = fake("ranged", "measure", lambda: [checks.Case("var", (0, 16), compare=_in_range)], category="experiment")
    assert "carry no expected value" in experiment_problems(ranged)[0]
    plausible = fake("plausible", "measure",
                     lambda: [checks.Case("var", (0, 16), expected=16.0, compare=_in_range)], category="experiment")
    assert "does not recompute" in experiment_problems(plausible)[0]
    capsys.readouterr()


def test_prediction_enforcement_can_fail(fake, capsys):
    shapes = lambda: [checks.Case("shapes", expected=((2, 4, 5, 7), 4096), compare="equal")]  # noqa: E731
    assert predict_problems(fake("quiet", "p", shapes, category="predict", kind="value", parts=("scores", "bytes"))) == []
    tells = fake("tells", "p", lambda: [checks.Case("bytes", expected=4096, compare=lambda got, expected:
                                                    None if got == expected else f"should be {expected}")],
                 category="predict", kind="value")
    assert "4096" in " ".join(predict_problems(tells))
    capsys.readouterr()


def test_bug_enforcement_can_fail(fake):
    lesson = [("NN_lesson.ipynb", 3, "Note that the softmax must run over the keys axis.")]
    named = fake("named", "f", list, category="bug", title="Fix the softmax axis", bug_words=("axis",))
    found = bug_problems(named, lesson)
    assert any("title names" in p for p in found) and any("cell 3" in p for p in found)
    assert bug_problems(fake("find-the-bug-1", "f", list, category="bug", title="Fix it", bug_words=("rescal",)),
                        lesson) == []
    assert any("neutral" in p for p in found)  # 99-named is not a neutral id
    assert "declares no bug_words" in bug_problems(fake("bare", "f", list, category="bug"), lesson)[0]
