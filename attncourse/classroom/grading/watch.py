"""While the grader runs a submission's cells, notice a cell that calls the checks' own code.

The guard (:mod:`..checks.forbidden`) watches what an answer runs. It cannot see another cell: a notebook could compute
a prediction with the checker's reference in one cell (``from attncourse.classroom.checks.ch01_influence import
query_moves_weights_reference``) and hand the result in from the answer cell, and both the check cell and the
grader would pass it (cold review 13 of chapters 00-02, 01-query-influence-predict). So before the notebook's first
cell, :data:`WATCH_SIDE` wraps every function of the chapters' check modules (``checks/chNN*.py``) in the kernel: a
call that does not come through the check machinery (``check`` in a cell is fine; a reference, a case builder or
``checks.get(ID).make_cases()`` called from a cell is not) is written to a file. After the cells, :data:`UNWATCH_SIDE`
puts the functions back (the grader's own calls then meet the originals), and :func:`exercises_reached` names the
exercises whose module was reached: the grader gives them no points and says why.

What this does not stop (README, "What the guard cannot see"): code that re-imports the modules afresh
(``importlib.reload``, a copy of their source) gets functions that were never wrapped. That is tampering with the
grader, not a route a learner meets by accident.
"""

from __future__ import annotations

from pathlib import Path

from .. import checks

# Functions of the check modules that exercise notebooks are given to call (a planted test bed, not an answer).
GIVEN = ("attncourse.classroom.checks.ch12.planted_induction_maps",)

WATCH_SIDE = r'''
def __attncourse_watch(hits_path, given):
    import importlib, inspect, os, pkgutil, re, sys
    import attncourse.classroom.checks as package
    base = os.path.dirname(os.path.abspath(package.__file__))
    chapter = re.compile(r"ch\d\d")
    machinery = {os.path.join(base, f) for f in os.listdir(base) if f.endswith(".py") and not chapter.match(f)}
    modules = [importlib.import_module(package.__name__ + "." + m.name)
               for m in pkgutil.iter_modules([base]) if chapter.match(m.name)]
    names = {m.__name__ for m in modules}
    originals, wrappers = [], {}
    helpers = {getattr(importlib.import_module(g.rsplit(".", 1)[0]), g.rsplit(".", 1)[1]).__code__ for g in given}

    def wrap(fn):
        label = fn.__module__.rsplit(".", 1)[-1] + "." + fn.__qualname__

        def watched(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code not in helpers and \
                    os.path.abspath(frame.f_code.co_filename) not in machinery:
                frame = frame.f_back
            if frame is None:  # no check on the way: a cell (or its own function) called the checker's code
                with open(hits_path, "a") as out:
                    out.write(fn.__module__ + " " + label + "\n")
            return fn(*args, **kwargs)
        watched.__name__, watched.__qualname__, watched.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
        return watched

    for module in modules:
        for key, obj in list(vars(module).items()):
            if inspect.isfunction(obj) and obj.__module__ in names and obj.__module__ + "." + obj.__name__ not in given:
                if id(obj) not in wrappers:
                    wrappers[id(obj)] = wrap(obj)
                originals.append((module, key, obj))
                setattr(module, key, wrappers[id(obj)])

    def unwatch():
        for module, key, obj in originals:
            setattr(module, key, obj)
    return unwatch


__attncourse_unwatch = __attncourse_watch(HITS, GIVEN)
del __attncourse_watch
'''

UNWATCH_SIDE = "__attncourse_unwatch(); del __attncourse_unwatch"


def watch_source(hits: Path) -> str:
    """The cell that starts the watch in the kernel, writing what it sees to `hits`."""
    return WATCH_SIDE.replace("HITS", repr(str(hits))).replace("GIVEN", repr(GIVEN))


def exercises_reached(hits: Path, exercises: list[checks.Exercise]) -> dict[str, str]:
    """{exercise id: the check function a cell called} for the exercises whose check module a cell reached."""
    try:
        lines = hits.read_text().splitlines()
    except OSError:
        return {}
    reached: dict[str, str] = {}
    for line in lines:
        module, _, label = line.partition(" ")
        for ex in exercises:
            if getattr(ex.make_cases, "__module__", None) == module:
                reached.setdefault(ex.id, label)
    return reached


def message(label: str) -> str:
    """What the learner reads for an exercise whose check module a cell called."""
    return (f"a cell of this notebook called `{label}`, the check's own code (not through `check`): an answer that "
            f"can be taken from the checker is not graded (call only `check`, and the helpers the notebook gives)")
