"""The student release: lessons, exercises, package and setup files; no solutions, hidden tests or answers.

"Solution lines" are the lines inside every ``### BEGIN SOLUTION`` / ``### BEGIN HIDDEN TESTS`` region of
``solutions/`` (comments dropped, whitespace collapsed, at least 20 characters). A solution line is
*distinctive* unless learners are meant to see it anyway: it also occurs in the student version of the
exercises (context around a stub, e.g. the buggy code of a find-the-bug exercise), in a lesson, in a
package module outside ``attncourse/classroom/checks`` (the reference implementations a learner may read), or in
an exercise's hint. No distinctive line may appear in any file of the release.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import nbformat
import pytest

from attncourse.classroom import checks, nbtools, release

ROOT = Path(__file__).resolve().parent.parent
REGIONS = ((nbtools.BEGIN_SOLUTION, nbtools.END_SOLUTION), (nbtools.BEGIN_HIDDEN, nbtools.END_HIDDEN))


def normal(line: str, code: bool = True) -> str:
    return " ".join((line.split("#")[0] if code else line).split())


def solution_lines() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            for begin, end in REGIONS:
                inside = False
                for line in cell.source.split("\n"):
                    if line.strip() == begin:
                        inside = True
                    elif line.strip() == end:
                        inside = False
                    elif inside and len(text := normal(line, cell.cell_type == "code")) >= 20:
                        found.setdefault(text, set()).add(path.name)
    return found


def readable(path: Path) -> str:
    if path.suffix == ".ipynb":
        nb = nbformat.read(path, as_version=4)
        return "\n".join(c.source for c in nb.cells)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""


def flat(text: str) -> str:
    return " ".join(text.split())


def public_text() -> str:
    paths = [*(ROOT / "exercises").glob("*.ipynb"), *(ROOT / "notebooks").glob("*.ipynb"),
             *(p for p in (ROOT / "attncourse").rglob("*.py") if "checks" not in p.parts)]
    hints = [ex.hint for ex in checks.registry().values()]
    return flat("\n".join([*(readable(p) for p in paths), *hints]))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("rel") / "attncourse-student"
    assert release.main([str(out), "--zip"]) == 0
    return out


def test_release_has_the_course_and_nothing_else(built):
    names = {p.name for p in built.iterdir()}
    assert {"notebooks", "exercises", "attncourse", "README.md", "environment.yml", "pyproject.toml", "course"} <= names
    assert not names & {"solutions", "tests", ".git", ".ci", ".venv", "conftest.py"}
    assert sorted(p.name for p in (built / "exercises").glob("*.ipynb")) == \
        sorted(p.name for p in (ROOT / "solutions").glob("*.ipynb"))
    assert sorted(p.name for p in (built / "notebooks").glob("*.ipynb")) == \
        sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert (built / "attncourse" / "classroom" / "checks" / "__init__.py").exists()
    assert not list(built.rglob("__pycache__")) and not list(built.rglob("*.pyc"))
    with zipfile.ZipFile(f"{built}.zip") as z:
        zipped = {n for n in z.namelist() if not n.endswith("/")}
    assert zipped == {f"{built.name}/{p.relative_to(built).as_posix()}" for p in built.rglob("*") if p.is_file()}


def test_release_holds_no_markers_hidden_tests_or_solution_lines(built):
    assert release.find_markers(built) == []
    public = public_text()
    distinctive = {line: where for line, where in solution_lines().items() if line not in public}
    assert len(distinctive) >= 20  # the scan has something to look for
    leaks = []
    for path in sorted(p for p in built.rglob("*") if p.is_file()):
        text = flat(readable(path))
        leaks += [f"{path.relative_to(built)}: {line!r} (from {sorted(where)})" for line, where in distinctive.items()
                  if line in text]
    assert not leaks, "solution code in the release:\n" + "\n".join(leaks)


def test_the_scan_catches_a_leak(tmp_path, built):
    """The same scan on a release with one solution notebook slipped in reports it."""
    leaky = tmp_path / "leaky"
    release.build(leaky)
    name = "03_scaled_dot_product_attention.ipynb"
    (leaky / "attncourse" / "data").mkdir(exist_ok=True)
    (leaky / "attncourse" / "data" / name).write_bytes((ROOT / "solutions" / name).read_bytes())
    assert any(name in m and nbtools.BEGIN_HIDDEN in m for m in release.find_markers(leaky))
    public = public_text()
    text = flat(readable(leaky / "attncourse" / "data" / name))
    assert any(line in text for line in solution_lines() if line not in public)


def test_build_refuses_to_overwrite_other_folders(tmp_path):
    (tmp_path / "mine.txt").write_text("precious", encoding="utf-8")
    with pytest.raises(FileExistsError):
        release.build(tmp_path, force=True)
    assert (tmp_path / "mine.txt").exists()
