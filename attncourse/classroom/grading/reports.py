"""Reports of a grading run: JSON, a gradebook CSV, a long CSV, Markdown feedback per student, console lines."""

from __future__ import annotations

import csv
import re
import sys
from dataclasses import asdict
from pathlib import Path

from .. import checks
from .notebook import NOT_GRADED
from .results import NotebookResult


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
    """What passed, what failed and why, for the student (a prediction's expected value is never shown)."""
    reg = checks.registry()
    lines = [f"# Feedback: {Path(r.notebook).name}", "",
             f"Student: **{r.student}** · autograded score: **{r.score:g} / {r.max_score:g}**", ""]
    if r.message:
        lines += [f"Note from the grader: {r.message}", ""]
    if r.exercises:
        lines += ["| exercise | points | result |", "| --- | --- | --- |"]
        lines += [f"| {e.id} | {e.points:g} / {e.max_points:g} | {_MARK.get(e.status, e.status)} |" for e in r.exercises]
        lines.append("")
    todo = [e for e in r.exercises if e.status != "passed" and e.message != NOT_GRADED]
    if todo:
        lines += ["## What to look at", ""]
        for e in todo:
            ex = reg.get(e.id)
            lines += [f"### {e.id} ({_MARK.get(e.status, e.status)})", ""]
            if ex is not None and ex.title:
                lines += [ex.title.strip(), ""]
            lines += ["```text", e.message, "```", ""]
            if ex is not None and ex.hint and e.status in ("failed", "error") and "this looks like:" not in e.message:
                # a hint for a wrong answer only, and only when the message has not named the mistake already
                lines += [f"Hint: {ex.hint}", ""]
    elif r.exercises and all(e.message == NOT_GRADED for e in r.exercises):
        lines += ["No exercise could be graded: the grader could not read the file (the note above says why). Check that you handed in the "
                  "right file, and that it opens in JupyterLab.", ""]
    elif r.exercises:
        lines += ["Every autograded exercise passed.", ""]
    unreadable = bool(r.exercises) and all(e.message == NOT_GRADED for e in r.exercises)
    lines += ["Written answers are graded by hand and are not part of this score."
              + ("" if unreadable else " The grader ran its own checks (and some hidden ones), so run the check "
                 "cells in your notebook to reproduce a failure."), ""]
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


def print_result(res: NotebookResult, bar=None) -> None:
    """One console line for the notebook and one per exercise (printed above a progress bar)."""
    from tqdm.auto import tqdm

    lines = [f"{res.notebook} [{res.student}]: {res.score:g} / {res.max_score:g}" + (f"  ({res.message})" if res.message else "")]
    ungraded = [e for e in res.exercises if e.message == NOT_GRADED]
    lines += [f"  {e.status:<8} {e.points:g}/{e.max_points:g}  {e.id}: {e.message}" for e in res.exercises
              if e.message != NOT_GRADED]
    if ungraded:
        lines.append(f"  {len(ungraded)} exercise(s) not graded: {', '.join(e.id for e in ungraded)}")
    for line in lines:
        tqdm.write(line, file=sys.stdout)
