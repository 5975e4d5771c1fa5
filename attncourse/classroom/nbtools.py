"""Maintainer commands for the notebooks.

    python -m attncourse.nbtools exercises          # regenerate exercises/ from solutions/
    python -m attncourse.nbtools execute [PATH...]  # re-run notebooks in place, in fresh kernels
    python -m attncourse.nbtools refresh            # execute notebooks/ and solutions/, then exercises
    python -m attncourse.nbtools time [PATH...] [--budget 60]  # wall and CPU seconds per notebook, slowest cells
    python -m attncourse.nbtools normalize [PATH...]  # notebook metadata only (see `normalize`)
    python -m attncourse.nbtools nbgrader-source COURSE  # COURSE/source/psNN/ for nbgrader (solution-only cells out)

`solutions/` is the single source of the exercise notebooks. Solution code sits between
``### BEGIN SOLUTION`` and ``### END SOLUTION`` (nbgrader's markup) and becomes a stub that raises
``NotImplementedError``; ``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS`` blocks are dropped, and so are
whole cells tagged ``solution-only`` (a bug's explanation, a prediction's worked answer).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
CODE_STUB = ["# YOUR CODE HERE", "raise NotImplementedError()"]
MARKDOWN_STUB = ["YOUR ANSWER HERE"]
# What ipykernel's kernelspec "python3" calls itself: JupyterLab rewrites a different display name when it starts
# the kernel, and the notebook then opens marked as modified.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
# A cell tagged so (a bug's explanation, a prediction's worked answer) is left out of the exercise notebook.
SOLUTION_ONLY = "solution-only"
# JupyterLab's (and nbclient's) cell tag for "an error here does not stop Run All".
RUN_ON = "raises-exception"


def is_check_cell(cell) -> bool:
    meta = cell.metadata.get("nbgrader", {})
    return cell.cell_type == "code" and bool(meta.get("grade")) and not meta.get("solution")


def normalize(nb: nbformat.NotebookNode) -> bool:
    """Fix the metadata JupyterLab reads, in place; True if anything changed. Never touches sources or outputs.

    * the kernelspec is :data:`KERNELSPEC`, so that a notebook does not open marked as modified;
    * check cells get JupyterLab's ``editable: false`` and ``deletable: false`` beside nbgrader's ``locked``;
    * in an exercise notebook (generated from solutions/), every code cell from the first answer cell on is tagged
      ``raises-exception``: Run All goes past an exercise not attempted yet (its check shows two lines, see
      :func:`attncourse.classroom.checks.check`) and past a demo cell that calls it, to the cells that can run.
    """
    before = nbformat.writes(nb)
    nb.metadata.kernelspec = dict(KERNELSPEC)
    exercise = "generated_from" in nb.metadata.get("attncourse", {})
    answering = False
    for cell in nb.cells:
        if is_check_cell(cell):
            cell.metadata["editable"] = False
            cell.metadata["deletable"] = False
        answering = answering or (cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("solution", False))
        if exercise and answering and cell.cell_type == "code" and RUN_ON not in cell.metadata.get("tags", []):
            cell.metadata["tags"] = [*cell.metadata.get("tags", []), RUN_ON]
    return nbformat.writes(nb) != before


def normalize_files(paths: list[Path]) -> list[Path]:
    """Normalize notebooks on disk; return those that changed."""
    changed = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        if normalize(nb):
            nbformat.write(nb, path)
            changed.append(path)
    return changed


def _strip_region(lines: list[str], begin: str, end: str, stub: list[str] | None, where: str) -> list[str]:
    out, inside = [], False
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped == begin:
            if inside:
                raise ValueError(f"{where}: line {number}: nested {begin!r}")
            inside = True
            if stub is not None:
                indent = line[: len(line) - len(line.lstrip())]
                out.extend(indent + s for s in stub)
        elif stripped == end:
            if not inside:
                raise ValueError(f"{where}: line {number}: {end!r} without {begin!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: {begin!r} is never closed")
    return out


def student_source(source: str, cell_type: str, where: str = "cell") -> str:
    """The student version of one cell's source: solutions stubbed, hidden tests removed."""
    lines = source.split("\n")
    stub = CODE_STUB if cell_type == "code" else MARKDOWN_STUB
    lines = _strip_region(lines, BEGIN_SOLUTION, END_SOLUTION, stub, where)
    lines = _strip_region(lines, BEGIN_HIDDEN, END_HIDDEN, None, where)
    return "\n".join(lines)


