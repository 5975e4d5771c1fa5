"""The student release: lessons, exercises, package and setup files; no solutions, hidden tests or answers.

"Solution lines" are the lines inside every ``### BEGIN SOLUTION`` / ``### BEGIN HIDDEN TESTS`` region of
``solutions/`` (comments dropped, whitespace collapsed, at least 20 characters). A solution line is
*distinctive* unless learners are meant to see it anyway: it also occurs in the student version of the
exercises (context around a stub, e.g. the buggy code of a find-the-bug exercise), in a lesson, in a
package module outside ``attncourse/classroom/checks`` (the reference implementations a learner may read), or in
an exercise's hint. No distinctive line may appear in any file of the release.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
    """The release as the command builds it: from the committed files (in a checkout with uncommitted changes,
    which the command would refuse, from the working tree: the refusal has its own test)."""
    out = tmp_path_factory.mktemp("rel") / "attncourse-student"
    if release.uncommitted(ROOT):
        release.build(out, make_zip=True, committed=False)
    else:
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
    pointing = [p.name for p in (built / "notebooks").glob("*.ipynb")
                if "solutions/" in "\n".join(c.source for c in nbformat.read(p, as_version=4).cells)]
    assert not pointing, f"lessons in the release send the learner to a solutions/ folder it lacks: {pointing}"
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


# ----------------------------------------------------------------------------- a release of its own (issue 32)


def test_release_readme_is_the_learners_and_links_only_what_it_holds(built):
    readme = (built / "README.md").read_text(encoding="utf-8")
    assert readme != (ROOT / "README.md").read_text(encoding="utf-8")
    assert "solutions/" not in readme and "./course test" not in readme and "shared/" not in readme
    assert "hidden tests" in readme and "./course check" in readme and "my-work/" in readme  # what to hand in
    from attncourse.classroom.workspace import work_name

    originals = {f"my-work/{folder}/{work_name(folder, p.name)}": p for folder in ("notebooks", "exercises")
                 for p in (built / folder).glob("*.ipynb")}  # what ./course lab copies, and from where
    for target in re.findall(r"\]\(([^)#\s]+)", readme):
        if target.startswith("my-work/"):
            assert target in originals, f"the README links {target}, which ./course lab does not make"
        elif not target.startswith("http"):
            assert (built / target).exists(), f"the README links {target}, which the release does not hold"
    lessons = sorted(p.name for p in (built / "notebooks").glob("*.ipynb"))
    assert all(f"(my-work/notebooks/{name})" in readme for name in lessons)  # the table links the learner's copies
    assert "(my-work/exercises/03_exercises_scaled_dot_product_attention.ipynb)" in readme
    for path in sorted([*(built / "notebooks").glob("*.ipynb"), *(built / "exercises").glob("*.ipynb")]):
        for cell in nbformat.read(path, as_version=4).cells:
            assert "](../solutions/" not in cell.source, f"{path.name} links solutions/, absent from the release"
    assert "my-work" not in (built / ".gitignore").read_text(encoding="utf-8")  # a student repo commits the work


def course(folder, *args, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    env.update(SKIP_SETUP="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return subprocess.run(["bash", str(folder / "course"), *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_every_command_the_release_offers_works_there(built, tmp_path):
    """From an unpacked copy of the zip: `./course help` offers only what works there; `./course test` says it
    is not part of a release; the learner's copies, a reset that keeps a backup, and a self-check that scores the
    notebook without hidden tests all work in the release itself."""
    with zipfile.ZipFile(f"{built}.zip") as z:
        z.extractall(tmp_path)
    folder = tmp_path / built.name
    (folder / "course").chmod(0o755)
    helped = course(folder, "help").stdout
    offered = re.findall(r"^  (\w+)", helped, re.M)
    assert offered == ["lab", "check", "reset", "setup"], helped
    refused = course(folder, "test")
    assert refused.returncode == 2 and "not part of this student release" in refused.stderr
    prepared = subprocess.run([sys.executable, "-m", "attncourse.classroom.workspace", "prepare"], cwd=folder,
                              capture_output=True, text=True, timeout=300)
    assert prepared.returncode == 0, prepared.stderr
    mine = folder / "my-work" / "exercises" / "03_exercises_scaled_dot_product_attention.ipynb"
    assert mine.exists() and not (folder / "my-work" / "solutions").exists()
    nb = nbformat.read(mine, as_version=4)
    nb.cells[0].source += "\n\nmy note"
    nbformat.write(nb, mine)
    reset = course(folder, "reset", str(mine.relative_to(folder)))
    assert reset.returncode == 0 and "my-work/backups/" in reset.stdout, reset.stdout + reset.stderr
    assert "my note" not in mine.read_text(encoding="utf-8")
    assert "my note" in next((folder / "my-work" / "backups").glob("03_exercises_*.ipynb")).read_text(encoding="utf-8")
    checked = course(folder, "check", "03", timeout=600)
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert re.search(r": 0 / \d+", checked.stdout) and "hidden" in checked.stderr and "WARNING" not in checked.stderr
    assert "03-sdpa-numpy" in checked.stdout


def git(root, *args):
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout


def test_release_is_built_from_the_commit_and_refuses_uncommitted_notebooks(tmp_path):
    """A lesson run (autosaved) or edited in place, or a notebook not committed, stops the release, named; once
    it is put back the release builds, from the committed files only (an untracked scratch file is not shipped)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(clone)], check=True, timeout=300)
    if not (clone / "solutions").is_dir():
        pytest.skip("this checkout has no commit holding the course")
    lesson = sorted((clone / "notebooks").glob("03_*.ipynb"))[0]
    lesson.write_text(lesson.read_text(encoding="utf-8").replace("Scaled", "Edited", 1), encoding="utf-8")
    (clone / "notebooks" / "99_scratch.ipynb").write_text("{}", encoding="utf-8")
    (clone / "attncourse" / "scratch.py").write_text("SECRET = 1\n", encoding="utf-8")
    with pytest.raises(RuntimeError) as info:
        release.build(tmp_path / "out", clone)
    assert f"notebooks/{lesson.name} (changed since the last commit)" in str(info.value)
    assert "notebooks/99_scratch.ipynb (untracked)" in str(info.value) and "scratch.py" not in str(info.value)
    assert not (tmp_path / "out").exists()
    git(clone, "checkout", "--", f"notebooks/{lesson.name}")
    (clone / "notebooks" / "99_scratch.ipynb").unlink()
    out = release.build(tmp_path / "out", clone)
    assert not (out / "attncourse" / "scratch.py").exists()
    assert (out / "notebooks" / lesson.name).exists()
