"""The notebook-time benchmark behind `python -m attncourse.nbtools time`: each notebook run from a fresh kernel,
its wall and CPU seconds and its slowest cells, against the course's budget of 60 s on a 2-core laptop CPU."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat

from .nbtools import run_notebook

BUDGET_S = 60.0  # the course's promise: every notebook's default run, fresh kernel, 2-core laptop CPU


def cell_seconds(nb: nbformat.NotebookNode) -> list[tuple[int, float]]:
    """(cell index, seconds) of each executed code cell, from the timestamps nbclient records while it runs."""
    from datetime import datetime

    out = []
    for i, cell in enumerate(nb.cells):
        t = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in t and "shell.execute_reply" in t:
            start, end = (datetime.fromisoformat(t[k].replace("Z", "+00:00"))
                          for k in ("iopub.execute_input", "shell.execute_reply"))
            out.append((i, (end - start).total_seconds()))
    return out


_CPU_PROBE = ("import resource as _r, json as _j\n"
              "print(_j.dumps(sum(getattr(_r.getrusage(w), f) for w in (_r.RUSAGE_SELF, _r.RUSAGE_CHILDREN) "
              "for f in ('ru_utime', 'ru_stime'))))")


def time_notebook(path: Path, timeout: int = 600) -> tuple[float, float | None, list[tuple[int, float]]]:
    """Run a copy of the notebook at `path` in a fresh kernel (the file is not touched): (wall seconds from
    kernel start to the last reply, the kernel's CPU seconds with its child processes (None where the OS does not
    say), per-cell wall seconds). On a busy machine the wall time grows and the CPU time does not: CPU seconds at
    most the budget mean the notebook fits it on an idle machine's one core."""
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(_CPU_PROBE))
    start = time.perf_counter()
    run_notebook(nb, Path(path).parent, timeout)
    wall = time.perf_counter() - start
    cpu = None
    for out in nb.cells[-1].get("outputs", []):
        if out.get("output_type") == "stream":
            try:
                cpu = float(out["text"].strip().splitlines()[-1])
            except (ValueError, IndexError):  # an empty or foreign stream: no CPU figure
                pass
    return wall, cpu, cell_seconds(nb)[:-1]
