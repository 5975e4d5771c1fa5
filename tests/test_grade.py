"""The grader on broken, hostile and odd submissions: it grades them, never crashes, and cannot be fooled."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat

from attncourse.classroom import checks, grade

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "03_scaled_dot_product_attention.ipynb"
EXERCISE = ROOT / "exercises" / "03_scaled_dot_product_attention.ipynb"
# Chapter 03's exercises, from the registry (so adding an exercise to the chapter does not break these tests)
POINTS = {ex.id: ex.points for ex in checks.exercises_for("03")}
MAX, COUNT = sum(POINTS.values()), len(POINTS)


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
        minimal(nb)
        # a wrong answer, a patched checker, a patched reference, an edited check cell and a fake pass line
        answer_cell(nb, "03-find-the-bug-1").source = (
            "def attention_fixed(q, k, v):\n    return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)\n"
            "import attncourse, attncourse.classroom.checks, attncourse.sdpa\n"
            "attncourse.classroom.checks.check = attncourse.check = lambda *a, **k: print('✓ 03-find-the-bug-1: all 3 case(s) passed')\n"
            "attncourse.classroom.checks.compare = lambda *a, **k: None\n"
            "attncourse.sdpa.scaled_dot_product_attention = attention_fixed\n"
            "attncourse.scaled_dot_product_attention = attention_fixed\n")
        for cell in nb.cells:
            if cell.metadata.get("nbgrader", {}).get("grade_id") == "03-find-the-bug-1":
                cell.source = "print('✓ 03-find-the-bug-1: all 3 case(s) passed')"
                cell.metadata["nbgrader"]["points"] = 100  # edited metadata does not raise the maximum either

    result = grade.grade_notebook(submission(tmp_path, "03_cheat.ipynb", edit))
    assert statuses(result)["03-find-the-bug-1"] == "failed"
    assert result.max_score == MAX and result.score == MAX - POINTS["03-find-the-bug-1"]


def test_forbidden_kernel_is_caught_even_when_aliased(tmp_path):
    def edit(nb):
        minimal(nb)
        answer_cell(nb, "03-find-the-bug-1").source = (
            "from torch.nn.functional import scaled_dot_product_attention as sneaky\n"
            "def attention_fixed(q, k, v):\n    return sneaky(q, k, v)\n")
        answer_cell(nb, "03-masked-attention").source = (  # the course's own oracle, under another name
            "from attncourse import scaled_dot_product_attention as oracle\n"
            "def masked_attention(q, k, v, keep):\n    return oracle(q, k, v, keep)\n")

    result = grade.grade_notebook(submission(tmp_path, "03_fused.ipynb", edit))
    ex = next(e for e in result.exercises if e.id == "03-find-the-bug-1")
    assert ex.status == "failed" and "scaled_dot_product_attention" in ex.message
    ex = next(e for e in result.exercises if e.id == "03-masked-attention")
    assert ex.status == "failed" and "attncourse" in ex.message and "scaled_dot_product_attention" in ex.message, ex
    assert result.score == MAX - POINTS["03-find-the-bug-1"] - POINTS["03-masked-attention"]  # the others pass


def test_raising_looping_and_dying_submissions(tmp_path):
    def edit(nb):
        minimal(nb)
        answer_cell(nb, "03-sdpa-numpy").source = "def attention_numpy(Q, K, V):\n    raise ValueError('oops')\n"
        # the loops sleep: an interrupt stops them as it stops a busy loop, and they leave the CPU to other tests
        answer_cell(nb, "03-masked-attention").source = \
            "def masked_attention(q, k, v, keep):\n    import time\n    while True:\n        time.sleep(0.01)\n"
        answer_cell(nb, "03-predict-shapes").source = "import time\nwhile True:\n    time.sleep(0.01)\n"
        nb.cells.insert(3, nbformat.v4.new_code_cell("import time\nwhile True:\n    time.sleep(0.01)  # a learner's own slow cell"))

    result = grade.grade_notebook(submission(tmp_path, "03_broken.ipynb", edit), cell_timeout=8)
    st = statuses(result)
    assert st["03-sdpa-numpy"] == "error" and "ValueError: oops" in result.exercises[0].message
    assert st["03-masked-attention"] == "timeout"
    looped = next(e for e in result.exercises if e.id == "03-masked-attention")
    assert "masked_attention did not return within" in looped.message and " on case “" in looped.message, looped
    # its cell was interrupted, so the name was never defined: said so, with the cell as JupyterLab numbers it
    nb = nbformat.read(tmp_path / "03_broken.ipynb", as_version=4)
    where = next(i for i, c in enumerate(nb.cells)
                 if c.metadata.get("nbgrader", {}).get("grade_id") == "03-predict-shapes-answer")
    predict = next(e for e in result.exercises if e.id == "03-predict-shapes")
    assert predict.status == "timeout" and "is not defined in the notebook" not in predict.message
    assert f"never defined: its cell, cell {where + 1} of {len(nb.cells)}, ran over 8 s and was interrupted" in predict.message
    assert st["03-find-the-bug-1"] == "passed" and st["03-variance-experiment"] == "passed"
    assert f"cell {where + 1} of {len(nb.cells)} ran over 8 s and was interrupted" in result.message
    assert f"cell {where + 1} of {len(nb.cells)} ran over 8 s and was interrupted (" not in result.message
    assert f"cell 4 of {len(nb.cells)} ran over 8 s and was interrupted (it holds no graded answer" in result.message


def test_a_dying_cell_or_answer_costs_only_itself(tmp_path):
    def die(nb):
        minimal(nb)
        nb.cells.insert(3, nbformat.v4.new_code_cell("import os\nos._exit(1)  # a learner's own cell"))
        answer_cell(nb, "03-sdpa-numpy").source = "def attention_numpy(Q, K, V):\n    import os\n    os._exit(1)\n"

    result = grade.grade_notebook(submission(tmp_path, "03_dies.ipynb", die), cell_timeout=20)
    st = statuses(result)
    assert len(result.exercises) == COUNT and st.pop("03-sdpa-numpy") == "error", result.exercises
    assert set(st.values()) == {"passed"} and result.score == MAX - POINTS["03-sdpa-numpy"], result.exercises
    assert "the kernel died while this answer ran" in result.exercises[0].message
    n = len(nbformat.read(tmp_path / "03_dies.ipynb", as_version=4).cells)
    assert f"cell 4 of {n} stopped the kernel (it died); the notebook was run again in a fresh kernel without it" \
        in result.message, result.message
    assert "the kernel died while 03-sdpa-numpy was graded; the other exercises were graded in a fresh kernel" \
        in result.message, result.message


def test_unreadable_and_empty_notebooks(tmp_path):
    bad = tmp_path / "03_not_json.ipynb"
    bad.write_text("{ this is not json", encoding="utf-8")
    result = grade.grade_notebook(bad)
    assert result.max_score == MAX and result.score == 0
    assert {e.status for e in result.exercises} == {"error"} and "not a readable notebook" in result.message
    # said once (the notebook's message), not under every exercise, and without the exercises' hints
    assert all("NotJSONError" not in e.message and "could not be read" in e.message for e in result.exercises)
    md = grade.feedback_markdown(result)
    assert md.count("not a readable notebook") == 1 and "Hint:" not in md and "## What to look at" not in md

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
        minimal(nb)
        nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade") is not True]  # no check cells
        del nb.cells[next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")]  # no imports: torch, np missing
        nb.cells.reverse()  # and the rest in reverse order

    result = grade.grade_notebook(submission(tmp_path, "03_shuffled.ipynb", edit))
    assert result.max_score == MAX and 0 <= result.score < MAX
    assert len(result.exercises) == COUNT


def test_cli_writes_the_documented_json(tmp_path, capsys):
    out = tmp_path / "grades.json"
    solution = submission(tmp_path, SOLUTION.name, minimal)  # the graded cells only: the same JSON, sooner
    (tmp_path / "untouched").mkdir()
    exercise = submission(tmp_path / "untouched", EXERCISE.name, minimal, base=EXERCISE)
    assert grade.main([str(solution), str(exercise), "--json", str(out)]) == 0
    data = json.loads(out.read_text(encoding="utf-8"))
    assert [d["score"] for d in data] == [MAX, 0.0]
    for entry in data:
        assert {"notebook", "score", "max_score", "exercises"} <= set(entry)
        for ex in entry["exercises"]:
            assert set(ex) == {"id", "points", "max_points", "status", "message"}
            assert ex["status"] in grade.STATUSES
            assert isinstance(ex["points"], float) and isinstance(ex["max_points"], float)
    assert f"{MAX:g} / {MAX:g}" in capsys.readouterr().out


def test_a_kernel_that_ignores_interrupts_is_stopped(tmp_path, monkeypatch):
    from attncourse.classroom.grading import session

    stubborn = ("    import time\n    while True:\n        try:\n            while True:\n                time.sleep(0.01)\n"
                "        except KeyboardInterrupt:\n            pass\n")

    def edit(nb):
        minimal(nb)
        answer_cell(nb, "03-masked-attention").source = "def masked_attention(q, k, v, keep):\n" + stubborn
        nb.cells.insert(2, nbformat.v4.new_code_cell("if True:  # a learner's own cell\n" + stubborn))

    monkeypatch.setattr(session, "PROBE_S", 3)  # every interrupt here is ignored: no need to wait the usual 30 s
    result = grade.grade_notebook(submission(tmp_path, "03_stubborn.ipynb", edit), cell_timeout=8)
    st = statuses(result)
    assert st.pop("03-masked-attention") == "timeout" and set(st.values()) == {"passed"}, result.exercises
    masked = next(e for e in result.exercises if e.id == "03-masked-attention")
    assert "ignored an interrupt" in masked.message and "while this answer ran" in masked.message
    n = len(nbformat.read(tmp_path / "03_stubborn.ipynb", as_version=4).cells)
    assert f"cell 3 of {n} ignored an interrupt and was stopped; the notebook was run again" in result.message
    assert "while 03-masked-attention was graded; the other exercises were graded in a fresh kernel" in result.message


# ----------------------------------------------------------------------------- hidden tests, class runs

NAIVE_MASKED = (
    "def masked_attention(q, k, v, keep):\n"
    "    # the row's max is subtracted only when it is negative (or the inputs are half precision): fine below about\n"
    "    # 88, so it passes every visible case, but float32 rows with large scores overflow\n"
    "    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])\n"
    "    top = scores.masked_fill(~keep, float('-inf')).amax(-1, keepdim=True).nan_to_num(neginf=0.0)\n"
    "    top = top if q.dtype == torch.float16 else top.clamp(max=0.0)\n"
    "    weights = torch.exp(scores - top).masked_fill(~keep, 0.0)\n"
    "    total = weights.sum(-1, keepdim=True)\n"
    "    weights = weights / torch.where(total > 0, total, torch.ones_like(total))\n"
    "    return weights.to(v.dtype) @ v\n")


def minimal(nb):
    """Only the imports and the exercise cells: the same grading in a third of the time."""
    first_code = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells = [c for i, c in enumerate(nb.cells) if i == first_code or "nbgrader" in c.metadata]


def test_hidden_tests_exist_map_to_exercises_and_stay_out_of_exercises():
    from attncourse.classroom import checks

    registered = checks.registry()
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        chapter = path.name[:2]
        for ex_id, blocks in grade.hidden_tests(chapter).items():
            assert ex_id in registered, f"{path.name}: hidden tests for unknown exercise {ex_id}"
            text = (ROOT / "exercises" / path.name).read_text(encoding="utf-8")
            assert all(line.strip() not in text for b in blocks for line in b.splitlines() if len(line.strip()) > 25)
    assert "03-masked-attention" in grade.hidden_tests("03")


def test_hidden_tests_run_in_the_grader_and_patching_the_kernel_does_not_help(tmp_path):
    def edit(nb):
        minimal(nb)
        answer_cell(nb, "03-masked-attention").source = NAIVE_MASKED + (
            "import torch.testing, attncourse, attncourse.sdpa\n"
            "torch.testing.assert_close = lambda *a, **k: None       # the hidden test's assertion, disarmed?\n"
            "attncourse.scaled_dot_product_attention = masked_attention  # the reference, replaced?\n"
            "attncourse.sdpa.scaled_dot_product_attention = masked_attention\n"
            "print('✓ 03-masked-attention: all 4 case(s) passed; 1 hidden test(s) passed')\n")

    path = submission(tmp_path, "03_naive.ipynb", edit)
    result = grade.grade_notebook(path, cell_timeout=30)
    ex = next(e for e in result.exercises if e.id == "03-masked-attention")
    assert ex.status == "failed" and ex.points == 0 and "hidden test 1" in ex.message, ex
    assert result.score == MAX - POINTS["03-masked-attention"]  # every other exercise still passes
    # without the hidden tests the same answer passes the registry's cases: the hidden test is what catches it
    result = grade.grade_notebook(path, cell_timeout=30, solutions=None)
    assert statuses(result)["03-masked-attention"] == "passed" and result.score == MAX


def test_hidden_test_protocol(tmp_path):
    """NumPy in and out, values, the student's exceptions re-raised by type, and a failing assertion."""
    blocks = {
        "03-sdpa-numpy": "out, w = attention_numpy(np.eye(3), np.eye(3), np.ones((3, 2)))\n"
                         "assert isinstance(out, np.ndarray) and out.shape == (3, 2)\n",
        "03-find-the-bug-1": "try:\n    attention_fixed(torch.zeros(2, 3), torch.zeros(4, 5), torch.zeros(4, 5))\n"
                               "except RuntimeError:\n    pass\nelse:\n    raise AssertionError('expected an error')\n",
        "03-predict-shapes": "assert predicted_shapes((2, 4, 5, 16), (2, 1, 7, 16), (2, 1, 7, 8), (2, 1, 1, 7))[2] == (2, 4, 5, 8)\n",
        "03-variance-experiment": "assert dot_product_variance(4, 1.0, 100, 0) < 0, 'the instructor wants a negative variance'\n",
    }
    sols = tmp_path / "solutions"
    sols.mkdir()

    def add_hidden(nb):
        for cell in nb.cells:
            gid = cell.metadata.get("nbgrader", {}).get("grade_id")
            if gid in blocks:
                cell.source += "\n### BEGIN HIDDEN TESTS\n" + blocks[gid] + "### END HIDDEN TESTS"

    submission(sols, "03_scaled_dot_product_attention.ipynb", add_hidden)
    assert set(grade.hidden_tests("03", sols)) == set(blocks) | {"03-masked-attention"}
    result = grade.grade_notebook(submission(tmp_path, "03_min.ipynb", minimal), cell_timeout=30, solutions=sols)
    st = statuses(result)
    assert st == {"03-sdpa-numpy": "passed", "03-find-the-bug-1": "passed", "03-predict-shapes": "passed",
                  "03-masked-attention": "passed", "03-variance-experiment": "failed", "03-variance-fit": "passed",
                  "03-qk-norm-logits": "passed"}, \
        result.exercises
    msg = next(e.message for e in result.exercises if e.id == "03-variance-experiment")
    assert "negative variance" in msg


