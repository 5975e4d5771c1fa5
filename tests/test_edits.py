"""Find-the-bug exercises graded as a diagnosis (attncourse.classroom.checks.edits): a small edit of the given
function passes, a rewrite with the right values does not, and no lesson function is an answer."""

from __future__ import annotations

import ast
import inspect
import linecache
import textwrap
from pathlib import Path

import nbformat
import pytest

from attncourse.classroom import checks
from attncourse.classroom.checks import edits, forbidden

ROOT = Path(__file__).resolve().parents[1]
GIVEN = "def f(a, b):\n    c = a + b  # sum\n    return c * 2\n"


def test_tokens_skip_layout_comments_docstrings_and_the_name():
    answer = 'def g(a, b):\n    """Doc."""\n    # a comment\n    c = a   +   b\n\n    return c * 2\n'
    assert edits.distance(GIVEN, answer) == 0
    assert edits.distance(GIVEN, GIVEN.replace("c * 2", "c * 3")) == 1
    assert edits.distance(GIVEN, GIVEN.replace("c * 2", "(c * 2) + 0")) == 4


def test_judge_counts_tokens_names_and_lines():
    spec = edits.SmallEdit(GIVEN, most=4, lines=(3,))
    assert edits.judge(spec, GIVEN.replace("c * 2", "c * 3")) is None
    assert "differs from the given function in" in edits.judge(spec, GIVEN.replace("c * 2", "(c + c + c + c) * 1"))
    assert "uses names" in edits.judge(spec, GIVEN.replace("c * 2", "h(c)"))
    assert "line(s) 2" in edits.judge(spec, GIVEN.replace("a + b", "a - b"))
    assert edits.judge(edits.SmallEdit(GIVEN, most=4, names=("h",)), GIVEN.replace("c * 2", "h(c)")) is None
    assert "could not read" in edits.judge(spec, "def f(:\n")


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="given"):
        edits.SmallEdit("x = 1", most=2)
    with pytest.raises(ValueError, match="most"):
        edits.SmallEdit(GIVEN, most=0)
    with pytest.raises(TypeError, match="source"):
        edits.tokens(3)


def cell_function(source: str, name: str, namespace: dict):
    """`source` defined as if typed in a notebook cell (its text in linecache, as IPython keeps it)."""
    filename = f"<cell edits-{abs(hash(source))}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def test_the_guard_records_a_source_only_when_it_is_the_code_that_runs():
    f = cell_function(GIVEN, "f", {})
    assert forbidden.source_of(f) == GIVEN
    g = cell_function(GIVEN.replace("* 2", "* 3").replace("def f", "def g"), "g", {})
    f.__code__ = g.__code__.replace(co_name="f")  # another function's code under this text: no source
    assert isinstance(forbidden.source_of(f), dict)
    assert isinstance(forbidden.source_of(len), dict)



def test_a_cell_that_imports_what_its_function_uses_has_its_source_read():
    """CPython compiles `math.sqrt(x)` differently when the same text imports `math`: the cell's whole text decides."""
    cell = "import math\n\n\ndef h(x):\n    return math.sqrt(x) + 1\n"
    h = cell_function(cell, "h", {})
    assert forbidden.source_of(h) == "def h(x):\n    return math.sqrt(x) + 1\n"

def _bug_exercises():
    return [ex for ex in checks.registry().values() if edits.needs_source(ex.prop) and hasattr(ex.prop, "spec")]


def _functions(path: Path) -> dict[str, str]:
    """Every function defined at the top level of a code cell of `path`: name -> source."""
    found = {}
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                found[node.name] = ast.get_source_segment(cell.source, node)
    return found


def _notebook(folder: str, chapter: str) -> Path:
    return next((ROOT / folder).glob(f"{chapter}_*.ipynb"))


@pytest.mark.parametrize("ex", _bug_exercises(), ids=lambda ex: ex.id)
def test_small_edit_exercises_hold(ex):
    spec = ex.prop.spec
    given_name = ast.parse(spec.given).body[0].name
    solution = _functions(_notebook("solutions", ex.chapter))
    assert given_name in solution, f"{ex.id}: the notebook does not show the given function {given_name}"
    assert edits.tokens(spec.given) == edits.tokens(solution[given_name]), \
        f"{ex.id}: the notebook's given function differs from the spec's (tokens or lines)"
    judged = getattr(ex.prop, "judged", ex.target)  # a Triton exercise judges the kernel its answer launches
    assert edits.judge(spec, solution[judged]) is None, f"{ex.id}: the solution is not a small edit"
    assert edits.judge(spec, spec.given) is None  # the bug itself is judged by its values, not here
    for name, source in _functions(_notebook("notebooks", ex.chapter)).items():
        assert edits.judge(spec, source) is not None, f"{ex.id}: the lesson's {name} passes as an answer"
    for breaker in ex.breakers:
        assert edits.judge(spec, textwrap.dedent(inspect.getsource(breaker))) is not None


def test_check_cell_passes_the_edit_and_refuses_a_rewrite(capsys):
    from attncourse.classroom.checks import ch03

    ns = {"torch": __import__("torch")}
    fixed = cell_function(ch03.BUGGY_ATTENTION.replace("k.T", "k.mT").replace("_buggy", "_fixed"),
                           "attention_fixed", ns)
    checks.check("03-find-the-bug-1", fixed)
    assert "✓ 03-find-the-bug-1" in capsys.readouterr().out
    lesson = _functions(_notebook("notebooks", "03"))["attention"]
    pasted = cell_function(lesson.replace("def attention(", "def attention_fixed("), "attention_fixed",
                            {"torch": ns["torch"], "math": __import__("math")})
    with pytest.raises(checks.CheckFailed, match="not the way"):
        checks.check("03-find-the-bug-1", pasted)
