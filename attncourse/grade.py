"""Grade student notebooks: one, or a whole class in parallel.

    python -m attncourse.grade PATH... [--json FILE] [--csv FILE] [--csv-long FILE] [--feedback DIR]
                               [--jobs N] [--timeout S] [--cell-timeout S] [--solutions DIR] [--chapter NN] [--[no-]progress]

PATH is a notebook or a folder of submissions. In a folder, a notebook directly inside it belongs to
the student named like the file (``alice.ipynb``); a notebook in a sub-folder belongs to the student
named like that sub-folder (``alice/03_scaled_dot_product_attention.ipynb``, or nbgrader's
``submitted/alice/ps03/03_....ipynb`` when PATH is ``submitted``). A notebook named on the command
line belongs to the student named like the file.

How a notebook is graded
    Each notebook runs in its own Jupyter kernel (never in the grading process), cell by cell with a
    per-cell and a per-notebook time limit, errors and all, except its check cells (nbgrader "grade"
    cells without a solution), which the grader replaces with its own checks. Whatever the notebook
    prints is discarded (it can print gigabytes: the grader keeps none of it). Then, for every exercise
    of its chapter (the registry in ``attncourse.checks``), the grader builds the cases *here*, sends
    only their inputs to the kernel, calls the student's function there, brings the results back (loaded
    with ``torch.load(weights_only=True)``: tensors and plain data only) and compares them here with
    expected values computed here. Check cells, printed "passed" lines and anything the notebook patches
    in its own kernel (the checker, ``attncourse``'s reference implementations, ``torch.testing``)
    cannot change the verdict.

Hidden tests
    ``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS`` blocks in the check cells of
    ``solutions/NN_*.ipynb`` (the cell's nbgrader ``grade_id`` names the exercise) run after the
    registry's cases pass. They run *in this process*, not in the student's kernel: the exercise's
    target name is bound to a proxy that calls the student's function in the kernel (inputs out, result
    back, as above), so the assertions (``torch.testing.assert_close``, ``assert``) are the grader's own
    and the notebook cannot patch them. A hidden block must therefore be self-contained: it may use
    ``torch``, ``np``, ``math``, ``F`` and the exercise's target, and must import anything else
    (``from attncourse import ...`` gives the genuine package here). Arguments and results travel as
    tensors, NumPy arrays, numbers, strings, tuples, lists and dicts. An exception the student's code
    raises is re-raised here with the same built-in type, so a hidden test can expect a ValueError.
    ``exercises/`` and releases never contain these blocks; without a ``solutions/`` folder (``--solutions``)
    hidden tests are skipped and the run says so.

Output
    Console: one line per notebook and one per exercise. ``--json``: a list with one object per
    notebook (``notebook``, ``student``, ``score``, ``max_score``, ``message``, ``seconds``, ``exercises``: ``id``,
    ``points``, ``max_points``, ``status`` in passed/failed/error/timeout/missing, ``message``).
    ``--csv``: a gradebook, one row per student, columns ``student``, one per exercise id (points),
    ``total``, ``max_total``: import it into an LMS, mapping ``student`` to the user name or ID.
    ``--csv-long``: one row per student and exercise with points, status and message.
    ``--feedback DIR``: ``DIR/<student>/<notebook>.md`` saying what passed, what failed and why.
    The exit status is 0 whenever grading finished, whatever the scores.

Threat model: the grader defends against tampering *inside the notebook's Python* (patching, fake
prints, edited or deleted check cells, edited metadata). Student code runs with the grader's user
rights; grade untrusted submissions inside a container or as an unprivileged user.
"""

from __future__ import annotations

import argparse
import builtins
import csv
import json
import logging
import math
import re
import sys
import tempfile
import textwrap
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import nbformat
import torch
from jupyter_core.utils import run_sync

from . import checks
from .nbtools import BEGIN_HIDDEN, END_HIDDEN, ROOT, kernel_manager, shutdown

_QUIET = logging.getLogger("attncourse.grade.nbclient")
_QUIET.setLevel(logging.CRITICAL)

