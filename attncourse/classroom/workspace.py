"""The learner's own copies of the notebooks, kept apart from the course's tracked files.

    python -m attncourse.classroom.workspace prepare        # what `./course lab` runs first
    python -m attncourse.classroom.workspace reset WHAT...  # `./course reset`: a fresh copy, the old one kept
    python -m attncourse.classroom.workspace check WHAT     # `./course check`: a notebook scored as the grader would

JupyterLab saves every notebook it runs (autosave), so a learner who worked in the course's own ``notebooks/`` and
``exercises/`` would change tracked files: a course update (``git pull``) would conflict with their work, the
tests would read it, and regenerating the exercises would overwrite it. ``./course lab`` therefore gives each
learner a folder of their own, :data:`WORK` (``my-work/``, ignored by git and left out of releases)::

    my-work/notebooks/03_scaled_dot_product_attention.ipynb             the lesson (run it, change it)
    my-work/exercises/03_exercises_scaled_dot_product_attention.ipynb   your answers
    my-work/solutions/03_solutions_scaled_dot_product_attention.ipynb   the worked solutions (not in a release)

The copies carry the kind in their names, so JupyterLab's tabs tell a lesson, its exercises and its solutions
apart; the links between them are rewritten to the new names, so every link still works.

Rules, so that nothing a learner wrote is ever lost:

* a copy is made once, when it is missing (a new chapter gets its copies on the next ``./course lab``);
* a copy whose cell *sources* are still exactly what was copied (running cells changes only outputs) is
  replaced when the course's version changes: a course update reaches every notebook the learner has not
  edited; a copy the learner edited is never touched, and ``prepare`` says that a newer version exists;
* :func:`reset` moves the current copy to ``my-work/backups/`` before writing a fresh one; for a tracked file
  (``notebooks/03_....ipynb`` edited in place) it restores the committed version, again keeping a backup.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat

from .nbtools import ROOT

WORK = "my-work"
STATE = ".attncourse-work.json"  # what each copy was made from, and its sources' hash at that time
BACKUPS = "backups"
# folder -> the word put after the chapter number in the copy's name ("" keeps the name)
KINDS = {"notebooks": "", "exercises": "exercises", "solutions": "solutions"}
_NAME = re.compile(r"^(\d\d)_(.+)$")


def work_name(folder: str, name: str) -> str:
    """The copy's file name: ``03_scaled_dot_product_attention.ipynb`` in exercises/ becomes
    ``03_exercises_scaled_dot_product_attention.ipynb`` (a lesson keeps its name)."""
    kind = KINDS[folder]
    match = _NAME.match(name)
    if not kind or not match:
        return name
    return f"{match.group(1)}_{kind}_{match.group(2)}"


_LINK = re.compile(r"\[([^\]]*)\]\((\.\./)?(notebooks|exercises|solutions)/(\d\d_[^)#\s]+\.ipynb)(#[^)\s]*)?\)")
NOT_HERE = "(not included in this release: your instructor has the solutions)"


def rewrite_links(source: str, available: set[str], rename: bool = True) -> str:
    """Markdown links between the course's folders, pointed at the copies' names (`rename`). `available` holds
    the folders that exist (a release has no solutions/): a link into any other folder becomes its label and a
    note saying it is not in this release."""

    def fix(match: re.Match) -> str:
        label, up, folder, name, anchor = (match.group(1), match.group(2) or "", match.group(3), match.group(4),
                                           match.group(5) or "")
        if folder not in available:
            return f"{label} {NOT_HERE}"
        new = work_name(folder, name) if rename else name
        label = label.replace(name, new)
        if re.fullmatch(r"`[^`]+\.ipynb`", label):  # a path as inline code reads as code, not as a link
            label = label.strip("`")
        return f"[{label}]({up}{folder}/{new}{anchor})"

    return _LINK.sub(fix, source)


def _sources_hash(nb: nbformat.NotebookNode) -> str:
    text = "\x00".join(f"{c.cell_type}\x01{c.source}" for c in nb.cells)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _copy_of(src: Path, folder: str, available: set[str]) -> nbformat.NotebookNode:
    nb = nbformat.read(src, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = rewrite_links(cell.source, available)
    nb.metadata.setdefault("attncourse", {})["copied_from"] = f"{folder}/{src.name}"
    return nb


def _write(nb: nbformat.NotebookNode, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def _load_state(work: Path) -> dict:
    try:
        return json.loads((work / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _save_state(work: Path, state: dict) -> None:
    (work / STATE).write_text(json.dumps(state, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def sources(root: Path = ROOT) -> list[tuple[str, Path]]:
    """(folder, notebook) for every notebook the course has, in folders this checkout or release holds."""
    return [(folder, path) for folder in KINDS for path in sorted((root / folder).glob("*.ipynb"))]


DATA_DIRS = ("results", "data")  # what lessons read by a relative path (stored runs, measurements)


def _link_data(root: Path, work: Path, available: set[str]) -> None:
    """The copies open files such as ``results/induction_runs.pt`` relative to their own folder: give each copied
    folder a link to the course's data folders (a copy where links are not allowed)."""
    import shutil

    for folder in sorted(available):
        for name in DATA_DIRS:
            src, dst = root / folder / name, work / folder / name
            if not src.is_dir() or dst.exists() or dst.is_symlink():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                dst.symlink_to(Path("..") / ".." / folder / name, target_is_directory=True)
            except OSError:  # e.g. Windows without the right to make links
                shutil.copytree(src, dst)


