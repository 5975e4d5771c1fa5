"""Exercise generation from solutions: stubs, hidden tests, outputs, metadata, and malformed markup."""

import os
import re

import nbformat
import pytest

from attncourse.classroom import nbtools


def test_solution_region_becomes_an_indented_stub():
    src = "def f(x):\n    '''doc'''\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n\nprint('after')"
    out = nbtools.student_source(src, "code")
    assert out == ("def f(x):\n    '''doc'''\n    # YOUR CODE HERE\n    raise NotImplementedError()\n\nprint('after')")


def test_top_level_region_and_markdown_answer():
    assert nbtools.student_source("### BEGIN SOLUTION\nanswer = 3\n### END SOLUTION", "code") == (
        "# YOUR CODE HERE\nraise NotImplementedError()")
    assert nbtools.student_source("**Why?**\n\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION", "markdown") == (
        "**Why?**\n\nYOUR ANSWER HERE")


def test_hidden_tests_are_removed():
    src = 'check("03-x")\n### BEGIN HIDDEN TESTS\nassert secret()\n### END HIDDEN TESTS\nprint(1)'
    assert nbtools.student_source(src, "code") == 'check("03-x")\nprint(1)'


@pytest.mark.parametrize("src, words", [
    ("### BEGIN SOLUTION\nx = 1", "never closed"),
    ("x = 1\n### END SOLUTION", "without"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "nested"),
])
def test_malformed_markup_is_an_error(src, words):
    with pytest.raises(ValueError, match=words):
        nbtools.student_source(src, "code", "nb cell 3")


def test_make_exercise_clears_outputs_and_keeps_metadata():
    sol = nbtools.solution("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION", "99-f")
    sol.outputs = [nbformat.v4.new_output("stream", text="hi")]
    sol.execution_count = 4
    nb = nbtools.new_notebook([nbtools.md("# t"), sol, nbtools.check_cell("99-f", 2)], "99")
    ex = nbtools.make_exercise(nb)
    assert ex.cells[1].outputs == [] and ex.cells[1].execution_count is None
    assert ex.cells[1].metadata["nbgrader"]["grade_id"] == "99-f-answer"
    assert ex.cells[2].metadata["nbgrader"]["points"] == 2 and ex.cells[2].metadata["nbgrader"]["locked"]
    assert "NotImplementedError" in ex.cells[1].source and "return 1" not in ex.cells[1].source
    assert sol.source.endswith("### END SOLUTION"), "the solution notebook itself is untouched"


def test_builders_refuse_cells_without_markup():
    with pytest.raises(ValueError, match="no '### BEGIN SOLUTION'"):
        nbtools.solution("x = 1", "99-x")
    with pytest.raises(ValueError, match="no '### BEGIN SOLUTION'"):
        nbtools.written_answer("why?", "99-why", 1)


def test_generate_exercises_writes_and_detects_drift(tmp_path):
    (tmp_path / "solutions").mkdir()
    nb = nbtools.new_notebook([nbtools.solution("### BEGIN SOLUTION\na = 1\n### END SOLUTION", "99-a")], "99")
    nbformat.write(nb, tmp_path / "solutions" / "99_demo.ipynb")
    assert nbtools.generate_exercises(tmp_path, check_only=True) == ["99_demo.ipynb"]
    assert nbtools.generate_exercises(tmp_path) == ["99_demo.ipynb"]
    assert nbtools.generate_exercises(tmp_path, check_only=True) == []
    (tmp_path / "exercises" / "98_stale.ipynb").write_text("{}")
    assert nbtools.generate_exercises(tmp_path) == ["98_stale.ipynb"]
    assert not (tmp_path / "exercises" / "98_stale.ipynb").exists()


def exercise_notebook():
    sol = nbtools.solution("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION", "99-f")
    cells = [nbtools.md("# t"), nbtools.code("import math"), sol, nbtools.check_cell("99-f", 2), nbtools.code("f()")]
    return nbtools.new_notebook(cells, "99")


