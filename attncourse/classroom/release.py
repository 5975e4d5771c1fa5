"""Build the student release: everything a learner needs, nothing that gives the answers away.

    python -m attncourse.release OUT [--zip] [--force]

OUT receives ``notebooks/`` (the lessons, executed), ``exercises/`` (generated afresh from
``solutions/`` so they cannot be stale: solution regions become stubs, hidden tests are dropped), the
``attncourse/`` package (reference implementations, checks, plots, the grader: no solution notebook
is in it), ``README.md``, ``environment.yml``, ``pyproject.toml`` and the ``course`` script. It never
receives ``solutions/``, ``tests/`` (they execute the solutions), ``.git`` or caches. After copying,
every file is scanned: a solution or hidden-test marker on a line of its own anywhere in the release
stops the build with an error. ``--zip`` also writes ``OUT.zip``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import nbformat

from .nbtools import BEGIN_HIDDEN, BEGIN_SOLUTION, END_HIDDEN, END_SOLUTION, ROOT, make_exercise

FILES = ("README.md", "environment.yml", "pyproject.toml", "course", "LICENSE", ".gitignore")
FOLDERS = ("notebooks", "attncourse")
SKIP = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache"}
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


def build(out: Path, root: Path = ROOT, *, force: bool = False, make_zip: bool = False) -> Path:
    """Write the release into `out` (a new or empty folder, or a previous release with `force`)."""
    out = Path(out)
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
