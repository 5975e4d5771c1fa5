"""Calls into the student's kernel: what runs there, how its replies are judged here, and the proxy hidden
tests call.

The grader builds the cases in its own process and sends only their inputs to the kernel (``torch.save``);
:data:`KERNEL_SIDE` calls the student's function there under the same call guard as the check cell
(:mod:`attncourse.classroom.checks.forbidden`, whose source it carries) and saves the results, loaded back
here with ``torch.load(weights_only=True)``: tensors and plain data only, with the guard's trace of what the
answer ran. :func:`judge` compares them with the expected values computed here, through the same
``checks.feedback`` and property (``checks.judge_property``) as the check cell.
"""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import checks
from ..checks import copies, forbidden, salting

if TYPE_CHECKING:
    from .session import Session

# Runs inside the student's kernel. Self-contained (stdlib, torch, numpy and the guard's own source) so that
# nothing the notebook patched in attncourse changes how answers are called; built inside a function so that
# it leaves one name in the notebook's namespace, `__attncourse_grade`.
_KERNEL_TEMPLATE = r'''
def __attncourse_make(guard_source, salt_source, copies_source):
    import types
    copies = types.ModuleType("attncourse_copies")
    exec(compile(copies_source, "<attncourse copies>", "exec"), copies.__dict__)
    guard_namespace = {"__name__": "attncourse_call_guard", "copies": copies}
    exec(compile(guard_source, "<attncourse call guard>", "exec"), guard_namespace)
    run = guard_namespace["run"]
    salt_namespace = {"__name__": "attncourse_salted_seeds"}
    exec(compile(salt_source, "<attncourse salted seeds>", "exec"), salt_namespace)
    salted = salt_namespace["salted"]

    def grade(inputs_path, results_path, target, kind, numpy_args, policy, salt=None):
        import sys, torch, numpy, difflib
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
        results = []
        for index, (args, kwargs) in enumerate(torch.load(inputs_path, weights_only=True)):
            with open(results_path + ".at", "w") as at: at.write(str(index))  # which case, if the time limit stops it
            if numpy_args:
                as_np = lambda a: a.numpy() if isinstance(a, torch.Tensor) else a
                args = tuple(as_np(a) for a in args)
                kwargs = {k: as_np(a) for k, a in kwargs.items()}
            if not isinstance(policy, dict):  # a grader from before policies: a tuple of forbidden names
                policy = {"forbid": tuple(policy), "library": False}
            with salted(salt):  # the seeds the grader's reference met (salting.py)
                ran = run(answer, args, kwargs, policy, ns)  # KeyboardInterrupt (the time limit) is not caught
            if ran["used"]: results.append(("forbidden", ran["used"][0], "")); continue
            error = ran["error"]
            if error is not None: results.append(("raised", type(error).__name__, text(error))); continue
            try: results.append(("ok", portable(ran["result"]), portable(ran["trace"])))
            except Exception as err: results.append(("raised", type(err).__name__, text(err)))
        torch.save({"status": "ok", "results": results}, results_path)

    return grade


__attncourse_grade = __attncourse_make(GUARD_SOURCE, SALT_SOURCE, COPIES_SOURCE)
del __attncourse_make
'''
KERNEL_SIDE = _KERNEL_TEMPLATE.replace("GUARD_SOURCE", repr(Path(forbidden.__file__).read_text(encoding="utf-8"))) \
    .replace("SALT_SOURCE", repr(Path(salting.__file__).read_text(encoding="utf-8"))) \
    .replace("COPIES_SOURCE", repr(Path(copies.__file__).read_text(encoding="utf-8")))


def kernel_call(src: Path, out: Path, ex: checks.Exercise, salt: int | None = None) -> str:
    """The source of the extra cell that runs `ex`'s target on the inputs saved in `src` (its seeds mixed with
    `salt`, as the grader's cases were built: see :mod:`..checks.salting`)."""
    return (f"__attncourse_grade({str(src)!r}, {str(out)!r}, {ex.target!r}, {ex.kind!r}, "
            f"{ex.numpy!r}, {ex.policy!r}, {salt!r})")


def judge(ex: checks.Exercise, cases: list[checks.Case], reply: dict) -> tuple[str, str]:
    """(status, message) for the kernel's reply on `cases`: the same feedback as the check cell."""
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
            return "error", f"case {checks.case_label(case)}: your code raised {result[2]}"
        if result[0] == "forbidden":
            return "failed", f"case {checks.case_label(case)}: {forbidden.message(result[1])}"
        detail = checks.feedback(ex, result[1], case)
        if detail:
            mistake = checks.diagnose(ex, result[1], case)
            return "failed", f"case {checks.case_label(case)}: {detail}" + (f"; this looks like: {mistake}" if mistake else "")
    runs = [checks.Run(case, result[1], result[2] if len(result) > 2 else None)
            for case, result in zip(cases, reply["results"])]
    detail = checks.judge_property(ex, runs)
    if detail:
        return "failed", f"every case gives the right result, but not the way this exercise asks: {detail}"
    return "passed", f"all {checks.gradients.declared(cases)} case(s) passed"


class StudentCall(Exception):
    """The student's function could not answer a call (missing, forbidden, timed out)."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def from_student(name: str, text: str) -> BaseException:
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


def to_transport(x: Any) -> Any:
    import numpy as np

    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, (tuple, list)):
        return type(x)(to_transport(v) for v in x)
    if isinstance(x, dict):
        return {k: to_transport(v) for k, v in x.items()}
    return x


def to_numpy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, (tuple, list)):
        return type(x)(to_numpy(v) for v in x)
    if isinstance(x, dict):
        return {k: to_numpy(v) for k, v in x.items()}
    return x


class Remote:
    """Stands for the student's function inside a hidden test: each call runs in the student's kernel."""

    def __init__(self, session: "Session", ex: checks.Exercise):
        self.session, self.ex, self.calls = session, ex, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        reply = self.session.call(self.ex, [(to_transport(args), to_transport(kwargs))], f"h{self.calls}")
        outcome = reply["results"][0]
        if outcome[0] == "raised":
            raise from_student(outcome[1], outcome[2])
        if outcome[0] == "forbidden":
            raise StudentCall("failed", forbidden.message(outcome[1]))
        return to_numpy(outcome[1]) if self.ex.numpy else outcome[1]