def test_normalize_kernelspec_read_only_checks_and_run_all_tags():
    nb = exercise_notebook()
    nb.metadata.kernelspec = {"display_name": "Python 3", "language": "python", "name": "python3"}
    for cell in nb.cells:
        cell.metadata.pop("editable", None), cell.metadata.pop("deletable", None)
    assert nbtools.normalize(nb)
    assert nb.metadata.kernelspec == nbtools.KERNELSPEC
    check = nb.cells[3]
    assert check.metadata["editable"] is False and check.metadata["deletable"] is False
    assert check.metadata["nbgrader"]["locked"] is True  # nbgrader's flag stays beside JupyterLab's
    assert "editable" not in nb.cells[2].metadata and "editable" not in nb.cells[4].metadata
    assert not any("tags" in c.metadata for c in nb.cells), "a solution notebook gets no raises-exception tags"
    assert not nbtools.normalize(nb), "normalizing twice changes nothing"

    ex = nbtools.make_exercise(nb)  # the exercise: every code cell from the first answer on keeps Run All going
    assert [c.metadata.get("tags", []) for c in ex.cells] == [[], [], ["raises-exception"], ["raises-exception"],
                                                               ["raises-exception"]]
    assert ex.cells[3].metadata["editable"] is False and not nbtools.normalize(ex)
    assert [c.source for c in ex.cells[3:]] == [c.source for c in nb.cells[3:]], "sources are never touched"


def test_installed_kernel_has_the_stored_display_name():
    """The notebooks store the display name of the kernel `./course` installs (else they open as modified)."""
    from jupyter_client.kernelspec import KernelSpecManager

    assert KernelSpecManager().get_kernel_spec("python3").display_name == nbtools.KERNELSPEC["display_name"]


def test_normalize_command_and_execute_apply_it(tmp_path):
    path = tmp_path / "99_demo.ipynb"
    nb = exercise_notebook()
    nb.metadata.kernelspec["display_name"] = "Python 3"
    nb.cells[3].metadata.pop("editable")
    nb.cells[3].source = "print('checked')"  # executed below without the registry
    nbformat.write(nb, path)
    assert nbtools.main(["normalize", "--check", str(path)]) == 1
    assert nbtools.main(["normalize", str(path)]) == 0
    assert nbtools.main(["normalize", "--check", str(path)]) == 0
    nb = nbformat.read(path, as_version=4)
    nb.metadata.kernelspec["display_name"] = "Python 3"
    nbformat.write(nb, path)
    nbtools.execute(path, timeout=60)
    nb = nbformat.read(path, as_version=4)
    assert nb.metadata.kernelspec == nbtools.KERNELSPEC and nb.cells[3].outputs[0]["text"] == "checked\n"


# ----------------------------------------------------------------------------- the learner's own copies (issue 32)


def course_folder(tmp_path, stub="raise NotImplementedError()"):
    """A small course: a lesson linking its exercises, and exercises linking the lesson and the solutions."""
    root = tmp_path / "course"
    for folder in ("notebooks", "exercises", "solutions"):
        (root / folder).mkdir(parents=True)
    lesson = nbtools.new_notebook([nbtools.md("# 99 · Demo\n\n[exercises](../exercises/99_demo.ipynb)"),
                                   nbtools.code("x = 1")], "99")
    nbformat.write(lesson, root / "notebooks" / "99_demo.ipynb")
    cells = [nbtools.md("# ex\n\n[`../notebooks/99_demo.ipynb`](../notebooks/99_demo.ipynb#Summary) and "
                        "[`../solutions/99_demo.ipynb`](../solutions/99_demo.ipynb)"),
             nbtools.solution(f"def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION", "99-f")]
    nbformat.write(nbtools.new_notebook(cells, "99"), root / "solutions" / "99_demo.ipynb")
    nbtools.generate_exercises(root)
    return root


