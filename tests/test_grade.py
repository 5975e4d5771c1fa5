"""The grader on broken, hostile and odd submissions: it grades them, never crashes, and cannot be fooled."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from attncourse import grade

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "03_scaled_dot_product_attention.ipynb"
EXERCISE = ROOT / "exercises" / "03_scaled_dot_product_attention.ipynb"


def submission(tmp_path: Path, name: str, edit, base: Path = SOLUTION) -> Path:
    nb = nbformat.read(base, as_version=4)
    edit(nb)
    path = tmp_path / name
    nbformat.write(nb, path)
    return path


def answer_cell(nb, exercise_id):
    return next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == f"{exercise_id}-answer")


def statuses(result):
    return {e.id: e.status for e in result.exercises}


def test_cheating_inside_the_notebook_buys_nothing(tmp_path):
    def edit(nb):
        # a wrong answer, a patched checker, a patched reference, an edited check cell and a fake pass line
        answer_cell(nb, "03-softmax-axis-bug").source = (
            "def attention_fixed(q, k, v):\n    return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)\n"
            "import attncourse, attncourse.checks, attncourse.sdpa\n"
            "attncourse.checks.check = attncourse.check = lambda *a, **k: print('✓ 03-softmax-axis-bug: all 3 case(s) passed')\n"
            "attncourse.checks.compare = lambda *a, **k: None\n"
            "attncourse.sdpa.scaled_dot_product_attention = attention_fixed\n"
            "attncourse.scaled_dot_product_attention = attention_fixed\n")
        for cell in nb.cells:
            if cell.metadata.get("nbgrader", {}).get("grade_id") == "03-softmax-axis-bug":
                cell.source = "print('✓ 03-softmax-axis-bug: all 3 case(s) passed')"
                cell.metadata["nbgrader"]["points"] = 100  # edited metadata does not raise the maximum either

    result = grade.grade_notebook(submission(tmp_path, "03_cheat.ipynb", edit))
    assert statuses(result)["03-softmax-axis-bug"] == "failed"
    assert result.max_score == 9 and result.score == 7


def test_forbidden_kernel_is_caught_even_when_aliased(tmp_path):
    def edit(nb):
        answer_cell(nb, "03-softmax-axis-bug").source = (
            "from torch.nn.functional import scaled_dot_product_attention as sneaky\n"
            "def attention_fixed(q, k, v):\n    return sneaky(q, k, v)\n")

    result = grade.grade_notebook(submission(tmp_path, "03_fused.ipynb", edit))
    ex = next(e for e in result.exercises if e.id == "03-softmax-axis-bug")
    assert ex.status == "failed" and "scaled_dot_product_attention" in ex.message


def test_raising_looping_and_dying_submissions(tmp_path):
    def edit(nb):
        answer_cell(nb, "03-sdpa-numpy").source = "def attention_numpy(Q, K, V):\n    raise ValueError('oops')\n"
        answer_cell(nb, "03-masked-attention").source = "def masked_attention(q, k, v, keep):\n    while True:\n        pass\n"
        answer_cell(nb, "03-predict-shapes").source = "while True:\n    pass\n"

    result = grade.grade_notebook(submission(tmp_path, "03_broken.ipynb", edit), cell_timeout=10)
    st = statuses(result)
    assert st["03-sdpa-numpy"] == "error" and "ValueError: oops" in result.exercises[0].message
    assert st["03-masked-attention"] == "timeout"
    assert st["03-predict-shapes"] == "missing"          # its cell was interrupted, the name never defined
    assert st["03-softmax-axis-bug"] == "passed" and st["03-variance-experiment"] == "passed"
    assert "interrupted" in result.message

    def die(nb):
        nb.cells.insert(3, nbformat.v4.new_code_cell("import os\nos._exit(1)"))

    result = grade.grade_notebook(submission(tmp_path, "03_dies.ipynb", die), cell_timeout=20)
    assert result.score == 0 and len(result.exercises) == 5
    assert {e.status for e in result.exercises} <= {"error", "missing"}


def test_unreadable_and_empty_notebooks(tmp_path):
    bad = tmp_path / "03_not_json.ipynb"
    bad.write_text("{ this is not json", encoding="utf-8")
    result = grade.grade_notebook(bad)
    assert result.max_score == 9 and result.score == 0
    assert {e.status for e in result.exercises} == {"error"} and "not a readable notebook" in result.message

    empty = tmp_path / "03_empty.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.metadata.attncourse = {"chapter": "03"}
    nbformat.write(nb, empty)
    result = grade.grade_notebook(empty)
    assert result.score == 0 and {e.status for e in result.exercises} == {"missing"}

    unknown = tmp_path / "homework.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), unknown)
    result = grade.grade_notebook(unknown)
    assert result.max_score == 0 and "chapter unknown" in result.message


def test_deleted_and_reordered_cells_are_graded(tmp_path):
    def edit(nb):
        nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade") is not True]  # no check cells
        nb.cells.reverse()  # answers now run before the imports they need

    result = grade.grade_notebook(submission(tmp_path, "03_shuffled.ipynb", edit))
    assert result.max_score == 9 and 0 <= result.score < 9
    assert len(result.exercises) == 5


def test_cli_writes_the_documented_json(tmp_path, capsys):
    out = tmp_path / "grades.json"
    assert grade.main([str(SOLUTION), str(EXERCISE), "--json", str(out)]) == 0
    data = json.loads(out.read_text(encoding="utf-8"))
    assert [d["score"] for d in data] == [9.0, 0.0]
    for entry in data:
        assert {"notebook", "score", "max_score", "exercises"} <= set(entry)
        for ex in entry["exercises"]:
            assert set(ex) == {"id", "points", "max_points", "status", "message"}
            assert ex["status"] in grade.STATUSES
            assert isinstance(ex["points"], float) and isinstance(ex["max_points"], float)
    assert "9 / 9" in capsys.readouterr().out


def test_a_kernel_that_ignores_interrupts_is_stopped(tmp_path):
    def edit(nb):
        answer_cell(nb, "03-masked-attention").source = (
            "def masked_attention(q, k, v, keep):\n"
            "    while True:\n        try:\n            while True:\n                pass\n"
            "        except KeyboardInterrupt:\n            pass\n")

    result = grade.grade_notebook(submission(tmp_path, "03_stubborn.ipynb", edit), cell_timeout=10)
    st = statuses(result)
    assert st["03-sdpa-numpy"] == "passed" and st["03-masked-attention"] == "timeout"
    assert st["03-variance-experiment"] == "timeout" and "ignored an interrupt" in result.message
