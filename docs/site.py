"""Build the course as a static website, offline, from the committed notebooks (``./course site``).

    python docs/site.py [--no-solutions] [--serve [--port N]] [--clean]

The site's sources are staged in ``build/site-src/`` (git-ignored): this folder's pages, copies of notebooks/,
exercises/ and solutions/ (the committed files are never changed; each page's copy gets a box saying how to run it
and where its exercises and the next lesson are), and pages generated here: the chapter map (the home page) and one
API page per chapter, from globbing ``notebooks/NN_*.ipynb`` (a new chapter appears without an edit here). Sphinx
(MyST-NB, execution off: the outputs shown are the committed ones nbval checks) then writes ``build/site/`` with
warnings as errors. ``--serve`` serves it on 127.0.0.1 and prints the address.
"""

from __future__ import annotations

import argparse
import ast
import functools
import http.server
import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
BUILD = ROOT / "build"
SRC, OUT, DOCTREES = BUILD / "site-src", BUILD / "site", BUILD / "site-doctrees"
CHAPTER = re.compile(r"^(\d\d)_[a-z0-9_]+\.ipynb$")

# The chapter whose API page shows a module. A module not named here goes to the first chapter (01 on) whose
# lesson or solutions use it, so a new chapter's modules find their page by themselves; a module no chapter uses
# goes to "Other modules". None: the course-wide helpers page.
HOME = {"sdpa": "03", "kv_cache": "07", "triton_flash_bwd": "10", "utils": None, "plot": None}
CLASSROOM = ["attncourse.classroom", "attncourse.classroom.checks", "attncourse.classroom.checks.forbidden",
             "attncourse.classroom.checks.comparing", "attncourse.classroom.grade", "attncourse.classroom.grading",
             "attncourse.classroom.grading.cli", "attncourse.classroom.grading.classrun",
             "attncourse.classroom.grading.notebook", "attncourse.classroom.grading.session",
             "attncourse.classroom.grading.remote", "attncourse.classroom.grading.hidden",
             "attncourse.classroom.grading.results", "attncourse.classroom.grading.reports",
             "attncourse.classroom.checks.notes", "attncourse.classroom.checks.mistakes",
             "attncourse.classroom.nbtools", "attncourse.classroom.timing", "attncourse.classroom.release",
             "attncourse.classroom.workspace"]
ALIASES = {"grade", "nbtools", "release"}  # `python -m attncourse.X` short names for attncourse.classroom.X


def chapters() -> list[dict]:
    """Every lesson notebooks/NN_*.ipynb: number, stem, title, and its exercises/solutions when they exist."""
    out = []
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        if not CHAPTER.match(path.name):
            continue
        nb = json.loads(path.read_text(encoding="utf-8"))
        first = "".join(nb["cells"][0]["source"]) if nb["cells"] else ""
        heading = next((line[2:].strip() for line in first.splitlines() if line.startswith("# ")), path.stem)
        title = re.sub(r"^\d\d\s*·\s*", "", heading)
        out.append({"nn": path.name[:2], "stem": path.stem, "title": title, "heading": heading,
                    "exercises": (ROOT / "exercises" / path.name).exists(),
                    "solutions": (ROOT / "solutions" / path.name).exists()})
    return out