def test_copies_are_made_once_with_names_that_tell_tabs_apart_and_links_that_work(tmp_path):
    from attncourse.classroom import workspace

    root = course_folder(tmp_path)
    done = workspace.prepare(root, out=open(os.devnull, "w"))
    work = root / workspace.WORK
    names = sorted(p.relative_to(work).as_posix() for p in work.rglob("*.ipynb"))
    assert names == ["exercises/99_exercises_demo.ipynb", "notebooks/99_demo.ipynb", "solutions/99_solutions_demo.ipynb"]
    assert len(done["created"]) == 3
    for path in work.rglob("*.ipynb"):  # every relative link of every copy points at a file that exists
        for cell in nbformat.read(path, as_version=4).cells:
            for target in re.findall(r"\]\(([^)#]+)", cell.source):
                assert (path.parent / target).resolve().exists(), f"{path.name}: {target}"
    text = (work / "exercises" / "99_exercises_demo.ipynb").read_text(encoding="utf-8")
    assert "[../solutions/99_solutions_demo.ipynb](../solutions/99_solutions_demo.ipynb)" in text  # a link, not code
    assert "raises-exception" in text  # Run All still goes past the stubs in the copy


def test_a_course_update_reaches_untouched_copies_and_never_an_edited_one(tmp_path):
    from attncourse.classroom import workspace

    root = course_folder(tmp_path)
    quiet = open(os.devnull, "w")
    workspace.prepare(root, out=quiet)
    work = root / workspace.WORK
    lesson, mine = work / "notebooks" / "99_demo.ipynb", work / "exercises" / "99_exercises_demo.ipynb"
    nb = nbformat.read(lesson, as_version=4)  # the learner runs the lesson: outputs only
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="1\n")]
    nbformat.write(nb, lesson)
    nb = nbformat.read(mine, as_version=4)  # ... and answers an exercise
    nb.cells[1].source = "def f():\n    return 1"
    nbformat.write(nb, mine)
    for folder, name in (("notebooks", "99_demo.ipynb"), ("solutions", "99_demo.ipynb")):  # a course update
        path = root / folder / name
        nb = nbformat.read(path, as_version=4)
        nb.cells.append(nbtools.md("## New section"))
        nbformat.write(nb, path)
    nbtools.generate_exercises(root)
    done = workspace.prepare(root, out=quiet)
    assert f"{workspace.WORK}/notebooks/99_demo.ipynb" in done["updated"]
    assert done["kept"] == [f"{workspace.WORK}/exercises/99_exercises_demo.ipynb"]
    assert "New section" in lesson.read_text(encoding="utf-8")
    assert "return 1" in mine.read_text(encoding="utf-8") and "New section" not in mine.read_text(encoding="utf-8")
    assert workspace.prepare(root, out=quiet)["updated"] == []  # idempotent
    path, backup = workspace.reset(mine, root)  # the one command that takes the new version, keeping the old
    assert "New section" in mine.read_text(encoding="utf-8") and "return 1" in backup.read_text(encoding="utf-8")
    assert backup.parent == work / workspace.BACKUPS


def test_regenerating_exercises_keeps_answers_written_in_them(tmp_path):
    root = course_folder(tmp_path)
    path = root / "exercises" / "99_demo.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].source = "def f():\n    return 'my answer'"
    nbformat.write(nb, path)
    assert nbtools.generate_exercises(root) == ["99_demo.ipynb"]  # what the test suite's advice runs
    kept = list((root / "my-work" / "backups").glob("99_demo.*.ipynb"))
    assert len(kept) == 1 and "my answer" in kept[0].read_text(encoding="utf-8")
    assert nbtools.generate_exercises(root) == [] and len(list((root / "my-work" / "backups").iterdir())) == 1


def test_time_benchmark_reports_wall_cpu_and_cells_without_writing(tmp_path, capsys):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = sum(i * i for i in range(3_000_000))"),
                nbformat.v4.new_code_cell("y = 1")]
    path = tmp_path / "busy.ipynb"
    nbformat.write(nb, path)
    before = path.read_bytes()
    from attncourse.classroom.timing import time_notebook

    wall, cpu, cells = time_notebook(path)
    assert path.read_bytes() == before  # a benchmark never writes the notebook
    assert [i for i, _ in cells] == [0, 1]  # the CPU probe cell is not reported
    assert cpu is not None and 0.05 < cpu < wall + 5
    assert cells[0][1] > cells[1][1]
    assert nbtools.main(["time", "--budget", "0.001", str(path)]) == 1  # over a tiny budget: exit 1, named
    assert "busy.ipynb" in capsys.readouterr().out
