"""The one-command GPU check of chapter 10 (attncourse.gpu_check), on a CPU: it runs a notebook's code cells in
order as a kernel would, saves figures, records each cell's outcome, and tells an unwritten exercise's expected
errors from real ones. (The whole run on chapter 10's notebooks is `python -m attncourse.gpu_check`.)"""

from __future__ import annotations

import json

import nbformat

from attncourse import gpu_check


def notebook(tmp_path, *sources):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    path = tmp_path / "nb" / "x.ipynb"
    path.parent.mkdir()
    nbformat.write(nb, path)
    return path


def test_cells_run_in_order_in_one_namespace_with_figures_saved(tmp_path):
    path = notebook(tmp_path, "import matplotlib.pyplot as plt\nx = 2", "plt.plot([1, x]); plt.title('t'); plt.show()",
                    "from IPython.display import display\ndisplay(x)", "y = x / 0", "assert x == 2")
    records = gpu_check.run_notebook(path, tmp_path / "figs")
    assert [r["status"] for r in records] == ["ok", "ok", "ok", "ZeroDivisionError", "ok"]
    assert len(list((tmp_path / "figs").glob("*.png"))) == 1


def test_only_an_unwritten_answer_is_an_expected_failure():
    assert gpu_check.expected_failure({"status": "NotImplementedError"})
    assert gpu_check.expected_failure({"status": "ExerciseNotDone"})
    assert gpu_check.expected_failure({"status": "NameError", "message": "name 'lse_update' is not defined"})
    assert not gpu_check.expected_failure({"status": "AssertionError", "message": "Tensor-likes are not close!"})
    assert not gpu_check.expected_failure({"status": "ValueError", "message": "cpu tensor?"})


def test_the_report_is_written(tmp_path, monkeypatch):
    path = notebook(tmp_path, "a = 1", "raise NotImplementedError()")
    monkeypatch.setattr(gpu_check, "NOTEBOOKS", {"exercises": path, "lesson": path})
    assert gpu_check.main(["--out", str(tmp_path / "out"), "--skip-tests", "--skip-bench", "--only", "exercises"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["notebooks"]["exercises"]["unexpected"] == []
    assert gpu_check.main(["--out", str(tmp_path / "out"), "--skip-tests", "--skip-bench", "--only", "lesson"]) == 1
