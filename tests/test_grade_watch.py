"""The grader notices a cell that calls the checks' own code (attncourse.classroom.grading.watch): cold review 13
of chapters 00-02 passed 01-query-influence-predict (check cell and grader, 1/1) with the answer computed in another
cell by the check module's reference (the exercise is now a rule judged on drawn scales, but the measurement behind
its check stays importable)."""

from __future__ import annotations

from pathlib import Path

import nbformat

from attncourse.classroom import checks, grade
from attncourse.classroom.grading import watch

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "01_additive_attention.ipynb"
PREDICT = "01-query-influence-predict"


def _minimal(nb, keep):
    """The first code cell and the cells of the exercises in `keep` (answers and checks): a short grading run."""
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells = [c for i, c in enumerate(nb.cells) if i == first or any(
        str(c.metadata.get("nbgrader", {}).get("grade_id", "")).startswith(k) for k in keep)]


def test_an_answer_taken_from_the_checkers_reference_gets_no_points(tmp_path):
    nb = nbformat.read(SOLUTION, as_version=4)
    _minimal(nb, (PREDICT, "01-padding-mask"))
    answer = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == f"{PREDICT}-answer")
    answer.source = ("import attncourse.classroom.checks.ch01_influence as ref_module\n"
                     "ANS = getattr(ref_module, '_mo' + 'ves')(1.0, 1.0)  # the check's measurement, in a cell\n"
                     "def query_moves_weights(alpha, beta):\n    return dict(ANS)\n")
    path = tmp_path / SOLUTION.name
    nbformat.write(nb, path)
    result = grade.grade_notebook(path)
    by_id = {e.id: e for e in result.exercises}
    assert by_id[PREDICT].points == 0 and "ch01_influence._moves" in by_id[PREDICT].message, by_id[PREDICT]
    assert by_id["01-padding-mask"].status == "passed", by_id["01-padding-mask"]  # another module's exercise


def test_the_exercise_notebooks_only_import_what_they_are_given():
    """Every function of a chapter check module that a notebook imports is in watch.GIVEN (else grading it fails)."""
    import re
    found = set()
    for folder in ("notebooks", "exercises", "solutions"):
        for path in (ROOT / folder).glob("*.ipynb"):
            for m in re.finditer(r"classroom\.checks\.(ch\d\d\w*) import ([\w, ]+)", path.read_text(encoding="utf-8")):
                found |= {f"attncourse.classroom.checks.{m.group(1)}.{n.strip()}" for n in m.group(2).split(",")}
    assert found <= set(watch.GIVEN), found - set(watch.GIVEN)


def test_exercises_reached_maps_a_module_to_its_exercises(tmp_path):
    hits = tmp_path / "hits.txt"
    assert watch.exercises_reached(hits, checks.exercises_for("01")) == {}
    hits.write_text("attncourse.classroom.checks.ch01_influence ch01_influence._moves\n")
    reached = watch.exercises_reached(hits, checks.exercises_for("01"))
    assert PREDICT in reached and "01-padding-mask" not in reached
