"""Build the student release: everything a learner needs, nothing that gives the answers away.

    python -m attncourse.release OUT [--zip] [--force]

The release is built from the course's *committed* files (``git archive HEAD``), never from the working tree:
a lesson an instructor ran or edited in JupyterLab (autosave) cannot slip into it. If a file the release would
hold differs from its committed version (or a notebook is untracked), the command stops and names the files:
commit them, or put them back (``./course reset PATH`` keeps a backup). Outside a git checkout (a copy of the
course) it uses the files as they are.

OUT receives ``notebooks/`` (the lessons, executed), ``exercises/`` (generated afresh from ``solutions/`` so they
cannot be stale: solution regions become stubs, hidden tests are dropped), the ``attncourse/`` package (reference
implementations, checks, plots, the grader: no solution notebook is in it), ``environment.yml``,
``pyproject.toml``, the ``course`` script and a learner's ``README.md`` (:data:`STUDENT_README`: how to start,
where their work lives, how exercises and checks work, how to check a notebook before handing it in; a chapter
table built from the lessons). Links to ``solutions/`` in the notebooks become words saying the solutions are
not included. It never receives ``solutions/``, ``tests/`` (they execute the solutions), ``.git``, ``my-work/``
or caches. After copying, every file is scanned: a solution or hidden-test marker on a line of its own anywhere
in the release stops the build with an error. ``--zip`` also writes ``OUT.zip``.
"""

from __future__ import annotations

import argparse
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from contextlib import contextmanager
from pathlib import Path

import nbformat

from .nbtools import BEGIN_HIDDEN, BEGIN_SOLUTION, END_HIDDEN, END_SOLUTION, ROOT, make_exercise

FILES = ("environment.yml", "pyproject.toml", "course", "LICENSE", ".gitignore")
STUDENT_README = Path(__file__).with_name("student_README.md")
SOURCES = (*FILES, "notebooks", "attncourse", "solutions", "exercises")  # what a release is built from
FOLDERS = ("notebooks", "attncourse")
SKIP = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache", "my-work"}
MARKERS = (BEGIN_SOLUTION, END_SOLUTION, BEGIN_HIDDEN, END_HIDDEN)
STAMP = ".attncourse-release"


def _text_lines(path: Path) -> list[str]:
    """The lines of a file as a learner would read them: a notebook's cell sources, else the text."""
    if path.suffix == ".ipynb":
        nb = nbformat.read(path, as_version=4)
        return [line for cell in nb.cells for line in cell.source.split("\n")]
    try:
        return path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError:
        return []


def find_markers(folder: Path) -> list[str]:
    """'path:line: marker' for every solution / hidden-test marker standing on a line of its own."""
    found = []
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        for number, line in enumerate(_text_lines(path), 1):
            if line.strip() in MARKERS:
                found.append(f"{path.relative_to(folder)}:{number}: {line.strip()}")
    return found


def _copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n in SKIP or n.endswith((".pyc", ".egg-info"))])


def _git(root: Path, *args: str, text: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=text)


def is_checkout(root: Path) -> bool:
    done = _git(root, "rev-parse", "--show-toplevel")
    return done.returncode == 0 and Path(done.stdout.strip()).resolve() == Path(root).resolve()


def uncommitted(root: Path = ROOT) -> list[str]:
    """The files a release is built from that differ from their committed version, and the untracked notebooks
    among them, as ``git status`` names them (empty outside a git checkout)."""
    if not is_checkout(root):
        return []
    done = _git(root, "status", "--porcelain", "--untracked-files=all", "--", *SOURCES)
    found = []
    for line in done.stdout.splitlines():
        state, path = line[:2], line[3:]
        if state == "??" and not path.endswith(".ipynb"):
            continue  # an untracked scratch file: never released (only committed files are)
        if "__pycache__" in path or path.endswith(".pyc") or ".ipynb_checkpoints" in path:
            continue
        found.append(f"{path} ({'untracked' if state == '??' else 'changed since the last commit'})")
    return found