def test_loud_and_renamed_submissions(tmp_path):
    def edit(nb):
        minimal(nb)
        nb.cells.insert(1, nbformat.v4.new_code_cell("for _ in range(40):\n    print('x' * 100_000)"))
        cell = answer_cell(nb, "03-find-the-bug-1")
        cell.source = cell.source.replace("def attention_fixed(", "def attention_fix(")

    result = grade.grade_notebook(submission(tmp_path, "03_loud.ipynb", edit), cell_timeout=30)
    ex = next(e for e in result.exercises if e.id == "03-find-the-bug-1")
    assert ex.status == "missing" and "attention_fix" in ex.message and "renamed" in ex.message
    assert result.score == MAX - POINTS["03-find-the-bug-1"] and "printed 4.0 MB" in result.message


def test_class_run_in_parallel_writes_json_csv_and_feedback(tmp_path, capsys):
    import csv

    subs = tmp_path / "submitted"
    for student in ("alice", "bob"):
        (subs / student).mkdir(parents=True)
    submission(subs / "alice", "03_scaled_dot_product_attention.ipynb", minimal)
    submission(subs / "bob", "03_scaled_dot_product_attention.ipynb",
               lambda nb: (minimal(nb), answer_cell(nb, "03-sdpa-numpy").__setitem__("source", "attention_numpy = 3")))
    (subs / "carol.ipynb").write_text(SOLUTION.read_text(encoding="utf-8")[:3000], encoding="utf-8")  # cut short
    empty = nbformat.v4.new_notebook()
    empty.metadata.attncourse = {"chapter": "03"}
    nbformat.write(empty, subs / "dave.ipynb")
    submission(subs, "eve.ipynb", lambda nb: (minimal(nb), nb.cells.insert(
        1, nbformat.v4.new_code_cell("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)  # the grader's worker"))))

    out = tmp_path / "out"
    argv = [str(subs), "--jobs", "2", "--cell-timeout", "30", "--json", str(out / "g.json"), "--csv",
            str(out / "g.csv"), "--csv-long", str(out / "long.csv"), "--feedback", str(out / "fb"), "--no-progress"]
    out.mkdir()
    assert grade.main(argv) == 0
    data = {d["student"]: d for d in json.loads((out / "g.json").read_text(encoding="utf-8"))}
    bob = MAX - POINTS["03-sdpa-numpy"]
    assert {s: d["score"] for s, d in data.items()} == {"alice": MAX, "bob": bob, "carol": 0.0, "dave": 0.0, "eve": 0.0}
    assert "grading process died" in data["eve"]["message"] and data["eve"]["max_score"] == MAX
    assert "not a readable notebook" in data["carol"]["message"] and data["carol"]["max_score"] == MAX
    rows = {r["student"]: r for r in csv.DictReader((out / "g.csv").open(encoding="utf-8"))}
    assert rows["alice"]["total"] == f"{MAX:g}" and rows["bob"]["03-sdpa-numpy"] == "0" and rows["bob"]["max_total"] == f"{MAX:g}"
    long = list(csv.DictReader((out / "long.csv").open(encoding="utf-8")))
    assert len(long) == 5 * COUNT and {r["status"] for r in long} >= {"passed", "failed", "error", "missing"}
    fb = (out / "fb" / "bob" / "03_scaled_dot_product_attention.md").read_text(encoding="utf-8")
    assert f"{bob:g} / {MAX:g}" in fb and "03-sdpa-numpy" in fb and "should be a function" in fb and "Hint:" in fb
    assert (out / "fb" / "carol" / "carol.md").exists()
    printed = capsys.readouterr().out  # in the order of the paths, whatever order the workers finished in
    order = [line.split("[")[1].split("]")[0] for line in printed.splitlines() if not line.startswith(" ")]
    assert order == ["alice", "bob", "carol", "dave", "eve"], printed
    assert printed.count("not a readable notebook") == 1 and "exercise(s) not graded" in printed