STATUSES = ("passed", "failed", "error", "timeout", "missing")
SOLUTIONS = ROOT / "solutions"
MAX_NOTEBOOK_BYTES = 50_000_000  # a bigger .ipynb is not read at all
LOUD_BYTES = 1_000_000  # printed output above this is mentioned in the notebook's message

# Runs inside the student's kernel. Self-contained (stdlib, torch, numpy) so that nothing the notebook
# patched in attncourse changes how answers are called; wrapped in a function so it leaves no names.
KERNEL_SIDE = r'''
def __attncourse_grade(inputs_path, results_path, target, kind, numpy_args, forbid):
    import sys, torch, numpy, importlib, difflib
    def portable(x):
        if isinstance(x, torch.Tensor): return x.detach().cpu().clone()
        if isinstance(x, numpy.ndarray): return torch.from_numpy(numpy.array(x))
        if isinstance(x, numpy.generic): return x.item()
        if isinstance(x, torch.Size): return tuple(int(d) for d in x)
        if isinstance(x, (tuple, list)): return (list if type(x) is list else tuple)(portable(v) for v in x)
        if isinstance(x, dict): return {str(k): portable(v) for k, v in x.items()}
        if x is None or isinstance(x, (bool, int, float, str)): return x
        return "<unsupported object of type %s>" % type(x).__name__
    def text(err):
        return ("%s: %s" % (type(err).__name__, err))[:2000]
    ns = sys.modules["__main__"].__dict__
    if target not in ns:
        names = [n for n in list(ns) if not n.startswith("_")]
        torch.save({"status": "missing", "near": difflib.get_close_matches(target, names, n=3, cutoff=0.6)},
                   results_path)
        return
    answer = ns[target]
    if kind == "value":
        try: torch.save({"status": "ok", "results": [("ok", portable(answer))]}, results_path)
        except Exception as err: torch.save({"status": "ok", "results": [("raised", "Exception", text(err))]}, results_path)
        return
    if not callable(answer):
        torch.save({"status": "not callable", "type": type(answer).__name__}, results_path); return
    banned = []
    for dotted in forbid:
        mod, _, attr = dotted.rpartition(".")
        try: fn = getattr(importlib.import_module(mod), attr)
        except Exception: continue
        # the library's own function only: a name the notebook re-bound to its own code is the student's code
        if (getattr(fn, "__module__", None) or "").split(".")[0] == dotted.split(".")[0]:
            banned.append((dotted, fn))
    used = []
    def watch(frame, event, arg):
        for dotted, fn in banned:
            if (event == "c_call" and arg is fn) or (event == "call" and frame.f_code is getattr(fn, "__code__", None)):
                used.append(dotted)
    results = []
    for args, kwargs in torch.load(inputs_path, weights_only=True):
        if numpy_args:
            as_np = lambda a: a.numpy() if isinstance(a, torch.Tensor) else a
            args = tuple(as_np(a) for a in args)
            kwargs = {k: as_np(a) for k, a in kwargs.items()}
        used.clear()
        sys.setprofile(watch)
        try:
            out = answer(*args, **kwargs)
        except Exception as err:  # KeyboardInterrupt (the grader's time limit) is not caught
            results.append(("raised", type(err).__name__, text(err))); continue
        finally:
            sys.setprofile(None)
        if used: results.append(("forbidden", used[0], "")); continue
        try: results.append(("ok", portable(out)))
        except Exception as err: results.append(("raised", type(err).__name__, text(err)))
    torch.save({"status": "ok", "results": results}, results_path)
'''


@dataclass
class ExerciseResult:
    id: str
    points: float
    max_points: float
    status: str
    message: str


@dataclass
class NotebookResult:
    notebook: str
    score: float
    max_score: float
    exercises: list[ExerciseResult] = field(default_factory=list)
    message: str = ""
    seconds: float = 0.0
    student: str = ""


def chapter_of(path: Path, nb: nbformat.NotebookNode | None) -> str | None:
    """The chapter from notebook metadata, else from the exercise ids in its cells, else the file name."""
    if nb is not None:
        chapter = nb.metadata.get("attncourse", {}).get("chapter")
        if chapter:
            return str(chapter)
        known = checks.registry()
        for cell in nb.cells:
            gid = cell.metadata.get("nbgrader", {}).get("grade_id")
            if gid in known:
                return known[gid].chapter
    match = re.match(r"(\d\d)_", path.name)
    return match.group(1) if match else None