def make_exercise(nb: nbformat.NotebookNode, where: str = "notebook") -> nbformat.NotebookNode:
    """A copy of solution notebook `nb` with solutions stubbed and all outputs cleared."""
    nb = copy.deepcopy(nb)
    nb.cells = [c for c in nb.cells if SOLUTION_ONLY not in c.metadata.get("tags", [])]
    for index, cell in enumerate(nb.cells):
        cell.source = student_source(cell.source, cell.cell_type, f"{where} cell {index}")
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
    nb.metadata.setdefault("attncourse", {})["generated_from"] = "solutions/ (do not edit by hand)"
    normalize(nb)
    return nb


def nbgrader_source(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of solution notebook `nb` for nbgrader's ``source/`` folder: the cells tagged ``solution-only``
    left out (nbgrader would otherwise release a bug's explanation and a prediction's worked answer)."""
    nb = copy.deepcopy(nb)
    nb.cells = [c for c in nb.cells if SOLUTION_ONLY not in c.metadata.get("tags", [])]
    return nb


def write_nbgrader_source(course: Path, root: Path = ROOT) -> list[Path]:
    """Write ``course/source/psNN/NN_topic.ipynb`` for every solutions notebook; return the paths written."""
    written = []
    for src in sorted((root / "solutions").glob("*.ipynb")):
        dst = Path(course) / "source" / f"ps{src.name[:2]}" / src.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nbgrader_source(nbformat.read(src, as_version=4)), dst)
        written.append(dst)
    return written


def _answers(text: str) -> dict[str, str]:
    """The answer cells' sources (nbgrader solution cells) of a notebook's text, by grade id."""
    try:
        nb = nbformat.reads(text, as_version=4)
    except Exception:
        return {"<unreadable>": text}
    return {c.metadata.get("nbgrader", {}).get("grade_id", str(i)): c.source for i, c in enumerate(nb.cells)
            if c.metadata.get("nbgrader", {}).get("solution")}


def keep_learner_work(path: Path, new_text: str | None, root: Path = ROOT) -> Path | None:
    """Before `path` (a file in exercises/) is overwritten with `new_text` (None: deleted): if its answer cells
    hold anything but the new version's stubs (someone answered in it, e.g. before ``./course lab`` gave
    learners their own copies in my-work/), copy it to ``my-work/backups/`` and return the copy. Regenerating
    the exercises never destroys work."""
    if not path.exists():
        return None
    old = path.read_text(encoding="utf-8")
    mine = _answers(old)
    if not mine or (new_text is not None and mine == _answers(new_text)):
        return None
    backup = Path(root) / "my-work" / "backups" / f"{path.stem}.{time.strftime('%Y%m%d-%H%M%S')}{path.suffix}"
    backup.parent.mkdir(parents=True, exist_ok=True)
    backup.write_text(old, encoding="utf-8")
    print(f"note: {path.name} held answers of its own: kept as {backup}", file=sys.stderr)
    return backup


def generate_exercises(root: Path = ROOT, check_only: bool = False) -> list[str]:
    """Write exercises/NN_*.ipynb from solutions/; return the names that were (or would be) changed. A file whose
    answer cells hold anything but stubs is first copied to my-work/backups/ (:func:`keep_learner_work`)."""
    changed = []
    (root / "exercises").mkdir(exist_ok=True)
    sources = sorted((root / "solutions").glob("*.ipynb"))
    for src in sources:
        want = nbformat.writes(make_exercise(nbformat.read(src, as_version=4), src.name)) + "\n"
        dst = root / "exercises" / src.name
        if not dst.exists() or dst.read_text(encoding="utf-8") != want:
            changed.append(dst.name)
            if not check_only:
                keep_learner_work(dst, want, root)
                dst.write_text(want, encoding="utf-8")
    stale = {p.name for p in (root / "exercises").glob("*.ipynb")} - {p.name for p in sources}
    for name in sorted(stale):
        changed.append(name)
        if not check_only:
            keep_learner_work(root / "exercises" / name, None, root)
            (root / "exercises" / name).unlink()
    return changed


# ----------------------------------------------------------------------------- authoring
# Builders for the cells every chapter uses, so nbgrader metadata is identical everywhere.


def _nbgrader(grade_id: str, *, grade: bool, solution: bool, locked: bool, points: float | None = None) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3,
            "solution": solution, "task": False}
    if points is not None:
        meta["points"] = points
    return {"nbgrader": meta}


def md(text: str, *, tags: tuple[str, ...] = ()) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_markdown_cell(text.strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def code(source: str, *, tags: tuple[str, ...] = ()) -> nbformat.NotebookNode:
    """A code cell; tag "nbval-ignore-output" where the output depends on the machine."""
    cell = nbformat.v4.new_code_cell(source.strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def solution(source: str, exercise_id: str) -> nbformat.NotebookNode:
    """The learner's cell: `source` holds ### BEGIN SOLUTION ... ### END SOLUTION."""
    if BEGIN_SOLUTION not in source:
        raise ValueError(f"solution cell for {exercise_id} has no {BEGIN_SOLUTION!r}")
    cell = code(source)
    cell.metadata.update(_nbgrader(f"{exercise_id}-answer", grade=False, solution=True, locked=False))
    return cell