def prepare(root: Path = ROOT, out=None) -> dict[str, list[str]]:
    """Create the missing copies and bring the untouched ones up to date; never change an edited copy.
    Returns ``{"created": [...], "updated": [...], "kept": [...]}`` (paths relative to the course root;
    "kept": edited copies whose course version changed since)."""
    out = out or sys.stdout
    work = root / WORK
    state = _load_state(work)
    available = {folder for folder in KINDS if (root / folder).is_dir()}
    done: dict[str, list[str]] = {"created": [], "updated": [], "kept": []}
    for folder, src in sources(root):
        rel = f"{folder}/{work_name(folder, src.name)}"
        dst = work / rel
        fresh = _copy_of(src, folder, available)
        fresh_hash = _sources_hash(fresh)
        if not dst.exists():
            _write(fresh, dst)
            state[rel] = {"from": f"{folder}/{src.name}", "sources": fresh_hash}
            done["created"].append(f"{WORK}/{rel}")
            continue
        if state.get(rel, {}).get("sources") == fresh_hash:
            continue  # the course's version has not changed since the copy was made
        try:
            mine = _sources_hash(nbformat.read(dst, as_version=4))
        except Exception:  # unreadable: certainly not ours to replace
            mine = None
        if mine is not None and mine == state.get(rel, {}).get("sources"):  # untouched: take the new version
            _write(fresh, dst)
            state[rel] = {"from": f"{folder}/{src.name}", "sources": fresh_hash}
            done["updated"].append(f"{WORK}/{rel}")
        elif mine == fresh_hash:  # the learner's copy already equals the new version
            state[rel] = {"from": f"{folder}/{src.name}", "sources": fresh_hash}
        else:
            done["kept"].append(f"{WORK}/{rel}")
    work.mkdir(exist_ok=True)
    _link_data(root, work, available)
    _save_state(work, state)
    if done["created"]:
        print(f"== {len(done['created'])} notebook(s) copied into {WORK}/: your own copies (JupyterLab saves your "
              "work there; the course's files stay as committed)", file=out)
    if done["updated"]:
        print(f"== {len(done['updated'])} notebook(s) you had not edited updated to the course's new version: "
              + ", ".join(Path(p).name for p in done["updated"]), file=out)
    for path in done["kept"]:
        print(f"== {path}: the course has a newer version; yours has your edits and is kept as it is "
              f"(`./course reset {path}` takes the new one and keeps yours in {WORK}/{BACKUPS}/: open both and copy "
              f"your answer cells into the new one)", file=out)
    return done


# ----------------------------------------------------------------------------- reset


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)


def resolve(what: str, root: Path = ROOT, kind: str = "notebooks") -> Path:
    """A path (relative to the course root, or absolute) or a chapter number ("03": its copy in `kind`)."""
    if re.fullmatch(r"\d\d?", what):
        chapter = f"{int(what):02d}"
        found = sorted((root / WORK / kind).glob(f"{chapter}_*.ipynb"))
        if not found:
            raise FileNotFoundError(f"no {kind} copy of chapter {chapter} in {WORK}/{kind}/ (run ./course lab once)")
        return found[0]
    path = Path(what)
    if not path.is_absolute():
        path = (Path.cwd() / path) if (Path.cwd() / path).exists() else (root / path)
    return path.resolve()


