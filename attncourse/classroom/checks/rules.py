"""A prediction written as a rule over indices, judged by its source: the rule may compare, count and take sets,
and nothing else, so that it cannot be a simulation of the experiment it predicts.

An exercise whose answer is "which rows survive", "which positions see which" (a statement about indices) takes
this property: the answer's source (recorded by the guard, as for a find-the-bug edit) must be one self-contained
``def`` that

* reads no name outside itself except a few built-ins (``len``, ``range``, ``set``, ``all``, ``max``, ...): no
  module, no helper from another cell, no ``import``, no default argument, decorator, ``global`` or class;
* writes no number other than an integer, and no arithmetic other than ``+``, ``-`` and the set operators ``|``,
  ``&``, ``^`` (no ``*``, ``/``, ``**``, ``//``, ``%``, shifts): an exponential, a softmax or a dot product cannot
  be written;
* reads no attribute that starts with ``_`` (``(1).__truediv__`` would give a float without ``/``).

A simulated attention needs products and exponentials of numbers, so it is refused whatever it is named; a rule
about which tokens a row sees needs none of them.
"""

from __future__ import annotations

import ast
import builtins

BUILTINS = frozenset({"len", "range", "set", "frozenset", "list", "tuple", "dict", "sorted", "reversed",
                      "enumerate", "zip", "all", "any", "max", "min", "sum", "abs", "bool", "int", "isinstance",
                      "map", "filter", "iter", "next", "print", "True", "False", "None"})
_ALLOWED_OPS = (ast.Add, ast.Sub, ast.BitAnd, ast.BitOr, ast.BitXor)  # | & ^: set union, ...


def _bound(node: ast.AST) -> set[str]:
    """Every name `node` binds anywhere inside it (arguments, assignments, loop and comprehension targets)."""
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            names.add(sub.id)
        elif isinstance(sub, ast.arg):
            names.add(sub.arg)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(sub.name)
        elif isinstance(sub, ast.ExceptHandler) and sub.name:
            names.add(sub.name)
    return names


def problems(source: str, target: str) -> list[str]:
    """What in `source` (one ``def``) is not a plain rule over indices; empty when it is one."""
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        return [f"its source does not parse ({err.msg})"]
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if len(tree.body) != 1 or not defs:
        return ["it is not one function defined with def"]
    found, local = [], _bound(defs[0])
    for node in ast.walk(defs[0]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if node.args.defaults or node.args.kw_defaults and any(d is not None for d in node.args.kw_defaults):
                found.append("a default argument (a value brought in from outside the rule)")
            if getattr(node, "decorator_list", None):
                found.append("a decorator")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append("an import")
        elif isinstance(node, (ast.Global, ast.Nonlocal, ast.ClassDef)):
            found.append(f"a {type(node).__name__.lower()} statement")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local \
                and node.id not in BUILTINS:
            found.append(f"the name `{node.id}` from outside the rule" +
                         (" (a built-in this rule does not need)" if hasattr(builtins, node.id) else ""))
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            found.append(f"the attribute `{node.attr}`")
        elif isinstance(node, ast.Constant) and isinstance(node.value, (float, complex)):
            found.append(f"the number {node.value!r} (a rule over indices needs integers only)")
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and not isinstance(node.op, _ALLOWED_OPS):
            found.append(f"the operator `{_SYMBOL.get(type(node.op), type(node.op).__name__)}`")
    return list(dict.fromkeys(found))


_SYMBOL = {ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**", ast.LShift: "<<",
           ast.RShift: ">>", ast.MatMult: "@"}


def prop(target: str) -> object:
    """An exercise's ``prop``: the answer's recorded source must be a plain rule over indices (see the module)."""

    def plain_rule(runs: list) -> str | None:
        trace = runs[0].trace if runs else None
        source = trace.get("source") if isinstance(trace, dict) else None
        if not isinstance(source, str):
            why = source.get("why") if isinstance(source, dict) else "no source was recorded"
            return (f"the check reads {target} to see that it is a rule, and could not read its source ({why}): "
                    f"define it with `def` at the top level of a cell, and run that cell")
        found = problems(source, target)
        if not found:
            return None
        return (f"{target} should be a rule about which tokens each row sees, written with comparisons, counting "
                f"and sets of indices only; it uses {', '.join(found[:3])}. Products, exponentials and a softmax "
                f"belong to the measurement, not to the rule")

    plain_rule.needs_source = True
    return plain_rule
