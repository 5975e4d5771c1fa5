"""What grading produces: one result per exercise and per notebook, and which chapter a notebook is."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .. import checks
from ..nbtools import ROOT

STATUSES = ("passed", "failed", "error", "timeout", "missing")
SOLUTIONS = ROOT / "solutions"  # where hidden tests are read from by default
MAX_NOTEBOOK_BYTES = 50_000_000  # a bigger .ipynb is not read at all


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
    student: str = ""


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


def chapter_in_text(path: Path) -> str | None:
    """The chapter of a damaged notebook, from its raw text (metadata or a grade id), if it shows."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(MAX_NOTEBOOK_BYTES)
    except OSError:
        return None
    match = re.search(r'"chapter"\s*:\s*"(\d\d)"', text) or re.search(r'"grade_id"\s*:\s*"(\d\d)-', text)
    return match.group(1) if match else None
