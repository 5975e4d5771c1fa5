"""Grade student notebooks.

    python -m attncourse.grade PATH... [--json FILE] [--cell-timeout S] [--timeout S]

PATH is a notebook or a folder of notebooks. Each notebook runs in its own Jupyter kernel (never in
this process), cell by cell with a time limit, errors and all, except its check cells (nbgrader "grade"
cells without a solution), which the grader replaces with its own checks. Then, for every exercise of its chapter,
the grader builds the cases *here*, sends only their inputs to the kernel, calls the student's function
there, brings the results back (loaded with ``torch.load(weights_only=True)``: tensors and plain data
only) and compares them here with expected values computed here. Check cells, printed "passed" lines
and anything the notebook patches in its own kernel cannot change the verdict.
The exit status is 0 whenever grading finished, whatever the score.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
import json
import logging
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat
import torch
from jupyter_core.utils import run_sync

from . import checks
from .nbtools import kernel_manager, shutdown

_QUIET = logging.getLogger("attncourse.grade.nbclient")
_QUIET.setLevel(logging.CRITICAL)

STATUSES = ("passed", "failed", "error", "timeout", "missing")

# Runs inside the student's kernel. Self-contained (stdlib, torch, numpy) so that nothing the notebook
# patched in attncourse changes how answers are called; wrapped in a function so it leaves no names.
KERNEL_SIDE = r'''
def __attncourse_grade(inputs_path, results_path, target, kind, numpy_args, forbid):
    import sys, torch, numpy, importlib
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
        torch.save({"status": "missing"}, results_path); return
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
        try: banned.append((dotted, getattr(importlib.import_module(mod), attr)))
        except Exception: pass
    used = []
    def watch(frame, event, arg):
        for dotted, fn in banned:
            if (event == "c_call" and arg is fn) or (event == "call" and frame.f_code is getattr(fn, "__code__", None)):
                used.append(dotted)
    results = []
    for args, kwargs in torch.load(inputs_path, weights_only=True):
        if numpy_args: args = tuple(a.numpy() if isinstance(a, torch.Tensor) else a for a in args)
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


def _judge(ex: checks.Exercise, cases: list[checks.Case], reply: dict) -> tuple[str, str]:
    status = reply.get("status")
    if status == "missing":
        return "missing", f"`{ex.target}` is not defined in the notebook"
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


def grade_notebook(path: Path, cell_timeout: float = 60, timeout: float = 600) -> NotebookResult:
    """Grade one notebook; never raises for anything the notebook does."""
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    start = time.perf_counter()
    try:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        problem = ""
    except Exception as err:
        nb, problem = None, f"not a readable notebook ({type(err).__name__}: {str(err)[:200]})"
    chapter = chapter_of(path, nb)
    exercises = checks.exercises_for(chapter) if chapter else []
    result = NotebookResult(str(path), 0.0, float(sum(ex.points for ex in exercises)))
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

    with tempfile.TemporaryDirectory(prefix="attncourse-grade-") as tmp:
        km = kernel_manager()
        client = NotebookClient(nb, timeout=cell_timeout, allow_errors=True, interrupt_on_timeout=False,
                                kernel_name="python3", km=km, resources={"metadata": {"path": tmp}})
        client.log = _QUIET  # nbclient logs tracebacks for the timeouts we handle ourselves
        notes = []
        with _kernel(client, km):
            deadline = time.monotonic() + timeout
            try:
                for index, cell in enumerate(nb.cells):
                    if cell.cell_type != "code" or _is_check_cell(cell):
                        continue  # the grader runs its own checks, not the submission's check cells
                    if time.monotonic() > deadline:
                        notes.append(f"notebook time limit ({timeout:g} s) reached at cell {index}; later cells not run")
                        break
                    if not _execute(client, cell, index, cell_timeout):
                        notes.append(f"cell {index} exceeded {cell_timeout:g} s and was interrupted")
                    cell.outputs = []  # keep memory flat whatever the student prints
                _run_extra(client, KERNEL_SIDE, cell_timeout)
                for ex in exercises:
                    result.exercises.append(_grade_exercise(client, ex, Path(tmp), cell_timeout))
            except (DeadKernelError, KernelStuck) as err:
                done = {e.id for e in result.exercises}
                status = "timeout" if isinstance(err, KernelStuck) else "error"
                why = "the kernel ignored an interrupt and was stopped" if status == "timeout" else "the kernel died"
                result.exercises += [ExerciseResult(ex.id, 0.0, ex.points, status, why)
                                     for ex in exercises if ex.id not in done]
                notes.append(why)
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

    try:
        client.execute_cell(cell, index)
        return True
    except CellTimeoutError:
        run_sync(client.km.interrupt_kernel)()
    probe = nbformat.v4.new_code_cell("pass")
    saved, client.timeout = client.timeout, 10
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


def _grade_exercise(client, ex: checks.Exercise, tmp: Path, cell_timeout: float) -> ExerciseResult:
    cases = ex.make_cases()
    inputs, results = tmp / f"{ex.id}.in.pt", tmp / f"{ex.id}.out.pt"
    torch.save([(tuple(c.args), dict(c.kwargs)) for c in cases], inputs)
    results.unlink(missing_ok=True)
    call = (f"__attncourse_grade({str(inputs)!r}, {str(results)!r}, {ex.target!r}, {ex.kind!r}, "
            f"{ex.numpy!r}, {tuple(ex.forbid)!r})")
    cell, finished = _run_extra(client, call, cell_timeout)
    if not finished:
        return ExerciseResult(ex.id, 0.0, ex.points, "timeout", f"checking took longer than {cell_timeout:g} s")
    if not results.exists():
        errors = [o.get("evalue", "") for o in cell.outputs if o.get("output_type") == "error"]
        return ExerciseResult(ex.id, 0.0, ex.points, "error",
                              "the answer could not be evaluated" + (f": {errors[0][:300]}" if errors else ""))
    try:
        reply = torch.load(results, weights_only=True)
        status, message = _judge(ex, cases, reply)
    except Exception as err:
        status, message = "error", f"the answer's result could not be read ({type(err).__name__}: {str(err)[:200]})"
    return ExerciseResult(ex.id, ex.points if status == "passed" else 0.0, ex.points, status, message)


def _collect(paths: list[Path]) -> list[Path]:
    found = []
    for p in paths:
        if p.is_dir():
            found += sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        else:
            found.append(p)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attncourse.grade", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="notebooks or folders of notebooks")
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    parser.add_argument("--cell-timeout", type=float, default=60, help="seconds per cell (default 60)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per notebook (default 600)")
    args = parser.parse_args(argv)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # nbclient's abandoned pollers after timeouts

    notebooks = _collect(args.paths)
    missing = [p for p in notebooks if not p.exists()]
    if missing:
        parser.error(f"no such file: {', '.join(map(str, missing))}")
    results = []
    for path in notebooks:
        res = grade_notebook(path, args.cell_timeout, args.timeout)
        results.append(res)
        print(f"{res.notebook}: {res.score:g} / {res.max_score:g}" + (f"  ({res.message})" if res.message else ""))
        for e in res.exercises:
            print(f"  {e.status:<8} {e.points:g}/{e.max_points:g}  {e.id}: {e.message}")
    if args.json:
        payload = [{k: v for k, v in asdict(r).items() if k != "seconds"} for r in results]
        args.json.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
