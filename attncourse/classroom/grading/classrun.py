"""A whole class: find the submissions, grade them in parallel worker processes, survive the ones that kill
their worker."""

from __future__ import annotations

import sys
from pathlib import Path

from .notebook import grade_safely, grader_failure
from .results import SOLUTIONS, NotebookResult


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


def _quiet_asyncio() -> None:
    """In a spawned worker: nbclient's output pollers abandoned after an interrupted cell end in "Task exception was
    never retrieved" tracebacks on the console; the grade already says what happened (as main() does in-process)."""
    import logging

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def grade_all(items: list[tuple[Path, str]], *, jobs: int = 1, cell_timeout: float = 60, timeout: float = 600,
              solutions: Path | None = SOLUTIONS, chapter: str | None = None, progress: bool = True,
              on_result=None, isolate: bool = True, salt: int | None = None) -> list[NotebookResult]:
    """Grade every (notebook, student), `jobs` at a time, in worker processes; results (and the calls to
    `on_result`) in input order.

    Each kernel is a child of the worker grading it, so a notebook that kills its parent process kills
    a worker, never this process; the notebooks that worker had in hand are graded again one at a time
    in fresh workers, and the one that kills its worker again is reported as such. `isolate=False`
    grades in this process instead (one at a time)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    from tqdm.auto import tqdm

    results: list[NotebookResult | None] = [None] * len(items)
    bar = tqdm(total=len(items), unit="notebook", desc="grading", file=sys.stderr, disable=not progress)
    kwargs = {"solutions": solutions, "chapter": chapter, "salt": salt}

    shown = [0]  # results before this index have been handed to on_result

    def done(i: int, res: NotebookResult) -> None:
        results[i] = res
        bar.update(1)
        # on_result sees the results in input order (a stable console), each as soon as all before it are in
        while shown[0] < len(results) and results[shown[0]] is not None:
            if on_result:
                on_result(results[shown[0]], bar)
            shown[0] += 1

    if not isolate:
        for i, (path, student) in enumerate(items):
            done(i, grade_safely(path, cell_timeout, timeout, student=student, **kwargs))
    else:
        # "spawn": workers must not inherit this process's torch thread pools (fork + OpenMP can hang)
        ctx = multiprocessing.get_context("spawn")
        crashed = []
        with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx, initializer=_quiet_asyncio) as pool:
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
                    done(i, grader_failure(path, student, f"the grader failed on this notebook ({err!r:.300})", chapter))
        for i in sorted(crashed):  # a worker died: grade each affected notebook again, alone
            path, student = items[i]
            try:
                with ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_quiet_asyncio) as pool:
                    res = pool.submit(grade_safely, path, cell_timeout, timeout, student=student, **kwargs).result()
            except Exception as err:
                res = grader_failure(path, student, "the grading process died while running this notebook (did it "
                                     f"kill its parent process or exhaust memory?) ({type(err).__name__})", chapter)
            done(i, res)
    bar.close()
    return results  # type: ignore[return-value]
