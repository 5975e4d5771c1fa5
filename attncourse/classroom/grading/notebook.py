"""Grade one notebook: run it in its own kernel (check cells excepted), then every exercise of its chapter."""

from __future__ import annotations

import re
import secrets
import tempfile
import time
from pathlib import Path

import nbformat

from .. import checks
from ..nbtools import kernel_manager
from .hidden import hidden_tests
from .remote import KERNEL_SIDE
from .results import (MAX_NOTEBOOK_BYTES, SOLUTIONS, ExerciseResult, NotebookResult, chapter_in_text,
                      chapter_of)
from .session import KernelStuck, Session, execute, is_check_cell, make_client, run_extra, running
from .watch import UNWATCH_SIDE, exercises_reached, watch_source
from .watch import message as reached_message

LOUD_BYTES = 1_000_000  # printed output above this is mentioned in the notebook's message


def grade_notebook(path: Path, cell_timeout: float = 60, timeout: float = 600, *,
                   solutions: Path | None = SOLUTIONS, student: str = "", chapter: str | None = None,
                   salt: int | None = None) -> NotebookResult:
    """Grade one notebook; never raises for anything the notebook does.

    `chapter` ("03") overrides the chapter found in the notebook's metadata, cells or file name. `salt` mixes
    the seeds of the registry's cases (:mod:`..checks.salting`): by default a fresh secret one per notebook, so
    no table of the check cells' expected values answers the grader; give one to reproduce a grade.

    A cell that stops the kernel (ignores the interrupt at its time limit, or kills it) costs only itself: the
    notebook runs again in a fresh kernel without it. An answer that stops the kernel while it is graded gets
    that verdict, and the exercises not yet graded are graded in a fresh kernel (at most MAX_RESTARTS times)."""
    start = time.perf_counter()
    path = Path(path)
    nb, problem = None, ""
    try:
        size = path.stat().st_size
        if size > MAX_NOTEBOOK_BYTES:
            problem = f"the notebook file is too large to grade ({size / 1e6:.0f} MB > {MAX_NOTEBOOK_BYTES / 1e6:.0f} MB)"
        else:
            nb = nbformat.read(path, as_version=4)
            nbformat.validate(nb)
    except Exception as err:
        nb, problem = None, f"not a readable notebook ({type(err).__name__}: {str(err)[:200]})"
    chapter = chapter or chapter_of(path, nb) or (chapter_in_text(path) if nb is None else None)
    exercises = checks.exercises_for(chapter) if chapter else []
    result = NotebookResult(str(path), 0.0, float(sum(ex.points for ex in exercises)), student=student or path.stem)
    if not exercises:
        result.message = problem or "no exercises found: chapter unknown (name the file NN_topic.ipynb)"
        return result

    def all_as(status: str, message: str) -> NotebookResult:
        result.exercises = [ExerciseResult(ex.id, 0.0, ex.points, status, message) for ex in exercises]
        result.message, result.seconds = message, time.perf_counter() - start
        return result

    if nb is None:  # said once, in the notebook's message; each exercise only points there
        all_as("error", NOT_GRADED)
        result.message = problem
        return result
    if not any(c.cell_type == "code" and c.source.strip() for c in nb.cells):
        return all_as("missing", "the notebook has no code")
    hidden = hidden_tests(chapter, Path(solutions) if solutions is not None else None)

    salt = secrets.randbits(62) if salt is None else salt
    deadline = time.monotonic() + timeout
    notes: list[str] = []
    stopped: list[tuple[int, str]] = []  # (index, why) of cells interrupted, and where the time limit struck
    skip: dict[int, str] = {}  # cells that stopped the kernel: the notebook is run again without them
    graded: dict[str, ExerciseResult] = {}
    printed = 0
    for attempt in range(MAX_RESTARTS + 1):
        failure = _run_and_grade(nb, exercises, hidden, cell_timeout, timeout, deadline, salt, skip, graded, notes,
                                 stopped)
        printed = max(printed, failure.printed)
        if failure.kind is None:
            break
        again = attempt < MAX_RESTARTS and time.monotonic() < deadline and (
            failure.index is not None or failure.exercise is not None)
        if failure.index is not None:  # a cell of the notebook stopped the kernel: run it again without that cell
            why = ("ignored an interrupt and was stopped" if failure.kind == "stuck" else "stopped the kernel (it died)")
            skip[failure.index] = why
            stopped.append((failure.index, why))
            notes.append(f"{cell_name(failure.index, nb)} {why}" + (
                "; the notebook was run again in a fresh kernel without it" if again else ""))
        elif failure.exercise is not None:  # the exercise being graded stopped the kernel: it gets the verdict, the others a fresh kernel
            why = ("the kernel ignored an interrupt and was stopped" if failure.kind == "stuck"
                   else "the kernel died")
            ex = failure.exercise
            graded[ex.id] = ExerciseResult(ex.id, 0.0, ex.points, "timeout" if failure.kind == "stuck" else "error",
                                           why + " while this answer ran")
            notes.append(f"{why} while {ex.id} was graded" + (
                "; the other exercises were graded in a fresh kernel" if again and len(graded) < len(exercises) else ""))
        if not again:
            why = ("the kernel ignored an interrupt and was stopped" if failure.kind == "stuck" else "the kernel died")
            if failure.index is None and failure.exercise is None:
                notes.append(why)
            else:
                why += f" ({MAX_RESTARTS} fresh kernels, or the notebook's time limit, used up)"
            for ex in exercises:
                graded.setdefault(ex.id, ExerciseResult(ex.id, 0.0, ex.points, "timeout" if failure.kind == "stuck"
                                                        else "error", why))
            break
    result.exercises = [graded[ex.id] for ex in exercises if ex.id in graded]
    if printed > LOUD_BYTES:
        notes.append(f"the notebook printed {printed / 1e6:.1f} MB of output (discarded)")
    result.exercises = [explain_missing(e, nb, stopped) for e in result.exercises]
    result.score = float(sum(e.points for e in result.exercises))
    result.message = "; ".join(dict.fromkeys(notes))  # a rerun notebook repeats its notes: said once
    result.seconds = time.perf_counter() - start
    return result


