"""One student kernel: run the notebook's cells with time limits, and make the grader's calls into it.

Each notebook runs in its own Jupyter kernel (never in the grading process), cell by cell with a per-cell and
a per-notebook time limit. The client keeps no output except errors, so memory stays flat whatever the
notebook prints; it counts the bytes it dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import contextmanager
from pathlib import Path

import nbformat
import torch
from jupyter_core.utils import run_sync

from .. import checks
from ..checks.salting import salted
from ..nbtools import shutdown
from .remote import StudentCall, judge, kernel_call
from .results import ExerciseResult

_QUIET = logging.getLogger("attncourse.grade.nbclient")
_QUIET.setLevel(logging.CRITICAL)


PROBE_S = 30  # how long an interrupted kernel may take to answer (a loaded machine needs more than 10 s)


class KernelStuck(Exception):
    """The kernel did not come back after an interrupt."""


def make_client(nb, cell_timeout, km, tmp):
    """An nbclient NotebookClient that keeps no output except errors and counts the bytes it dropped."""
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


@contextmanager
def running(client, km):
    """The client's kernel, started, and stopped afterwards whatever happened."""
    try:
        with client.setup_kernel():
            yield
    finally:
        shutdown(km)


def is_check_cell(cell) -> bool:
    meta = cell.metadata.get("nbgrader", {})
    return bool(meta.get("grade")) and not meta.get("solution")


async def _stop_stale_output_readers() -> None:
    """Cancel the output reader nbclient leaves running after a cell's timeout. nbclient does not cancel it on a
    CellTimeoutError, and its event loop persists between cells, so the stale reader kept taking the kernel's
    messages: every later cell's reader then missed its "idle" and waited nbclient's iopub timeout, 4 s per cell
    and per graded exercise for the rest of the notebook (and a later cell's output could go to the stale reader)."""
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task() and \
                getattr(task.get_coro(), "__qualname__", "").endswith("._async_poll_output_msg"):
            task.cancel()
    await asyncio.sleep(0)  # let the cancellations run


def execute(client, cell, index: int, cell_timeout: float) -> bool:
    """Run one cell; on timeout interrupt the kernel and return False. Raise KernelStuck if it stays busy."""
    from nbclient.exceptions import CellTimeoutError

    saved = client.timeout
    client.timeout = cell_timeout
    try:
        client.execute_cell(cell, index)
        return True
    except CellTimeoutError:
        run_sync(client.km.interrupt_kernel)()
        run_sync(_stop_stale_output_readers)()
    finally:
        client.timeout = saved
    probe = nbformat.v4.new_code_cell("pass")
    client.timeout = PROBE_S
    try:
        client.execute_cell(probe, index)  # answered only once the interrupted cell has stopped
    except CellTimeoutError:
        raise KernelStuck() from None
    finally:
        client.timeout = saved
        client.nb.cells[index] = cell
    return False


def run_extra(client, source: str, cell_timeout: float) -> tuple[nbformat.NotebookNode, bool]:
    """Execute grader code in the student's kernel as an extra cell appended to the notebook, then taken out again
    (the report numbers the learner's cells as JupyterLab shows them: the grader's own cells are not among them)."""
    cell = nbformat.v4.new_code_cell(source)
    client.nb.cells.append(cell)
    try:
        finished = execute(client, cell, len(client.nb.cells) - 1, cell_timeout)
    finally:  # by identity: an equal cell of the learner's must stay
        client.nb.cells[:] = [c for c in client.nb.cells if c is not cell]
    return cell, finished


def _timeout_message(ex: checks.Exercise, limit: float, at: Path, names: list[str] | None) -> str:
    """What a student reads when the time limit stopped their answer: which function, on which case."""
    try:
        index = int(at.read_text())
    except (OSError, ValueError):
        index = None
    if ex.kind == "value" or index is None:
        return f"checking took longer than {limit:g} s"
    case = f" on case {names[index]}" if names and 0 <= index < len(names) else ""
    return f"{ex.target} did not return within {limit:g} s{case} (an endless loop, or far more work than it needs?)"


class Session:
    """One student kernel, and the calls the grader makes into it."""

    def __init__(self, client, tmp: Path, cell_timeout: float, deadline: float, salt: int | None = None):
        self.client, self.tmp, self.cell_timeout, self.deadline = client, tmp, cell_timeout, deadline
        self.salt = salt  # the registry's cases are built with their seeds mixed with it (checks/salting.py)

    def limit(self) -> float:
        return max(1.0, min(self.cell_timeout, self.deadline - time.monotonic()))

    def call(self, ex: checks.Exercise, inputs: list, tag: str, salt: int | None = None,
             names: list[str] | None = None) -> dict:
        """Run ex's target on `inputs` in the kernel (seeds mixed with `salt`); the reply dict, or raise
        StudentCall. `names` label the inputs in a timeout's message (which case the answer did not return on)."""
        if time.monotonic() > self.deadline:
            raise StudentCall("timeout", "the notebook's time limit was reached before this check ran")
        src, out = self.tmp / f"{ex.id}.{tag}.in.pt", self.tmp / f"{ex.id}.{tag}.out.pt"
        torch.save(inputs, src)
        out.unlink(missing_ok=True)
        at = Path(str(out) + ".at")
        at.unlink(missing_ok=True)
        limit = self.limit()
        cell, finished = run_extra(self.client, kernel_call(src, out, ex, salt), limit)
        if not finished:
            raise StudentCall("timeout", _timeout_message(ex, limit, at, names))
        if not out.exists():
            errors = [o.get("evalue", "") for o in cell.outputs if o.get("output_type") == "error"]
            raise StudentCall("error", "the answer could not be evaluated" + (f": {errors[0][:300]}" if errors else ""))
        try:
            reply = torch.load(out, weights_only=True)
        except Exception as err:
            raise StudentCall("error", f"the answer's result could not be read ({type(err).__name__}: {str(err)[:200]})")
        if reply.get("status") == "missing":
            raise StudentCall(*judge(ex, [], reply))
        return reply

    def grade(self, ex: checks.Exercise, hidden: tuple[str, ...]) -> ExerciseResult:
        """The registry's cases, then (if they pass) the exercise's hidden tests."""
        from .hidden import run_hidden

        def result(status: str, message: str) -> ExerciseResult:
            return ExerciseResult(ex.id, ex.points if status == "passed" else 0.0, ex.points, status, message)

        with salted(self.salt):  # inputs and expected values the notebook has never seen
            cases = ex.make_cases()
        try:  # a dead or stuck kernel propagates: grade_notebook marks the rest of the notebook
            reply = self.call(ex, [(tuple(c.args), dict(c.kwargs)) for c in cases], "cases", self.salt,
                              [checks.case_label(c) for c in cases])
        except StudentCall as err:
            return result(err.status, err.message)
        try:
            status, message = judge(ex, cases, reply)
        except Exception as err:
            return result("error", f"the answer's result could not be judged ({type(err).__name__}: {str(err)[:200]})")
        if status != "passed" or not hidden:
            return result(status, message)
        for number, source in enumerate(hidden, 1):
            status, detail = run_hidden(self, ex, source, number)
            if status != "passed":
                return result(status, detail)
        return result("passed", f"{message}; {len(hidden)} hidden test(s) passed")