def _backup(path: Path, root: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dst = root / WORK / BACKUPS / f"{path.stem}.{stamp}{path.suffix}"
    n = 1
    while dst.exists():
        n += 1
        dst = dst.with_name(f"{path.stem}.{stamp}-{n}{path.suffix}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, dst)
    return dst


def reset(path: Path, root: Path = ROOT) -> tuple[Path, Path | None]:
    """Put the course's version of `path` back (a copy in my-work/, or a tracked notebook edited in place);
    the current file is first copied to ``my-work/backups/``. Returns (path, backup or None)."""
    root = root.resolve()
    path = Path(path).resolve()
    rel = path.relative_to(root).as_posix()
    work = root / WORK
    backup = _backup(path, root) if path.exists() else None
    if rel.startswith(f"{WORK}/"):
        inner = rel[len(WORK) + 1:]
        state = _load_state(work)
        origin = state.get(inner, {}).get("from")
        if origin is None:  # not recorded: find it by name
            folder, name = inner.split("/", 1) if "/" in inner else ("", inner)
            origin = next((f"{folder}/{src.name}" for f, src in sources(root)
                           if f == folder and work_name(f, src.name) == name), None)
        if origin is None or not (root / origin).exists():
            raise FileNotFoundError(f"{rel} is not a copy of a course notebook")
        folder = origin.split("/", 1)[0]
        available = {f for f in KINDS if (root / f).is_dir()}
        fresh = _copy_of(root / origin, folder, available)
        _write(fresh, path)
        state[inner] = {"from": origin, "sources": _sources_hash(fresh)}
        _save_state(work, state)
        return path, backup
    # a tracked file, edited in place: the committed version
    shown = subprocess.run(["git", "-C", str(root), "show", f"HEAD:{rel}"], capture_output=True)
    if shown.returncode != 0:
        why = shown.stderr.decode(errors="replace").strip() or "not a git checkout"
        raise FileNotFoundError(f"{rel}: no committed version to go back to ({why})")
    path.write_bytes(shown.stdout)
    return path, backup


# ----------------------------------------------------------------------------- check


def check_target(what: str, root: Path = ROOT) -> Path:
    """The notebook `./course check` grades: a path, or a chapter number (its exercises copy)."""
    return resolve(what, root, kind="exercises")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attncourse.classroom.workspace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help=f"create the learner's copies in {WORK}/ (never overwrites an edited copy)")
    res = sub.add_parser("reset", help="a fresh copy of a notebook, the current one kept in my-work/backups/")
    res.add_argument("what", nargs="+", help="a notebook path, or a chapter number (its lesson)")
    chk = sub.add_parser("check", help="score a notebook as the grader would (no hidden tests)")
    chk.add_argument("what", help="a notebook path, or a chapter number (your exercises of that chapter)")
    args = parser.parse_args(argv)
    # the course folder this runs in (`./course` runs from its own folder), else the package's checkout
    root = Path.cwd() if (Path.cwd() / "notebooks").is_dir() else ROOT
    if args.command == "prepare":
        prepare(root)
        return 0
    if args.command == "reset":
        status = 0
        for what in args.what:
            try:
                path, backup = reset(resolve(what, root), root)
            except (FileNotFoundError, ValueError) as err:
                print(f"error: {err}", file=sys.stderr)
                status = 1
                continue
            shown = path.relative_to(root.resolve())
            print(f"{shown}: back to the course's version" +
                  (f"; your previous copy is {backup.relative_to(root.resolve())}" if backup else ""))
        return status
    try:
        target = check_target(args.what, root)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    from .grade import main as grade

    print(f"== checking {target.relative_to(root.resolve()) if target.is_relative_to(root.resolve()) else target} "
          "as the grader would (your saved file: save in JupyterLab first; hidden tests are not run)", file=sys.stderr)
    status = grade([str(target), "--no-hidden", "--no-progress"])
    print("(written answers are graded by hand and are not part of this score)", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