# ----------------------------------------------------------------------------- hidden tests


def hidden_blocks(source: str) -> list[str]:
    """The bodies of the ``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS`` blocks of one cell."""
    blocks, current = [], None
    for line in source.split("\n"):
        if line.strip() == BEGIN_HIDDEN:
            current = []
        elif line.strip() == END_HIDDEN and current is not None:
            blocks.append(textwrap.dedent("\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


@lru_cache(maxsize=None)
def hidden_tests(chapter: str, solutions: Path | None = SOLUTIONS) -> dict[str, tuple[str, ...]]:
    """Hidden test sources by exercise id, from the solutions notebook(s) of `chapter`.

    A block belongs to the exercise named by its cell's nbgrader ``grade_id`` (an ``-answer`` suffix is
    dropped, so a block in a solution cell counts too)."""
    found: dict[str, list[str]] = {}
    if solutions is None or not Path(solutions).is_dir():
        return {}
    for path in sorted(Path(solutions).glob("*.ipynb")):
        try:
            nb = nbformat.read(path, as_version=4)
        except Exception:
            continue
        if chapter_of(path, nb) != chapter:
            continue
        for cell in nb.cells:
            gid = cell.metadata.get("nbgrader", {}).get("grade_id")
            blocks = hidden_blocks(cell.source) if gid else []
            if blocks:
                found.setdefault(gid.removesuffix("-answer"), []).extend(blocks)
    return {k: tuple(v) for k, v in found.items()}


class _StudentCall(Exception):
    """The student's function could not answer a hidden test's call (missing, forbidden, timed out)."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _from_student(name: str, text: str) -> BaseException:
    """The exception the student's code raised, as the same built-in type where there is one."""
    cls = getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = RuntimeError
    try:
        err = cls(text)
    except Exception:
        err = RuntimeError(text)
    err.attncourse_student = True
    return err


def _to_transport(x: Any) -> Any:
    import numpy as np

    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, (tuple, list)):
        return type(x)(_to_transport(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_transport(v) for k, v in x.items()}
    return x


def _to_numpy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, (tuple, list)):
        return type(x)(_to_numpy(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_numpy(v) for k, v in x.items()}
    return x


class _Remote:
    """Stands for the student's function inside a hidden test: each call runs in the student's kernel."""

    def __init__(self, grader: "_Session", ex: checks.Exercise):
        self.grader, self.ex, self.calls = grader, ex, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        reply = self.grader.call(self.ex, [(_to_transport(args), _to_transport(kwargs))], f"h{self.calls}")
        outcome = reply["results"][0]
        if outcome[0] == "raised":
            raise _from_student(outcome[1], outcome[2])
        if outcome[0] == "forbidden":
            raise _StudentCall("failed", f"your code called {outcome[1]}, which this exercise forbids")
        return _to_numpy(outcome[1]) if self.ex.numpy else outcome[1]


# ----------------------------------------------------------------------------- grading one notebook


def _judge(ex: checks.Exercise, cases: list[checks.Case], reply: dict) -> tuple[str, str]:
    status = reply.get("status")
    if status == "missing":
        near = reply.get("near") or []
        extra = f" (renamed? similar names in the notebook: {', '.join(near)})" if near else ""
        return "missing", f"`{ex.target}` is not defined in the notebook{extra}"
    if status == "not callable":
        return "failed", f"`{ex.target}` should be a function, got {reply.get('type')}"
    for case, result in zip(cases, reply["results"]):
        if result[0] == "raised":
            if result[1] == "NotImplementedError":
                return "missing", f"`{ex.target}` is not implemented yet (it raises NotImplementedError)"
            return "error", f"case '{case.name}': your code raised {result[2]}"
        if result[0] == "forbidden":
            return "failed", f"case '{case.name}': your code called {result[1]}, which this exercise forbids"
        detail = checks.compare(result[1], case.expected, case)
        if detail:
            return "failed", f"case '{case.name}': {detail}"
    return "passed", f"all {len(cases)} case(s) passed"


class _Client:
    """Factory for an nbclient NotebookClient that keeps no output except errors (memory stays flat
    whatever the notebook prints) and counts the bytes it dropped."""

    @staticmethod
    def make(nb, cell_timeout, km, tmp):
        from nbclient import NotebookClient

        class Quiet(NotebookClient):
            printed = 0

            def output(self, outs, msg, display_id, cell_index):
                if msg["msg_type"] != "error":
                    content = msg.get("content", {})
                    self.printed += len(content.get("text", "")) + sum(
                        len(str(v)) for v in content.get("data", {}).values())
                    return None
                return super().output(outs, msg, display_id, cell_index)

        client = Quiet(nb, timeout=cell_timeout, allow_errors=True, interrupt_on_timeout=False,
                       kernel_name="python3", km=km, resources={"metadata": {"path": str(tmp)}})
        client.log = _QUIET  # nbclient logs tracebacks for the timeouts we handle ourselves
        return client


class _Session:
    """One student kernel, and the calls the grader makes into it."""

    def __init__(self, client, tmp: Path, cell_timeout: float, deadline: float):
        self.client, self.tmp, self.cell_timeout, self.deadline = client, tmp, cell_timeout, deadline

    def limit(self) -> float:
        return max(1.0, min(self.cell_timeout, self.deadline - time.monotonic()))

    def call(self, ex: checks.Exercise, inputs: list, tag: str) -> dict:
        """Run ex's target on `inputs` in the kernel; the reply dict, or raise _StudentCall."""
        if time.monotonic() > self.deadline:
            raise _StudentCall("timeout", "the notebook's time limit was reached before this check ran")
        src, out = self.tmp / f"{ex.id}.{tag}.in.pt", self.tmp / f"{ex.id}.{tag}.out.pt"
        torch.save(inputs, src)
        out.unlink(missing_ok=True)
        call = (f"__attncourse_grade({str(src)!r}, {str(out)!r}, {ex.target!r}, {ex.kind!r}, "
                f"{ex.numpy!r}, {tuple(ex.forbid)!r})")
        limit = self.limit()
        cell, finished = _run_extra(self.client, call, limit)
        if not finished:
            raise _StudentCall("timeout", f"checking took longer than {limit:g} s")
        if not out.exists():
            errors = [o.get("evalue", "") for o in cell.outputs if o.get("output_type") == "error"]
            raise _StudentCall("error", "the answer could not be evaluated" + (f": {errors[0][:300]}" if errors else ""))
        try:
            reply = torch.load(out, weights_only=True)
        except Exception as err:
            raise _StudentCall("error", f"the answer's result could not be read ({type(err).__name__}: {str(err)[:200]})")
        if reply.get("status") == "missing":
            raise _StudentCall(*_judge(ex, [], reply))
        return reply

    def grade(self, ex: checks.Exercise, hidden: tuple[str, ...]) -> ExerciseResult:
        def result(status: str, message: str) -> ExerciseResult:
            return ExerciseResult(ex.id, ex.points if status == "passed" else 0.0, ex.points, status, message)

        cases = ex.make_cases()
        try:  # a dead or stuck kernel propagates: grade_notebook marks the rest of the notebook
            reply = self.call(ex, [(tuple(c.args), dict(c.kwargs)) for c in cases], "cases")
        except _StudentCall as err:
            return result(err.status, err.message)
        try:
            status, message = _judge(ex, cases, reply)
        except Exception as err:
            return result("error", f"the answer's result could not be judged ({type(err).__name__}: {str(err)[:200]})")
        if status != "passed" or not hidden:
            return result(status, message)
        for number, source in enumerate(hidden, 1):
            status, detail = self.run_hidden(ex, source, number)
            if status != "passed":
                return result(status, detail)
        return result("passed", f"{message}; {len(hidden)} hidden test(s) passed")

    def run_hidden(self, ex: checks.Exercise, source: str, number: int) -> tuple[str, str]:
        import numpy as np
        from nbclient.exceptions import DeadKernelError

        if ex.kind == "value":
            reply = None
            try:
                reply = self.call(ex, [((), {})], f"h{number}")
            except _StudentCall as err:
                return err.status, f"hidden test {number}: {err.message}"
            target = reply["results"][0][1]
        else:
            target = _Remote(self, ex)
        namespace = {"__name__": f"attncourse_hidden_{ex.id}", "torch": torch, "np": np, "math": math,
                     "F": torch.nn.functional, ex.target: target}
        try:
            exec(compile(source, f"<hidden test {number} of {ex.id}>", "exec"), namespace)
        except _StudentCall as err:
            return err.status, f"hidden test {number}: {err.message}"
        except (DeadKernelError, KernelStuck):
            raise
        except Exception as err:
            text = f"{type(err).__name__}: {str(err)[:400]}"
            if getattr(err, "attncourse_student", False):
                if isinstance(err, NotImplementedError):
                    return "missing", f"`{ex.target}` is not implemented yet (it raises NotImplementedError)"
                return "error", f"hidden test {number}: your code raised {text}"
            if isinstance(err, AssertionError):
                return "failed", f"hidden test {number} failed: {text}"
            return "error", f"hidden test {number} could not run: {text}"
        return "passed", ""


def _chapter_in_text(path: Path) -> str | None:
    """The chapter of a damaged notebook, from its raw text (metadata or a grade id), if it shows."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(MAX_NOTEBOOK_BYTES)
    except OSError:
        return None
    match = re.search(r'"chapter"\s*:\s*"(\d\d)"', text) or re.search(r'"grade_id"\s*:\s*"(\d\d)-', text)
    return match.group(1) if match else None


def grade_notebook(path: Path, cell_timeout: float = 60, timeout: float = 600, *,
                   solutions: Path | None = SOLUTIONS, student: str = "", chapter: str | None = None) -> NotebookResult:
    """Grade one notebook; never raises for anything the notebook does.

    `chapter` ("03") overrides the chapter found in the notebook's metadata, cells or file name."""
    from nbclient.exceptions import DeadKernelError

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
    chapter = chapter or chapter_of(path, nb) or (_chapter_in_text(path) if nb is None else None)
    exercises = checks.exercises_for(chapter) if chapter else []
    result = NotebookResult(str(path), 0.0, float(sum(ex.points for ex in exercises)), student=student or path.stem)
    if not exercises:
        result.message = problem or "no exercises found: chapter unknown (name the file NN_topic.ipynb)"
        return result

    def all_as(status: str, message: str) -> NotebookResult:
        result.exercises = [ExerciseResult(ex.id, 0.0, ex.points, status, message) for ex in exercises]
        result.message, result.seconds = message, time.perf_counter() - start
        return result

    if nb is None:
        return all_as("error", problem)
    if not any(c.cell_type == "code" and c.source.strip() for c in nb.cells):
        return all_as("missing", "the notebook has no code")
    hidden = hidden_tests(chapter, Path(solutions) if solutions is not None else None)

    with tempfile.TemporaryDirectory(prefix="attncourse-grade-") as tmp:
        km = kernel_manager()
        client = _Client.make(nb, cell_timeout, km, tmp)
        notes = []
        with _kernel(client, km):
            deadline = time.monotonic() + timeout
            session = _Session(client, Path(tmp), cell_timeout, deadline)
            try:
                for index, cell in enumerate(nb.cells):
                    if cell.cell_type != "code" or _is_check_cell(cell):
                        continue  # the grader runs its own checks, not the submission's check cells
                    if time.monotonic() > deadline:
                        notes.append(f"notebook time limit ({timeout:g} s) reached at cell {index}; later cells not run")
                        break
                    limit = session.limit()
                    if not _execute(client, cell, index, limit):
                        notes.append(f"cell {index} exceeded {limit:g} s and was interrupted")
                    cell.outputs = []
                _run_extra(client, KERNEL_SIDE, cell_timeout)
                for ex in exercises:
                    result.exercises.append(session.grade(ex, hidden.get(ex.id, ())))
            except (DeadKernelError, KernelStuck) as err:
                done = {e.id for e in result.exercises}
                status = "timeout" if isinstance(err, KernelStuck) else "error"
                why = "the kernel ignored an interrupt and was stopped" if status == "timeout" else "the kernel died"
                result.exercises += [ExerciseResult(ex.id, 0.0, ex.points, status, why)
                                     for ex in exercises if ex.id not in done]
                notes.append(why)
        if client.printed > LOUD_BYTES:
            notes.append(f"the notebook printed {client.printed / 1e6:.1f} MB of output (discarded)")
    result.score = float(sum(e.points for e in result.exercises))
    result.message = "; ".join(notes)
    result.seconds = time.perf_counter() - start
    return result


@contextmanager
def _kernel(client, km):
    try:
        with client.setup_kernel():
            yield
    finally:
        shutdown(km)


def _is_check_cell(cell) -> bool:
    meta = cell.metadata.get("nbgrader", {})
    return bool(meta.get("grade")) and not meta.get("solution")


class KernelStuck(Exception):
    """The kernel did not come back after an interrupt."""


def _execute(client, cell, index: int, cell_timeout: float) -> bool:
    """Run one cell; on timeout interrupt the kernel and return False. Raise KernelStuck if it stays busy."""
    from nbclient.exceptions import CellTimeoutError

    saved = client.timeout
    client.timeout = cell_timeout
    try:
        client.execute_cell(cell, index)
        return True
    except CellTimeoutError:
        run_sync(client.km.interrupt_kernel)()
    finally:
        client.timeout = saved
    probe = nbformat.v4.new_code_cell("pass")
    client.timeout = 10
    try:
        client.execute_cell(probe, index)  # answered only once the interrupted cell has stopped
    except CellTimeoutError:
        raise KernelStuck() from None
    finally:
        client.timeout = saved
        client.nb.cells[index] = cell
    return False


def _run_extra(client, source: str, cell_timeout: float) -> tuple[nbformat.NotebookNode, bool]:
    """Execute grader code in the student's kernel as an extra cell appended to the notebook."""
    cell = nbformat.v4.new_code_cell(source)
    client.nb.cells.append(cell)
    finished = _execute(client, cell, len(client.nb.cells) - 1, cell_timeout)
    return cell, finished


def grade_safely(path: Path, cell_timeout: float = 60, timeout: float = 600, *, solutions: Path | None = SOLUTIONS,
                 student: str = "", chapter: str | None = None) -> NotebookResult:
    """`grade_notebook`, but a failure of the grader itself is reported as the notebook's result."""
    try:
        return grade_notebook(path, cell_timeout, timeout, solutions=solutions, student=student, chapter=chapter)
    except Exception as err:  # never let one submission stop the class
        return _grader_failure(path, student, f"the grader failed on this notebook ({type(err).__name__}: {str(err)[:300]})",
                               chapter)


def _grader_failure(path: Path, student: str, message: str, chapter: str | None = None) -> NotebookResult:
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception:
        nb = None
    chapter = chapter or chapter_of(Path(path), nb) or _chapter_in_text(Path(path))
    exercises = checks.exercises_for(chapter) if chapter else []
    return NotebookResult(str(path), 0.0, float(sum(e.points for e in exercises)),
                          [ExerciseResult(e.id, 0.0, e.points, "error", message) for e in exercises],
                          message, 0.0, student or Path(path).stem)


# ----------------------------------------------------------------------------- a whole class


def collect(paths: list[Path]) -> list[tuple[Path, str]]:
    """(notebook, student) for every notebook named or found under the folders named."""
    found = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            for q in sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts):
                rel = q.relative_to(p)
                found.append((q, rel.parts[0] if len(rel.parts) > 1 else q.stem))
        else:
            found.append((p, p.stem))
    return found


def grade_all(items: list[tuple[Path, str]], *, jobs: int = 1, cell_timeout: float = 60, timeout: float = 600,
              solutions: Path | None = SOLUTIONS, chapter: str | None = None, progress: bool = True,
              on_result=None, isolate: bool = True) -> list[NotebookResult]:
    """Grade every (notebook, student), `jobs` at a time, in worker processes; results in input order.

    Each kernel is a child of the worker grading it, so a notebook that kills its parent process kills
    a worker, never this process; the notebooks that worker had in hand are graded again one at a time
    in fresh workers, and the one that kills its worker again is reported as such. `isolate=False`
    grades in this process instead (one at a time)."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool
    import multiprocessing

    from tqdm.auto import tqdm

    results: list[NotebookResult | None] = [None] * len(items)
    bar = tqdm(total=len(items), unit="notebook", desc="grading", file=sys.stderr, disable=not progress)
    kwargs = {"solutions": solutions, "chapter": chapter}

    def done(i: int, res: NotebookResult) -> None:
        results[i] = res
        bar.update(1)
        if on_result:
            on_result(res, bar)

    if not isolate:
        for i, (path, student) in enumerate(items):
            done(i, grade_safely(path, cell_timeout, timeout, student=student, **kwargs))
    else:
        # "spawn": workers must not inherit this process's torch thread pools (fork + OpenMP can hang)
        ctx = multiprocessing.get_context("spawn")
        crashed = []
        with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx) as pool:
            futures = {pool.submit(grade_safely, path, cell_timeout, timeout, student=student, **kwargs): i
                       for i, (path, student) in enumerate(items)}
            for future in as_completed(futures):
                i = futures[future]
                try:
                    done(i, future.result())
                except BrokenProcessPool:
                    crashed.append(i)
                except Exception as err:
                    path, student = items[i]
                    done(i, _grader_failure(path, student, f"the grader failed on this notebook ({err!r:.300})", chapter))
        for i in sorted(crashed):  # a worker died: grade each affected notebook again, alone
            path, student = items[i]
            try:
                with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                    res = pool.submit(grade_safely, path, cell_timeout, timeout, student=student, **kwargs).result()
            except Exception as err:
                res = _grader_failure(path, student, "the grading process died while running this notebook (did it "
                                      f"kill its parent process or exhaust memory?) ({type(err).__name__})", chapter)
            done(i, res)
    bar.close()
    return results  # type: ignore[return-value]


# ----------------------------------------------------------------------------- reports


def to_json(results: list[NotebookResult]) -> list[dict]:
    return [{"notebook": r.notebook, "student": r.student, "score": r.score, "max_score": r.max_score,
             "message": r.message, "seconds": round(r.seconds, 1), "exercises": [asdict(e) for e in r.exercises]}
            for r in results]


def write_csv_long(results: list[NotebookResult], path: Path) -> None:
    """One row per student and exercise."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", "notebook", "exercise", "points", "max_points", "status", "message"])
        for r in results:
            if not r.exercises:
                w.writerow([r.student, r.notebook, "", 0.0, 0.0, "error", r.message])
            for e in r.exercises:
                w.writerow([r.student, r.notebook, e.id, e.points, e.max_points, e.status, e.message])


