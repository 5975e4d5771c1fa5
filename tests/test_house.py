"""The package's two parts stay apart and readable: the attention library never imports the classroom
machinery (checks, grading, release, notebook tools), and no module grows past about 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import attncourse

PACKAGE = Path(attncourse.__file__).resolve().parent
MAX_LINES = 420  # "about 400"
# The guard is one self-contained source by design: the grader sends that one file into the student's kernel and
# runs it there, so the check cell and the grader watch with the same code (attncourse.classroom.grading.remote).
# It grew past 900 lines when it learnt to see NumPy detours and the course's code copied as text, and past 1100
# with complex numbers, numbers read out into plain Python, autograd's engine, gradients and unprofiled bookkeeping,
# and past 1200 with numbers read out as text (a repr at full precision) or bytes (torch.save, pickle).
ONE_SOURCE = {"attncourse/classroom/checks/forbidden.py": 1230}


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_is_over_about_400_lines():
    long = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in modules()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) >
            ONE_SOURCE.get(str(p.relative_to(PACKAGE.parent)), MAX_LINES)]
    assert not long, "split these modules:\n  " + "\n  ".join(long)


def test_the_library_never_imports_the_classroom():
    offenders = []
    for path in modules():
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "classroom" or str(rel) in ("grade.py", "release.py", "nbtools.py", "__init__.py"):
            continue  # the classroom itself, its `python -m` entry points, and the package's public names
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.ImportFrom) and node.level and (node.module or "").startswith("classroom"):
                names = ["attncourse." + node.module]
            offenders += [f"{rel}:{node.lineno} imports {n}" for n in names if n.startswith("attncourse.classroom")]
    assert not offenders, "\n".join(offenders)