def check_cell(exercise_id: str, points: float, extra: str = "") -> nbformat.NotebookNode:
    """The read-only check cell nbgrader grades: calls attncourse.check on the exercise."""
    cell = code(f'check("{exercise_id}")' + (f"\n{extra}" if extra else ""))
    cell.metadata.update(_nbgrader(exercise_id, grade=True, solution=False, locked=True, points=points))
    cell.metadata.update(editable=False, deletable=False)  # JupyterLab's read-only flags (nbgrader's `locked` is not)
    return cell


def written_answer(text: str, grade_id: str, points: float) -> nbformat.NotebookNode:
    """A markdown answer graded by hand (nbgrader "manually graded answer")."""
    if BEGIN_SOLUTION not in text:
        raise ValueError(f"written answer {grade_id} has no {BEGIN_SOLUTION!r}")
    cell = md(text)
    cell.metadata.update(_nbgrader(grade_id, grade=True, solution=True, locked=False, points=points))
    return cell


def new_notebook(cells: list, chapter: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata.kernelspec = dict(KERNELSPEC)
    nb.metadata.language_info = {"name": "python"}
    nb.metadata.attncourse = {"chapter": chapter}
    return nb


def kernel_manager(env: dict[str, str] | None = None):
    """An async kernel manager (what nbclient needs for its timeouts to work) that starts ipykernel with
    *this* interpreter, whatever kernelspecs are installed (`env`: variables set for the kernel on top of ours)."""
    import os

    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

    # Figures must be drawn inline (they are part of the stored outputs nbval compares): a backend
    # such as MPLBACKEND=Agg inherited from a CI environment would make every plot cell output nothing.
    if "inline" not in os.environ.get("MPLBACKEND", "inline"):
        os.environ.pop("MPLBACKEND")

    class CurrentEnvSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            # log level ERROR: ipykernel's "running over TCP without encryption" warning (a kernel on this
            # machine, started by this process) would otherwise be printed once per notebook
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                                    "--IPKernelApp.log_level=ERROR"],
                              display_name=KERNELSPEC["display_name"], language="python", env=dict(env or {}))

    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnvSpecs())


def shutdown(km) -> None:
    """Stop a kernel started by `kernel_manager` (nbclient leaves kernels it did not create running)."""
    from jupyter_core.utils import run_sync

    try:
        if run_sync(km.is_alive)():
            run_sync(km.shutdown_kernel)(now=True)
    except Exception:  # already gone
        pass