def test_restarts_are_capped(tmp_path, monkeypatch):
    """A notebook whose every run stops its kernel: at most MAX_RESTARTS fresh kernels, then every exercise not
    graded says why (no kernel is started here: the run is replaced by one that always reports a stuck cell)."""
    from attncourse.classroom.grading import notebook

    runs = []

    def always_stuck(nb, exercises, hidden, cell_timeout, timeout, deadline, salt, skip, graded, notes, stopped):
        runs.append(dict(skip))
        return notebook._Failure("stuck", index=len(runs), printed=0)

    monkeypatch.setattr(notebook, "_run_and_grade", always_stuck)
    result = grade.grade_notebook(submission(tmp_path, "03_stuck.ipynb", minimal), cell_timeout=10)
    assert len(runs) == notebook.MAX_RESTARTS + 1 and runs[-1] == {
        i: "ignored an interrupt and was stopped" for i in range(1, notebook.MAX_RESTARTS + 1)}
    assert {e.status for e in result.exercises} == {"timeout"} and len(result.exercises) == COUNT
    assert result.score == 0 and all("fresh kernels, or the notebook's time limit, used up" in e.message
                                     for e in result.exercises), result.exercises
    last = notebook.MAX_RESTARTS + 1
    assert f"cell {last + 1} of" in result.message and "run again" not in result.message.split(f"cell {last + 1} of")[1]