MAX_RESTARTS = 3  # fresh kernels after a cell or an answer stopped one (each reruns the notebook)


class _Failure:
    """How one kernel's run ended: kind None (every exercise graded), "stuck" or "dead", with the notebook cell
    (index) or the exercise being graded at the time; and the bytes the notebook printed."""

    def __init__(self, kind=None, index=None, exercise=None, printed=0):
        self.kind, self.index, self.exercise, self.printed = kind, index, exercise, printed


def _run_and_grade(nb, exercises, hidden, cell_timeout, timeout, deadline, salt, skip, graded, notes,
                   stopped) -> _Failure:
    """One kernel: the notebook's cells (check cells and `skip` excepted), then every exercise not yet in `graded`
    (filled in place), noting interrupted cells in `notes` and `stopped`."""
    from nbclient.exceptions import DeadKernelError

    with tempfile.TemporaryDirectory(prefix="attncourse-grade-") as tmp:
        km = kernel_manager(env={"ATTNCOURSE_STATE": str(Path(tmp) / "state")})  # a loop over `check` in a
        client = make_client(nb, cell_timeout, km, tmp)  # submission counts its tries here, not in the grader's file
        index, ex = None, None
        try:
            with running(client, km):
                session = Session(client, Path(tmp), cell_timeout, deadline, salt)
                hits = Path(tmp) / "checker-calls.txt"  # cells that call the checks' own code (see .watch)
                run_extra(client, watch_source(hits), cell_timeout)
                for index, cell in enumerate(nb.cells):
                    if cell.cell_type != "code" or is_check_cell(cell) or index in skip:
                        continue  # the grader runs its own checks, not the submission's check cells
                    if time.monotonic() > deadline:
                        notes.append(f"notebook time limit ({timeout:g} s) reached at {cell_name(index, nb)}; "
                                     "later cells not run")
                        stopped.append((index, "was not run: the notebook's time limit was reached there"))
                        break
                    limit = session.limit()
                    if not execute(client, cell, index, limit):
                        graded_cell = str(cell.metadata.get("nbgrader", {}).get("grade_id", "")).endswith("-answer")
                        notes.append(f"{cell_name(index, nb)} ran over {limit:g} s and was interrupted" + (
                            "" if graded_cell else " (it holds no graded answer: the exercises were graded without "
                            "it; on a slow or busy machine, a longer --cell-timeout lets it finish)"))
                        stopped.append((index, f"ran over {limit:g} s and was interrupted"))
                    cell.outputs = []
                index = None
                run_extra(client, UNWATCH_SIDE, cell_timeout)
                reached = exercises_reached(hits, exercises)
                run_extra(client, KERNEL_SIDE, cell_timeout)
                for ex in exercises:
                    if ex.id in reached:
                        graded[ex.id] = ExerciseResult(ex.id, 0.0, ex.points, "failed", reached_message(reached[ex.id]))
                    elif ex.id not in graded:
                        graded[ex.id] = session.grade(ex, hidden.get(ex.id, ()))
                ex = None
        except (DeadKernelError, KernelStuck) as err:
            kind = "stuck" if isinstance(err, KernelStuck) else "dead"
            return _Failure(kind, index, ex if index is None else None, client.printed)
        return _Failure(printed=client.printed)


