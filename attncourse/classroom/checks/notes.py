"""Calm notes in a learner's kernel, and feedback lines wrapped between words (part of
:mod:`attncourse.classroom.checks`, which re-exports every name here)."""

from __future__ import annotations

import traceback

# An exercise notebook run top to bottom before any answer is written raises NotImplementedError in each stub and
# ExerciseNotDone in each check. Shown as errors, that is a page of red for a notebook in its normal state. In a
# learner's IPython kernel, those two (and only those: a stub's own `raise NotImplementedError()` line, or a check
# saying "not attempted yet") are shown as a plain note on stdout instead; the cell still fails (Run All goes on
# past it through the exercise notebooks' `raises-exception` tags, and nothing after it in the cell runs). Under
# nbgrader (NBGRADER_EXECUTION is set while it autogrades or validates) they stay errors: nbgrader gives a check
# cell its points when it shows no error output.
STUB_LINE = "raise NotImplementedError()"


def quiet_note(err: BaseException) -> str | None:
    """The note shown in place of `err`'s traceback, or None to show the traceback (see above)."""
    from . import ExerciseNotDone

    if isinstance(err, ExerciseNotDone):
        return str(err)
    if type(err) is not NotImplementedError or err.args:
        return None
    frames = traceback.extract_tb(err.__traceback__) if err.__traceback__ is not None else []
    if not frames or (frames[-1].line or "").strip() != STUB_LINE or not _in_notebook(frames[-1]):
        return None
    where = frames[-1].name
    if where == "<module>":
        return "note: your answer goes in this cell, in place of `raise NotImplementedError()`; not written yet"
    return f"note: this cell runs `{where}`, which is not written yet; it shows its result once it is"


def _in_notebook(frame) -> bool:
    return "ipykernel_" in frame.filename or frame.filename.startswith(("<ipython-input", "<cell"))


def install_notes() -> bool:
    """Show :func:`quiet_note`'s notes instead of tracebacks in this IPython kernel (done when the checks are
    imported; not under nbgrader). True when installed now or before."""
    import os

    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None or os.environ.get("NBGRADER_EXECUTION") or not hasattr(shell, "_showtraceback"):
        return False
    if getattr(shell, "_attncourse_notes", False):
        return True
    original = shell._showtraceback

    def showtraceback(etype, evalue, stb):
        note = quiet_note(evalue) if isinstance(evalue, BaseException) else None
        if note is None:
            return original(etype, evalue, stb)
        import sys

        print("\n".join(part for line in note.split("\n") for part in wrap(line)), file=sys.stdout, flush=True)

    shell._showtraceback = showtraceback
    shell._attncourse_notes = True
    return True


WIDTH = 120  # feedback lines are wrapped here, between words (a browser would break them inside words)


def wrap(line: str, width: int = WIDTH) -> list[str]:
    """`line` wrapped at spaces, continuation lines indented two more than its own indent."""
    import textwrap

    if len(line) <= width:
        return [line]
    indent = line[: len(line) - len(line.lstrip())]
    return textwrap.wrap(line, width, initial_indent="", subsequent_indent=indent + "  ", break_long_words=False,
                         break_on_hyphens=False, drop_whitespace=True) or [line]