def write_gradebook(results: list[NotebookResult], path: Path) -> None:
    """One row per student: student, a column per exercise id (points), total, max_total.

    An exercise graded twice for the same student (two submissions of one chapter) keeps the higher
    score, and a warning is printed."""
    order = {ex_id: n for n, ex_id in enumerate(checks.registry())}
    columns: dict[str, float] = {}
    rows: dict[str, dict[str, float]] = {}
    for r in results:
        row = rows.setdefault(r.student, {})
        for e in r.exercises:
            columns[e.id] = e.max_points
            if e.id in row:
                print(f"warning: {r.student} has more than one submission with {e.id}; keeping the higher score",
                      file=sys.stderr)
            row[e.id] = max(row.get(e.id, 0.0), e.points)
    ids = sorted(columns, key=lambda i: (order.get(i, len(order)), i))
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", *ids, "total", "max_total"])
        max_total = sum(columns.values())
        for student in sorted(rows):
            row = rows[student]
            w.writerow([student, *(f"{row[i]:g}" if i in row else "" for i in ids),
                        f"{sum(row.values()):g}", f"{max_total:g}"])


_MARK = {"passed": "✓ passed", "failed": "✗ failed", "error": "✗ error", "timeout": "✗ timeout", "missing": "– missing"}


def feedback_markdown(r: NotebookResult) -> str:
    """What passed, what failed and why, for the student."""
    reg = checks.registry()
    lines = [f"# Feedback: {Path(r.notebook).name}", "",
             f"Student: **{r.student}** · autograded score: **{r.score:g} / {r.max_score:g}**", ""]
    if r.message:
        lines += [f"Note from the grader: {r.message}", ""]
    if r.exercises:
        lines += ["| exercise | points | result |", "| --- | --- | --- |"]
        lines += [f"| {e.id} | {e.points:g} / {e.max_points:g} | {_MARK.get(e.status, e.status)} |" for e in r.exercises]
        lines.append("")
    todo = [e for e in r.exercises if e.status != "passed"]
    if todo:
        lines += ["## What to look at", ""]
        for e in todo:
            ex = reg.get(e.id)
            lines += [f"### {e.id} ({_MARK.get(e.status, e.status)})", ""]
            if ex is not None and ex.title:
                lines += [ex.title.strip(), ""]
            lines += ["```text", e.message, "```", ""]
            if ex is not None and ex.hint:
                lines += [f"Hint: {ex.hint}", ""]
    elif r.exercises:
        lines += ["Every autograded exercise passed.", ""]
    lines += ["Written answers are graded by hand and are not part of this score. The grader ran its own "
              "checks (and some hidden ones), so run the check cells in your notebook to reproduce a failure.", ""]
    return "\n".join(lines)


