"""Hidden tests: read from the solutions notebooks, run in the grading process against the student's kernel.

``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS`` blocks in the check cells of ``solutions/NN_*.ipynb``
(the cell's nbgrader ``grade_id`` names the exercise) run after the registry's cases pass. They run in the
grader's process: the exercise's target name is bound to a :class:`~.remote.Remote` proxy that calls the
student's function in the kernel, so the assertions are the grader's own and the notebook cannot patch them.
"""

from __future__ import annotations

import math
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import nbformat
import torch

from .. import checks
from ..nbtools import BEGIN_HIDDEN, END_HIDDEN
from .remote import Remote, StudentCall
from .results import SOLUTIONS, chapter_of

if TYPE_CHECKING:
    from .session import Session


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
    """Hidden test sources by exercise id, from the solutions notebook(s) of `chapter` (none without a
    solutions folder).

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


def run_hidden(session: "Session", ex: checks.Exercise, source: str, number: int) -> tuple[str, str]:
    """(status, message) of one hidden test; a dead or stuck kernel propagates."""
    import numpy as np
    from nbclient.exceptions import DeadKernelError

    from .session import KernelStuck

    if ex.kind == "value":
        try:
            reply = session.call(ex, [((), {})], f"h{number}")
        except StudentCall as err:
            return err.status, f"hidden test {number}: {err.message}"
        target = reply["results"][0][1]
    else:
        target = Remote(session, ex)
    namespace = {"__name__": f"attncourse_hidden_{ex.id}", "torch": torch, "np": np, "math": math,
                 "F": torch.nn.functional, ex.target: target}
    try:
        exec(compile(source, f"<hidden test {number} of {ex.id}>", "exec"), namespace)
    except StudentCall as err:
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