NOT_GRADED = "not graded: the notebook could not be read (see the note above)"


def cell_name(index: int, nb: nbformat.NotebookNode) -> str:
    """A cell as JupyterLab's status bar names it: "cell 16 of 28" (1-based, markdown cells counted)."""
    return f"cell {index + 1} of {len(nb.cells)}"


def defines(source: str, name: str) -> bool:
    """Whether a cell's source binds `name` at top level (def, class, assignment, import as)."""
    n = re.escape(name)
    return bool(re.search(rf"^(def|class|async def)\s+{n}\b|^{n}\s*(:[^=\n]*)?=(?!=)|^(from\s+\S+\s+)?import\s.*\bas\s+{n}\b",
                          source, re.M))


def explain_missing(e: ExerciseResult, nb: nbformat.NotebookNode, stopped: list[tuple[int, str]]) -> ExerciseResult:
    """A "not defined" exercise whose defining cell was interrupted (or never reached because an earlier cell
    was) says so, instead of suggesting the answer is not in the notebook."""
    if e.status != "missing" or not stopped or "is not defined" not in e.message:
        return e
    ex = checks.get(e.id)
    answer = {f"{i}-answer" for i in (ex.id, *ex.aliases)}
    where = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (
        defines(c.source, ex.target) or c.metadata.get("nbgrader", {}).get("grade_id") in answer)]
    if any("raise NotImplementedError" in nb.cells[i].source for i in where):  # the untouched stub: its own cause
        return ExerciseResult(e.id, 0.0, e.max_points, "missing",
                              f"`{ex.target}` is not written yet (its cell still raises NotImplementedError)")
    for index, why in stopped:
        if index in where:
            return ExerciseResult(e.id, e.points, e.max_points, "timeout",
                                  f"`{ex.target}` was never defined: its cell, {cell_name(index, nb)}, {why}")
    before = [(index, why) for index, why in stopped if where and index < where[0]]
    if not before:
        return e
    index, why = before[0]
    if index == stopped[-1][0] and "time limit" in why:
        text = f"`{ex.target}` was never defined: its cell, {cell_name(where[0], nb)}, was not reached ({cell_name(index, nb)} {why})"
    else:
        text = (f"`{ex.target}` was still not defined after {cell_name(where[0], nb)}, which defines it, ran; an "
                f"earlier cell, {cell_name(index, nb)}, {why} (does yours depend on it?)")
    return ExerciseResult(e.id, e.points, e.max_points, "timeout", text)


def grade_safely(path: Path, cell_timeout: float = 60, timeout: float = 600, *, solutions: Path | None = SOLUTIONS,
                 student: str = "", chapter: str | None = None, salt: int | None = None) -> NotebookResult:
    """`grade_notebook`, but a failure of the grader itself is reported as the notebook's result."""
    try:
        return grade_notebook(path, cell_timeout, timeout, solutions=solutions, student=student, chapter=chapter,
                              salt=salt)
    except Exception as err:  # never let one submission stop the class
        return grader_failure(path, student, f"the grader failed on this notebook ({type(err).__name__}: {str(err)[:300]})",
                              chapter)


def grader_failure(path: Path, student: str, message: str, chapter: str | None = None) -> NotebookResult:
    """Every exercise of the notebook's chapter as an error with `message` (the grader could not grade it)."""
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception:
        nb = None
    chapter = chapter or chapter_of(Path(path), nb) or chapter_in_text(Path(path))
    exercises = checks.exercises_for(chapter) if chapter else []
    return NotebookResult(str(path), 0.0, float(sum(e.points for e in exercises)),
                          [ExerciseResult(e.id, 0.0, e.points, "error", message) for e in exercises],
                          message, 0.0, student or Path(path).stem)