def _safe(name: str) -> str:
    return re.sub(r"[^\w.@+-]", "_", name).strip(".") or "student"


def write_feedback(results: list[NotebookResult], folder: Path) -> list[Path]:
    """DIR/<student>/<notebook>.md for every result (-2, -3 ... when a student has two of the same name)."""
    written = []
    for r in results:
        out = Path(folder) / _safe(r.student) / f"{_safe(Path(r.notebook).stem)}.md"
        n = 1
        while out in written:
            n += 1
            out = out.with_name(f"{_safe(Path(r.notebook).stem)}-{n}.md")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(feedback_markdown(r), encoding="utf-8")
        written.append(out)
    return written


def _print_result(res: NotebookResult, bar=None) -> None:
    lines = [f"{res.notebook} [{res.student}]: {res.score:g} / {res.max_score:g}" + (f"  ({res.message})" if res.message else "")]
    lines += [f"  {e.status:<8} {e.points:g}/{e.max_points:g}  {e.id}: {e.message}" for e in res.exercises]
    from tqdm.auto import tqdm

    for line in lines:
        tqdm.write(line, file=sys.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attncourse.grade", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="notebooks or folders of submissions")
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    parser.add_argument("--csv", type=Path, help="write a gradebook (one row per student) to this CSV file")
    parser.add_argument("--csv-long", type=Path, help="write one row per student and exercise to this CSV file")
    parser.add_argument("--feedback", type=Path, metavar="DIR", help="write DIR/<student>/<notebook>.md feedback")
    parser.add_argument("--jobs", "-j", type=int, default=1, help="notebooks graded in parallel (default 1)")
    parser.add_argument("--cell-timeout", type=float, default=60, help="seconds per cell (default 60)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per notebook (default 600)")
    parser.add_argument("--solutions", type=Path, default=SOLUTIONS,
                        help="folder of solution notebooks holding hidden tests (default: the course's solutions/)")
    parser.add_argument("--chapter", help="grade every notebook as this chapter (e.g. 03) instead of reading "
                                          "it from each notebook's metadata, grade ids or file name")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar on stderr (default: when stderr is a terminal)")
    args = parser.parse_args(argv)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # nbclient's abandoned pollers after timeouts

    items = collect(args.paths)
    missing = [str(p) for p, _ in items if not p.exists()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    if not items:
        parser.error("no notebooks found")
    if not args.solutions.is_dir():
        print(f"note: no solutions folder at {args.solutions}: hidden tests are not run", file=sys.stderr)
    checks.registry()  # import every chapter's checks before any student code runs
    results = grade_all(items, jobs=max(1, args.jobs), cell_timeout=args.cell_timeout, timeout=args.timeout,
                        solutions=args.solutions, chapter=args.chapter, on_result=_print_result,
                        progress=sys.stderr.isatty() if args.progress is None else args.progress)
    if args.json:
        args.json.write_text(json.dumps(to_json(results), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if args.csv:
        write_gradebook(results, args.csv)
    if args.csv_long:
        write_csv_long(results, args.csv_long)
    if args.feedback:
        write_feedback(results, args.feedback)
    total = sum(r.score for r in results)
    print(f"graded {len(results)} notebook(s) of {len({r.student for r in results})} student(s); "
          f"mean score {total / len(results):.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