@contextmanager
def committed_tree(root: Path):
    """A temporary folder holding the committed version of :data:`SOURCES` (``git archive HEAD``)."""
    with tempfile.TemporaryDirectory(prefix="attncourse-release-") as tmp:
        tracked = _git(root, "ls-tree", "--name-only", "HEAD", "--", *SOURCES).stdout.split()
        archive = _git(root, "archive", "--format=tar", "HEAD", "--", *tracked, text=False)
        if archive.returncode != 0:
            raise RuntimeError(f"git archive failed: {archive.stderr.decode(errors='replace').strip()}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(tmp)
        yield Path(tmp)


def chapter_table(root: Path) -> str:
    """The README's chapter rows, from each lesson's first heading (never a hard-coded list)."""
    from .workspace import WORK, work_name

    rows = []
    for path in sorted((root / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        first = next((c.source for c in nb.cells if c.cell_type == "markdown"), "")
        title = first.split("\n", 1)[0].lstrip("# ").strip()
        title = re.sub(r"^\d\d\s*[·:.-]\s*", "", title) or path.stem
        number = path.name[:2]
        exercise = root / "exercises" / path.name
        lesson = f"[{title}]({WORK}/notebooks/{path.name})"  # the learner's copy: the original stays as handed out
        mine = work_name("exercises", path.name)
        mine = f"[{mine}]({WORK}/exercises/{mine})" if exercise.exists() else ""
        rows.append(f"| {number} | {lesson} | {mine} |")
    return "\n".join(rows)


def student_readme(root: Path) -> str:
    torch_version = re.search(r'TORCH_VERSION:-([\w.]+)', (root / "course").read_text(encoding="utf-8"))
    text = STUDENT_README.read_text(encoding="utf-8")
    return text.replace("{chapters}", chapter_table(root)).replace("{torch}", torch_version.group(1) if torch_version else "")


def _without_solution_links(path: Path) -> None:
    """Links into solutions/ (absent from a release) become words saying so."""
    from .workspace import NOT_HERE, rewrite_links

    nb = nbformat.read(path, as_version=4)
    changed = False
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            new = rewrite_links(cell.source, {"notebooks", "exercises"}, rename=False)
            new = re.sub(r"Solutions are in\s+`solutions/`\.", "Solutions are not included in this release: your "
                         "instructor has them.", new)
            new = re.sub(r"\(`(\.\./)?solutions/[^`]*` " + re.escape(NOT_HERE) + r"\)", NOT_HERE, new)
            new = re.sub(r"solutions in\s+`solutions/`\s*", "solutions ", new)
            changed |= new != cell.source
            cell.source = new
    if changed:
        nbformat.write(nb, path)


def build(out: Path, root: Path = ROOT, *, force: bool = False, make_zip: bool = False,
          committed: bool | None = None) -> Path:
    """Write the release into `out` (a new or empty folder, or a previous release with `force`).

    `committed` (default: when `root` is a git checkout) builds from the committed files and refuses, naming
    them, when any of them differs from its committed version; False uses the files as they are."""
    committed = is_checkout(root) if committed is None else committed
    if committed:
        dirty = uncommitted(root)
        if dirty:
            raise RuntimeError("these files differ from their committed version, so the release would not be what "
                               "you see (it is built from the commit):\n  " + "\n  ".join(dirty) +
                               "\ncommit them, or put them back: `./course reset PATH` (it keeps a backup in "
                               "my-work/backups/)")
        with committed_tree(root) as tree:
            return _build(Path(out), tree, force=force, make_zip=make_zip)
    return _build(Path(out), root, force=force, make_zip=make_zip)


def _build(out: Path, root: Path, *, force: bool, make_zip: bool) -> Path:
    if out.exists() and any(out.iterdir()):
        if not (force and (out / STAMP).exists()):
            raise FileExistsError(f"{out} is not empty" + ("" if force else " (use --force to replace a previous release)")
                                  + ("; --force only replaces a folder made by this command" if force else ""))
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        if (root / name).is_file():
            shutil.copy2(root / name, out / name)
    for name in FOLDERS:
        _copy_tree(root / name, out / name)
    (out / "exercises").mkdir()
    solutions = sorted((root / "solutions").glob("*.ipynb"))
    if solutions:  # the single source: regenerate rather than trust a possibly stale exercises/
        for src in solutions:
            nb = make_exercise(nbformat.read(src, as_version=4), src.name)
            (out / "exercises" / src.name).write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    else:
        for src in sorted((root / "exercises").glob("*.ipynb")):
            shutil.copy2(src, out / "exercises" / src.name)
    (out / "README.md").write_text(student_readme(root), encoding="utf-8")
    ignore = out / ".gitignore"
    if ignore.exists():  # a student repository commits the learner's work: my-work/ is ignored only in the course's
        ignore.write_text("".join(line for line in ignore.read_text(encoding="utf-8").splitlines(keepends=True)
                                  if line.strip().rstrip("/") != "my-work"), encoding="utf-8")
    for path in sorted([*(out / "notebooks").glob("*.ipynb"), *(out / "exercises").glob("*.ipynb")]):
        _without_solution_links(path)
    (out / STAMP).write_text("Student release of attncourse, built by `python -m attncourse.release`.\n",
                             encoding="utf-8")
    problems = find_markers(out)
    if problems:
        raise RuntimeError("solution markup found in the release:\n  " + "\n  ".join(problems))
    if make_zip:
        shutil.make_archive(str(out), "zip", root_dir=out.parent, base_dir=out.name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attncourse.release", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder to create (e.g. release/attncourse-student)")
    parser.add_argument("--zip", action="store_true", help="also write OUT.zip")
    parser.add_argument("--force", action="store_true", help="replace a release previously built in OUT")
    args = parser.parse_args(argv)
    try:
        out = build(args.out, force=args.force, make_zip=args.zip)
    except (FileExistsError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    files = sum(1 for p in out.rglob("*") if p.is_file())
    print(f"release written to {out} ({files} files)" + (f" and {out}.zip" if args.zip else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
