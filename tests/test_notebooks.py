"""Notebook hygiene, exercise sync, nbgrader metadata, exercise notebooks executed, grader on every chapter.

nbval (run by the same `pytest` command) re-executes notebooks/ and solutions/ and compares outputs;
these tests check what nbval cannot: stored state, metadata, the stubs, and the grader's verdicts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from attncourse.classroom import checks, nbtools
from attncourse.classroom.grade import grade_notebook

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
EXECUTED = LESSONS + SOLUTIONS
ALL = EXECUTED + EXERCISES
MAX_BYTES = 3_000_000  # a committed notebook with figures stays well below this
PRIVATE = re.compile(r"(/home/|/Users/|/root/|[A-Z]:\\\\Users|/tmp/ipykernel_)")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def test_there_are_notebooks():
    assert (ROOT / "notebooks" / "00_start_here.ipynb").exists()
    assert len(SOLUTIONS) >= 1 and len(EXERCISES) == len(SOLUTIONS)


@pytest.mark.parametrize("path", ALL, ids=rel)
def test_valid_with_python3_kernel_and_chapter(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    chapter = path.name[:2]
    assert re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", path.name), "name notebooks NN_topic.ipynb"
    assert nb.metadata.get("attncourse", {}).get("chapter") == chapter
    assert path.stat().st_size < MAX_BYTES, f"{rel(path)} is {path.stat().st_size} bytes"


@pytest.mark.parametrize("path", EXECUTED, ids=rel)
def test_executed_in_order_without_errors(path):
    nb = nbformat.read(path, as_version=4)
    cells = [c for c in code_cells(nb) if c.source.strip()]
    counts = [c.execution_count for c in cells]
    assert counts == list(range(1, len(cells) + 1)), f"re-run {rel(path)} top to bottom (counts {counts})"
    errors = [o.get("ename") for c in cells for o in c.outputs if o.output_type == "error"]
    assert not errors, f"stored errors: {errors}"
    text = json.dumps([c.outputs for c in cells])
    assert not PRIVATE.search(text), f"private path in outputs: {PRIVATE.search(text).group(0)}"
    assert not any("nbval-raises-exception" in c.metadata.get("tags", []) for c in cells)


@pytest.mark.parametrize("path", LESSONS, ids=rel)
def test_lesson_structure(path):
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0].source
    assert first.startswith("# "), "a lesson opens with its title"
    assert "What you will learn" in first and "Prerequisites" in first and "Time" in first
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "## Summary" in text and "## References" in text
    if path.name[:2] != "00":
        assert "## Exercises" in text and f"exercises/{path.name}" in text
        assert (ROOT / "solutions" / path.name).exists(), "every lesson after 00 has exercises with solutions"


def test_exercises_in_sync_with_solutions():
    assert nbtools.generate_exercises(ROOT, check_only=True) == [], (
        "exercises/ is out of date: run `python -m attncourse.nbtools exercises`")


@pytest.mark.parametrize("path", EXERCISES, ids=rel)
def test_exercises_have_no_solutions_or_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        assert nbtools.BEGIN_SOLUTION not in cell.source and nbtools.BEGIN_HIDDEN not in cell.source
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.parametrize("path", SOLUTIONS, ids=rel)
def test_nbgrader_metadata_matches_registry(path):
    nb = nbformat.read(path, as_version=4)
    chapter = path.name[:2]
    registered = {ex.id: ex for ex in checks.exercises_for(chapter)}
    grade_ids, checked = [], []
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader")
        if not meta:
            assert nbtools.BEGIN_SOLUTION not in cell.source, "solution markup in a cell without nbgrader metadata"
            continue
        grade_ids.append(meta["grade_id"])
        if meta["grade"] and not meta["solution"]:  # an autograded check cell
            ex = registered.get(meta["grade_id"])
            assert ex is not None, f"check cell {meta['grade_id']} has no registered exercise"
            assert float(meta["points"]) == ex.points, f"{ex.id}: cell points {meta['points']} != {ex.points}"
            assert cell.source.startswith(f'check("{ex.id}")')
            checked.append(ex.id)
        if meta["solution"]:
            assert nbtools.BEGIN_SOLUTION in cell.source, f"{meta['grade_id']}: solution cell without markup"
    assert len(grade_ids) == len(set(grade_ids)), "grade_ids must be unique"
    assert sorted(checked) == sorted(registered), "every registered exercise has exactly one check cell"
    assert len(registered) >= 3


@pytest.mark.parametrize("path", EXERCISES, ids=rel)
def test_exercise_notebook_raises_only_not_implemented(path, tmp_path):
    """Run the student version: the stubs may raise NotImplementedError, nothing else may fail."""
    nb = nbformat.read(path, as_version=4)
    nbtools.run_notebook(nb, path.parent, timeout=120, allow_errors=True)
    errors = [(i, o.ename, o.evalue) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"]
    bad = [e for e in errors if e[1] not in ("NotImplementedError", "ExerciseNotDone")]
    assert not bad, f"errors other than the stubs' NotImplementedError: {bad}"
    shown = "\n".join(_output_text(c) for c in nb.cells if c.cell_type == "code")
    # in a learner's kernel an untouched stub or check is a calm note on stdout, not a traceback (checks/notes.py)
    assert errors or "not attempted yet" in shown or "not written yet" in shown, (
        "the untouched exercises should say, somewhere, that they are not attempted yet")
    # no stub passes its check: the grader's side of this is tested on chapter 03's blank notebook (test_grade.py),
    # and the grader judges with the same registry and comparisons as the check cell
    passed = sorted(set(re.findall(r"✓ (\d\d-[\w-]+)", shown)))
    assert not passed, f"an untouched exercise passes its check: {passed}"
    ran = {m for c in nb.cells if c.cell_type == "code" for m in re.findall(r'^check\("([\w-]+)"\)', c.source, re.M)}
    assert ran == {ex.id for ex in checks.exercises_for(path.name[:2])}, "every exercise has its check cell, run"
    assert not _answers_shown(path.name[:2], shown), "Run All on the untouched notebook shows a prediction's answer"
    named = [(ex.id, word) for ex in checks.exercises_for(path.name[:2]) if ex.category == "bug"
             for word in ex.bug_words if re.search(rf"(?<![A-Za-z0-9]){re.escape(word)}", shown, re.IGNORECASE)]
    assert not named, f"the untouched notebook's outputs name a bug: {named}"


def _output_text(cell) -> str:
    parts = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            parts.append(o.get("text", ""))
        elif o.get("output_type") in ("execute_result", "display_data"):
            parts.append(str(o.get("data", {}).get("text/plain", "")))
        elif o.get("output_type") == "error":
            parts.append(f"{o.get('ename')}: {o.get('evalue')}")
    return "\n".join(parts)


def _answers_shown(chapter: str, text: str) -> list[str]:
    """The predictions of `chapter` whose expected value (whole, or a distinctive part) appears in `text`."""
    import torch

    found = []
    for ex in checks.exercises_for(chapter):
        if ex.category != "predict":
            continue
        for case in ex.make_cases():
            expected = case.expected
            leaves = [expected] if not isinstance(expected, (tuple, list, dict)) else \
                list(expected.values()) if isinstance(expected, dict) else list(expected)
            wholes = {repr(expected), repr(tuple(expected)) if isinstance(expected, list) else ""}
            if any(w and len(w) >= 6 and w in text for w in wholes):
                found.append(f"{ex.id}: the whole answer {expected!r}")
                continue
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor) or isinstance(leaf, bool) or leaf is None:
                    continue
                spelled = {repr(leaf)} if not isinstance(leaf, int) else {str(leaf), f"{leaf:,}"}
                spelled = {s for s in spelled if len(s) >= 5}  # distinctive: not a small number seen anywhere
                if any(re.search(rf"(?<![\w.]){re.escape(s)}(?![\w])", text) for s in spelled):
                    found.append(f"{ex.id}: part {leaf!r}")
    return found


@pytest.mark.parametrize("path", SOLUTIONS, ids=rel)
def test_grader_full_points_for_solutions(path, tmp_path):
    """The solution's answers earn every point from the grader. Chapter 03's solution (the worked example) is
    graded whole, as a learner hands it in; the others as their first code cell and exercise cells only where that
    is enough (nbval runs every other cell of them already), else whole (an answer that needs another cell: 10)."""
    expected = sum(ex.points for ex in checks.exercises_for(path.name[:2]))
    result = None
    if not path.name.startswith(("03", "10")):  # 10-find-the-bug-1 launches with the notebook's `launch_decode`
        nb = nbformat.read(path, as_version=4)
        first_code = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
        nb.cells = [c for i, c in enumerate(nb.cells) if i == first_code or "nbgrader" in c.metadata]
        nbformat.write(nb, tmp_path / path.name)
        result = grade_notebook(tmp_path / path.name, cell_timeout=120)
    if result is None or result.score != result.max_score:
        result = grade_notebook(path, cell_timeout=120)
    assert result.max_score > 0 and result.max_score == expected
    assert result.score == result.max_score, [(e.id, e.status, e.message) for e in result.exercises]


def test_readme_links_every_notebook():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for path in ALL:
        assert f"({rel(path)})" in readme, f"README's chapter map does not link {rel(path)}"