def run_notebook(nb: nbformat.NotebookNode, cwd: Path, timeout: int = 300, allow_errors: bool = False) -> None:
    """Execute `nb` in place in a fresh kernel started in `cwd`, and stop the kernel afterwards."""
    from nbclient import NotebookClient

    km = kernel_manager()
    try:
        NotebookClient(nb, timeout=timeout, allow_errors=allow_errors, kernel_name="python3", km=km,
                       resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        shutdown(km)


def execute(path: Path, timeout: int = 300) -> float:
    """Execute one notebook in place in a fresh kernel (cwd = its folder); return seconds taken."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    run_notebook(nb, path.parent, timeout)
    elapsed = time.perf_counter() - start
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    normalize(nb)
    nbformat.write(nb, path)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    from .timing import BUDGET_S, time_notebook  # the benchmark (it imports this module)

    parser = argparse.ArgumentParser(prog="python -m attncourse.nbtools", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("exercises", help="regenerate exercises/ from solutions/")
    ex.add_argument("--check", action="store_true", help="only report drift; exit 1 if any")
    run = sub.add_parser("execute", help="execute notebooks in place in fresh kernels")
    run.add_argument("paths", nargs="*", type=Path)
    sub.add_parser("refresh", help="execute notebooks/ and solutions/, then regenerate exercises/")
    tm = sub.add_parser("time", help=f"the notebook-time benchmark: run each notebook (default: notebooks/ and "
                                     f"solutions/) from a fresh kernel without writing it; print its time and its "
                                     f"slowest cells; exit 1 if one takes over --budget seconds "
                                     f"(default {BUDGET_S:.0f}) of wall time and of CPU time (kernel and its workers)")
    tm.add_argument("paths", nargs="*", type=Path)
    tm.add_argument("--budget", type=float, default=BUDGET_S)
    norm = sub.add_parser("normalize", help="fix kernelspec and JupyterLab metadata (default: every notebook)")
    norm.add_argument("paths", nargs="*", type=Path)
    norm.add_argument("--check", action="store_true", help="only report; exit 1 if any would change")
    nbg = sub.add_parser("nbgrader-source", help="write an nbgrader course's source/psNN/ from solutions/ "
                                                   "(solution-only cells left out)")
    nbg.add_argument("course", type=Path, help="the nbgrader course folder (its root)")
    args = parser.parse_args(argv)

    if args.command == "nbgrader-source":
        written = write_nbgrader_source(args.course)
        print(f"{len(written)} notebook(s) written under {args.course / 'source'}")
        return 0

    if args.command == "normalize":
        paths = args.paths or sorted(p for d in ("notebooks", "solutions", "exercises") for p in (ROOT / d).glob("*.ipynb"))
        if args.check:
            changed = [p for p in paths if normalize(nbformat.read(p, as_version=4))]
        else:
            changed = normalize_files(paths)
        verb = "to normalize" if args.check else "normalized"
        print(f"{len(changed)} notebook(s) {verb}: {', '.join(Path(p).name for p in changed) or '-'}")
        return 1 if args.check and changed else 0

    if args.command == "exercises":
        changed = generate_exercises(check_only=args.check)
        verb = "out of date" if args.check else "written"
        print(f"{len(changed)} exercise notebook(s) {verb}: {', '.join(changed) or '-'}")
        return 1 if args.check and changed else 0
    paths = getattr(args, "paths", None) or sorted(
        [*(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "solutions").glob("*.ipynb")])
    if args.command == "time":
        over, wall_only = [], []
        for path in paths:
            wall, cpu, cells = time_notebook(Path(path).resolve())
            slow = ", ".join(f"cell {i}: {s:.1f} s" for i, s in sorted(cells, key=lambda c: -c[1])[:4])  # from 0
            # over only if both say so: a busy machine inflates the wall time, threads and workers the CPU time
            flag = "  OVER BUDGET" if wall > args.budget and (cpu is None or cpu > args.budget) else ""
            shown_cpu = "?" if cpu is None else f"{cpu:.1f}"
            print(f"{Path(path).parent.name}/{Path(path).name}: {wall:.1f} s wall, {shown_cpu} s CPU "
                  f"(slowest {slow}){flag}", flush=True)
            if flag:
                over.append(Path(path).name)
            elif wall > args.budget:
                wall_only.append(Path(path).name)
        print(f"{len(over)} notebook(s) over {args.budget:.0f} s of both wall and CPU time: {', '.join(over) or '-'}"
              + (f" ({len(wall_only)} over in wall time only, which a busy machine inflates: {', '.join(wall_only)})"
                 if wall_only else "") + "; cells are numbered from 0, as in the notebook's JSON")
        return 1 if over else 0
    for path in paths:
        shown = path.relative_to(ROOT) if path.is_absolute() and path.is_relative_to(ROOT) else path
        print(f"{shown}: ", end="", flush=True)
        print(f"{execute(Path(path).resolve()):.1f} s", flush=True)
    if args.command == "refresh":
        changed = generate_exercises()
        print(f"{len(changed)} exercise notebook(s) written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