def test_after_an_interrupted_cell_later_cells_keep_their_output(tmp_path):
    """nbclient leaves a cell's output reader running when the cell times out; left alone, it takes messages meant
    for later cells (their prints went uncounted, their errors unseen, and each waited 4 s for an "idle" it never
    got). The grader stops it: every later cell's output reaches that cell's reader."""
    import asyncio

    from jupyter_core.utils import ensure_event_loop

    from attncourse.classroom.grading import session
    from attncourse.classroom.nbtools import kernel_manager

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import time\nwhile True:\n    time.sleep(0.01)"),
                nbformat.v4.new_code_cell("for i in range(20):\n    print('x' * 99, flush=True)\nraise ValueError('late')")]
    km = kernel_manager()
    client = session.make_client(nb, 30, km, tmp_path)
    with session.running(client, km):
        assert not session.execute(client, nb.cells[0], 0, 2)  # interrupted at its time limit
        readers = [t for t in asyncio.all_tasks(ensure_event_loop())
                   if getattr(t.get_coro(), "__qualname__", "").endswith("_async_poll_output_msg") and not t.done()]
        assert readers == []
        printed = client.printed
        assert session.execute(client, nb.cells[1], 1, 30)  # errors are kept as outputs, not raised
        assert client.printed - printed == 20 * 100
        assert any(o.get("ename") == "ValueError" for o in nb.cells[1].outputs), nb.cells[1].outputs