def write(path: Path, text: str) -> None:
    """Write only when the text changed, so Sphinx's incremental build skips unchanged pages."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def md_link(text: str) -> str:
    return text.replace("[", r"\[").replace("]", r"\]")


# ---------------------------------------------------------------------------------------------- notebook copies
def unlink_solutions(text: str) -> str:
    """Without solutions: a Markdown link into solutions/ keeps its text and loses its target."""
    return re.sub(r"\[([^\]]*)\]\((?:\.\./)?solutions/[^)]*\)", r"\1", text)


def stage_notebook(src: Path, dest: Path, box: str, *, retitle: str | None = None, solutions: bool = True) -> None:
    nb = json.loads(src.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            text = "".join(cell["source"])
            cell["source"] = text if solutions else unlink_solutions(text)
    if nb["cells"] and nb["cells"][0]["cell_type"] == "markdown":
        lines = nb["cells"][0]["source"].split("\n")
        at = next((i for i, line in enumerate(lines) if line.startswith("# ")), None)
        if at is not None:
            if retitle:
                lines[at] = retitle
            lines[at + 1:at + 1] = ["", box, ""]
            nb["cells"][0]["source"] = "\n".join(lines)
    write(dest, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def lesson_box(ch: dict, nxt: dict | None) -> str:
    path = f"notebooks/{ch['stem']}.ipynb"
    lines = [f"Run it: on a clone of the course, `./course lab` sets everything up (`.venv`) and opens JupyterLab;",
             f"open `{path}` there and run it (Run > Restart Kernel and Run All Cells).",
             "`./course test` runs the whole test suite, this lesson's committed outputs included."]
    links = []
    if ch["exercises"]:
        links.append(f"its exercises: [exercises/{ch['stem']}.ipynb](../exercises/{ch['stem']}.ipynb)")
    if nxt:
        links.append(f"next lesson: [{md_link(nxt['heading'])}]({nxt['stem']}.ipynb)")
    else:
        links.append("this is the last lesson: back to the [chapter map](../index.md)")
    links_text = "; ".join(links)
    body = " ".join(lines) + "\n\n" + links_text[0].upper() + links_text[1:] + "."
    return f"```{{admonition}} This lesson is {path}\n:class: tip\n\n{body}\n```"


def exercises_box(ch: dict, solutions: bool) -> str:
    path = f"exercises/{ch['stem']}.ipynb"
    text = (f"Do them in JupyterLab: `./course lab`, open `{path}`, write each answer in place of "
            "`raise NotImplementedError()` and run the check cell below it (or grade the whole notebook with "
            f"`.venv/bin/python -m attncourse.grade {path}`). This page shows the notebook as you get it. "
            f"The lesson: [notebooks/{ch['stem']}.ipynb](../notebooks/{ch['stem']}.ipynb).")
    if solutions and ch["solutions"]:
        text += f" Worked solutions (try first): [solutions/{ch['stem']}.ipynb](../solutions/{ch['stem']}.ipynb)."
    return f"```{{admonition}} These exercises are {path}\n:class: tip\n\n{text}\n```"


def solutions_box(ch: dict) -> str:
    return (f"```{{admonition}} Worked solutions: try the exercises first\n:class: warning\n\n"
            f"This is `solutions/{ch['stem']}.ipynb`, the exercises with their answers, executed. Learners: do "
            f"[the exercises](../exercises/{ch['stem']}.ipynb) before reading on.\n```")


# ------------------------------------------------------------------------------------------------ API pages
def module_homes(chs: list[dict]) -> dict[str, str | None]:
    """Module name (under attncourse) -> chapter number, None (helpers) or "other"."""
    init = ast.parse((ROOT / "attncourse" / "__init__.py").read_text(encoding="utf-8"))
    name_to_module = {}
    for node in init.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                name_to_module[alias.asname or alias.name] = (node.module or alias.name).split(".")[0]
    modules = sorted(p.stem for p in (ROOT / "attncourse").glob("*.py")
                     if not p.stem.startswith("_") and p.stem not in ALIASES)
    used: dict[str, set[str]] = {}
    for ch in chs:
        for folder in ("notebooks", "solutions"):
            path = ROOT / folder / f"{ch['stem']}.ipynb"
            if not path.exists():
                continue
            cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
            code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
            found = {m.split(".")[0] for m in re.findall(r"attncourse\.([a-z_][a-z_0-9.]*)", code)}
            for imp in re.finditer(r"from attncourse import \(?([\w ,\n]+)\)?", code):
                found |= {name_to_module.get(n, n) for n in re.split(r"[\s,]+", imp.group(1)) if n}
            for m in found:
                used.setdefault(m, set()).add(ch["nn"])
    homes = {}
    for m in modules:
        if m in HOME:
            homes[m] = HOME[m]
        else:
            chapters_using = sorted(c for c in used.get(m, ()) if c != "00")
            homes[m] = chapters_using[0] if chapters_using else "other"
    return homes


def automodule(name: str) -> str:
    # autodoc's output is reStructuredText: MyST hands it to the reST parser inside eval-rst
    return f"```{{eval-rst}}\n.. automodule:: {name}\n   :members:\n   :show-inheritance:\n```\n"


def stage_api(chs: list[dict]) -> list[str]:
    homes = module_homes(chs)
    pages = []
    for ch in chs:
        mods = sorted(m for m, home in homes.items() if home == ch["nn"])
        if not mods:
            continue
        names = ", ".join(f"`attncourse.{m}`" for m in mods)
        text = (f"# {ch['nn']} · {ch['title']}: the API\n\nThe modules chapter {ch['nn']} "
                f"([lesson](../notebooks/{ch['stem']}.ipynb)) introduces: {names}. Shapes follow the course's "
                "notation: B batch, H heads, T (Tq, Tk) positions, D head dim.\n\n")
        text += "\n".join(automodule(f"attncourse.{m}") for m in mods)
        write(SRC / "api" / f"ch{ch['nn']}.md", text)
        pages.append(f"ch{ch['nn']}")
    helpers = sorted(m for m, home in homes.items() if home is None)
    write(SRC / "api" / "helpers.md", "# Course-wide helpers\n\nSeeds, the environment report and every plot the "
          "lessons draw.\n\n" + "\n".join(automodule(f"attncourse.{m}") for m in helpers))
    pages.append("helpers")
    other = sorted(m for m, home in homes.items() if home == "other")
    if other:
        write(SRC / "api" / "other.md", "# Other modules\n\nModules no lesson imports directly.\n\n"
              + "\n".join(automodule(f"attncourse.{m}") for m in other))
        pages.append("other")
    else:
        (SRC / "api" / "other.md").unlink(missing_ok=True)
    write(SRC / "api" / "classroom.md", "# The classroom: checks, grader, tools\n\nThe machinery behind the check "
          "cells, `python -m attncourse.grade`, the release and the notebook tools (kept apart from the attention "
          "library in `attncourse.classroom`).\n\n" + "\n".join(automodule(m) for m in CLASSROOM))
    pages.append("classroom")
    return pages


def module_data(module: str) -> set[str]:
    """Names a module assigns at top level (constants, not functions or classes)."""
    path = ROOT / Path(*module.split(".")).with_suffix(".py")
    if not path.exists():
        path = ROOT / Path(*module.split(".")) / "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def api_index(pages: list[str]) -> str:
    """The API's front page: every name `from attncourse import ...` offers, linked to where it is defined."""
    init = ast.parse((ROOT / "attncourse" / "__init__.py").read_text(encoding="utf-8"))
    rows = []
    for node in init.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                rows.append((alias.name, f"attncourse.{node.module}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                rows.append((alias.name, None))
    rows.sort(key=lambda r: r[0].lower())
    table = ["| name | defined in |", "| --- | --- |"]
    for name, module in rows:
        if module is None:
            table.append(f"| {{py:mod}}`attncourse.{name}` | module |")
        elif name in module_data(module):  # a constant: autodoc documents it only with a docstring
            table.append(f"| `{name}` | {{py:mod}}`{module}` |")
        else:
            table.append(f"| {{py:obj}}`{name} <{module}.{name}>` | `{module}` |")
    toc = "\n".join(f"{p}" for p in pages)
    return ("# API reference\n\nThe `attncourse` package, generated from its docstrings (shapes, arguments, "
            "errors), one page per chapter with the modules that chapter introduces; every entry links to its "
            "source. Conventions: a boolean mask is True where attention is allowed, a float mask is added to the "
            "scores, shapes are (batch..., heads, time, dim); bad input raises `ValueError` or `TypeError` naming "
            "the argument and the shapes. The maintainers' [design](../design.md) says which names are fixed.\n\n"
            f"```{{toctree}}\n:maxdepth: 1\n\n{toc}\n```\n\n## Everything `from attncourse import ...` offers\n\n"
            + "\n".join(table) + "\n")


# ------------------------------------------------------------------------------------------------ home page
def home_page(chs: list[dict], solutions: bool, api_pages: list[str]) -> str:
    head = "| NN | lesson | exercises |" + (" solutions |" if solutions else "") + " API |"
    rule = "| --- | --- | --- |" + (" --- |" if solutions else "") + " --- |"
    api_pages = {p[2:] for p in api_pages if p.startswith("ch")}  # this build's pages, not a stale one still staged
    rows = [head, rule]
    for ch in chs:
        cells = [ch["nn"], f"[{md_link(ch['title'])}](notebooks/{ch['stem']}.ipynb)",
                 f"[exercises](exercises/{ch['stem']}.ipynb)" if ch["exercises"] else ""]
        if solutions:
            cells.append(f"[solutions](solutions/{ch['stem']}.ipynb)" if ch["solutions"] else "")
        cells.append(f"[API](api/ch{ch['nn']}.md)" if ch["nn"] in api_pages else "")
        rows.append("| " + " | ".join(cells) + " |")
    intro = (DOCS / "home.md").read_text(encoding="utf-8")
    tocs = ["```{toctree}\n:hidden:\n:caption: Lessons\n\n"
            + "\n".join(f"notebooks/{c['stem']}" for c in chs) + "\n```",
            "```{toctree}\n:hidden:\n:caption: Exercises\n\n"
            + "\n".join(f"exercises/{c['stem']}" for c in chs if c["exercises"]) + "\n```"]
    if solutions:
        tocs.append("```{toctree}\n:hidden:\n:caption: Solutions (try the exercises first)\n\nsolutions/index\n```")
    tocs.append("```{toctree}\n:hidden:\n:caption: Reference\n\napi/index\ndesign\n```")
    return intro.replace("{{CHAPTER_MAP}}", "\n".join(rows)) + "\n\n" + "\n\n".join(tocs) + "\n"


def solutions_index(chs: list[dict]) -> str:
    return ("# Solutions\n\n```{warning}\nThese are the exercise notebooks with their worked answers, for "
            "instructors and for learners who have finished an exercise. Reading a solution before trying the "
            "exercise takes away what the exercise is for. An instructor can build the site without this "
            "section: `./course site --no-solutions`.\n```\n\n```{toctree}\n:maxdepth: 1\n\n"
            + "\n".join(f"{c['stem']}" for c in chs if c["solutions"]) + "\n```\n")


# ------------------------------------------------------------------------------------------------- staging
def stage(solutions: bool) -> None:
    chs = chapters()
    keep: set[Path] = set()
    for item in DOCS.iterdir():  # this folder's pages, config, static files
        if item.name in ("site.py", "home.md", "__pycache__", ".gitignore") or item.name.startswith("."):
            continue
        if item.is_dir():
            for f in item.rglob("*"):
                if f.is_file() and "__pycache__" not in f.parts:
                    write_bytes(SRC / f.relative_to(DOCS), f.read_bytes(), keep)
        else:
            write_bytes(SRC / item.name, item.read_bytes(), keep)
    by_stem = {c["stem"]: i for i, c in enumerate(chs)}
    for ch in chs:
        nxt = chs[by_stem[ch["stem"]] + 1] if by_stem[ch["stem"]] + 1 < len(chs) else None
        dest = SRC / "notebooks" / f"{ch['stem']}.ipynb"
        stage_notebook(ROOT / "notebooks" / f"{ch['stem']}.ipynb", dest, lesson_box(ch, nxt), solutions=solutions)
        keep.add(dest)
        if ch["exercises"]:
            dest = SRC / "exercises" / f"{ch['stem']}.ipynb"
            stage_notebook(ROOT / "exercises" / f"{ch['stem']}.ipynb", dest, exercises_box(ch, solutions),
                           solutions=solutions)
            keep.add(dest)
        if ch["solutions"] and solutions:
            dest = SRC / "solutions" / f"{ch['stem']}.ipynb"
            src = ROOT / "solutions" / f"{ch['stem']}.ipynb"
            first = json.loads(src.read_text(encoding="utf-8"))["cells"][0]["source"]
            heading = next((line for line in "".join(first).splitlines() if line.startswith("# ")), "")
            stage_notebook(src, dest, solutions_box(ch), retitle=heading.replace(" exercises:", " solutions:", 1))
            keep.add(dest)
    api_pages = stage_api(chs)
    write(SRC / "api" / "index.md", api_index(api_pages))
    keep |= {SRC / "api" / f"{p}.md" for p in api_pages} | {SRC / "api" / "index.md"}
    if solutions:
        write(SRC / "solutions" / "index.md", solutions_index(chs))
        keep.add(SRC / "solutions" / "index.md")
    write(SRC / "index.md", home_page(chs, solutions, api_pages))
    keep.add(SRC / "index.md")
    for f in list(SRC.rglob("*")):  # anything staged before that is gone now (a renamed page, solutions)
        if f.is_file() and f not in keep:
            f.unlink()
    if not solutions:
        shutil.rmtree(OUT / "solutions", ignore_errors=True)


def write_bytes(path: Path, data: bytes, keep: set[Path]) -> None:
    keep.add(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)


def build(solutions: bool = True, clean: bool = False) -> Path:
    # which page documents which module: when that changes, pages that did not change still link to the old page
    # (Sphinx rewrites only changed pages), so the whole site is rebuilt
    homes = json.dumps(module_homes(chapters()), sort_keys=True)
    stamp = BUILD / "site-modules.json"
    if not stamp.exists() or stamp.read_text(encoding="utf-8") != homes:
        clean = True
    if clean:
        for d in (SRC, OUT, DOCTREES):
            shutil.rmtree(d, ignore_errors=True)
    SRC.mkdir(parents=True, exist_ok=True)
    stage(solutions)
    # viewcode rewrites a module's source page only when the module changed, so its anchors go stale when the
    # documented members change (a page or a setting): rewrite them every time (a few seconds)
    shutil.rmtree(OUT / "_modules", ignore_errors=True)
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q", "-j", "auto",
           "-d", str(DOCTREES), str(SRC), str(OUT)]
    if not solutions:
        cmd[5:5] = ["-t", "no_solutions"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    stamp.write_text(homes, encoding="utf-8")
    print(f"== site built in {time.perf_counter() - start:.0f} s: {OUT.relative_to(ROOT)}/index.html "
          f"({sum(f.stat().st_size for f in OUT.rglob('*') if f.is_file()) / 2**20:.1f} MiB)")
    return OUT


def free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


def serve(port: int) -> None:
    port = free_port(port)
    handler = functools.partial(QuietHandler, directory=str(OUT))
    with http.server.ThreadingHTTPServer(("127.0.0.1", port), handler) as httpd:
        print(f"== serving the course at http://127.0.0.1:{port}/ (offline; Ctrl-C stops it)", flush=True)
        try:
            httpd.serve_forever()
        except KeyboardInterrupt:
            pass


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="./course site", description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-solutions", action="store_true", help="leave solutions/ out of the site")
    parser.add_argument("--serve", action="store_true", help="then serve it on 127.0.0.1 and print the address")
    parser.add_argument("--port", type=int, default=8000, help="port for --serve (another if taken; default 8000)")
    parser.add_argument("--clean", action="store_true", help="rebuild every page (default: only changed ones)")
    args = parser.parse_args(argv)
    build(solutions=not args.no_solutions, clean=args.clean)
    if args.serve:
        serve(args.port)


if __name__ == "__main__":
    main()
