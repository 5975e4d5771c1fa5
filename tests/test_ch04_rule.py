"""Chapter 04's exercise 4 asks for a rule, and a simulation of causal attention is refused: in plain Python with
math.exp, with ** and a float, through a helper from another cell, a default argument or a dunder method; rules
over indices in several spellings pass (checks/rules.py)."""

from __future__ import annotations

import math

from attncourse.classroom import checks
from attncourse.classroom.checks import rules
from test_ch04_checks import graded, refused

ID = "04-predict-causal-permutation"


def rule_sets(perm):  # the solution's spelling
    return tuple(set(perm[:i + 1]) == set(range(perm[i] + 1)) for i in range(len(perm)))


def rule_running_max(perm):  # one pass: the prefix is 0..i exactly when its largest index is i
    out, top = [], -1
    for i, p in enumerate(perm):
        top = max(top, p)
        out.append(p == i and top == i)
    return tuple(out)


def rule_sorted(perm):
    return tuple(perm[i] == i and sorted(perm[:i + 1]) == list(range(i + 1)) for i in range(len(perm)))


def simulated_math_exp(perm):  # the review's route: scalar causal softmax attention, measured
    import random
    rnd = random.Random(0)
    t = len(perm)
    x = [rnd.gauss(0, 1) for _ in range(t)]
    v = [rnd.gauss(0, 1) for _ in range(t)]

    def att(xs, vs):
        res = []
        for i in range(t):
            s = [xs[i] * xs[j] for j in range(i + 1)]
            m = max(s)
            e = [math.exp(a - m) for a in s]
            res.append(sum(ei * vs[j] for j, ei in enumerate(e)) / sum(e))
        return res
    out, y = att(x, v), att([x[p] for p in perm], [v[p] for p in perm])
    return tuple(abs(y[i] - out[perm[i]]) < 1e-12 for i in range(t))


def simulated_no_imports(perm):  # no module at all: e ** s with a typed e, tokens made from the index
    t = len(perm)
    x = [((7 * j) % 11 - 5) / 5 for j in range(t)]

    def att(xs):
        res = []
        for i in range(t):
            e = [2.718281828 ** (xs[i] * xs[j]) for j in range(i + 1)]
            res.append(sum(w * xs[j] for j, w in enumerate(e)) / sum(e))
        return res
    out, y = att(x), att([x[p] for p in perm])
    return tuple(abs(y[i] - out[perm[i]]) < 1e-9 for i in range(t))


def _attend(xs):  # "another cell"
    return [sum(math.exp(xs[i] * xs[j]) * xs[j] for j in range(i + 1)) for i in range(len(xs))]


def simulated_by_helper(perm):  # the answer itself only compares
    x = list(range(1, len(perm) + 1))
    out, y = _attend(x), _attend([x[p] for p in perm])
    return tuple(y[i] == out[perm[i]] for i in range(len(perm)))


def simulated_by_default(perm, attend=_attend):  # the helper smuggled in as a default argument
    x = list(range(1, len(perm) + 1))
    out, y = attend(x), attend([x[p] for p in perm])
    return tuple(y[i] == out[perm[i]] for i in range(len(perm)))


def simulated_by_dunders(perm):  # floats without / or a float literal
    t = len(perm)
    x = [(j + 1).__truediv__(t) for j in range(t)]
    out = [sum(x[j].__mul__(x[i]).__rpow__(3) for j in range(i + 1)) for i in range(t)]
    xp = [x[p] for p in perm]
    y = [sum(xp[j].__mul__(xp[i]).__rpow__(3) for j in range(i + 1)) for i in range(t)]
    return tuple(abs(y[i] - out[perm[i]]) < 1e-9 for i in range(t))


def simulated_by_import_builtin(perm):
    exp = __import__("math").exp
    return tuple(exp(0) == 1 and set(perm[:i + 1]) == set(range(perm[i] + 1)) for i in range(len(perm)))


def test_rules_pass(tmp_path, monkeypatch):
    for rule in (rule_sets, rule_running_max, rule_sorted):
        checks.check(ID, rule)
    assert graded(ID, rule_running_max, tmp_path, monkeypatch) == "passed"


def test_simulations_are_refused(tmp_path, monkeypatch):
    for route in (simulated_math_exp, simulated_no_imports, simulated_by_helper, simulated_by_default,
                  simulated_by_dunders):
        assert route([1, 0, 2, 4, 3]) == rule_sets([1, 0, 2, 4, 3])  # each measures the right answer
    for route in (simulated_math_exp, simulated_no_imports, simulated_by_helper, simulated_by_default,
                  simulated_by_dunders, simulated_by_import_builtin):
        msg = refused(ID, route, tmp_path, monkeypatch, called=False)
        assert "not the way" in msg and "rule" in msg, msg


def test_problems_name_each_route():
    import inspect
    said = {f.__name__: " ".join(rules.problems(inspect.getsource(f), "f")) for f in
            (simulated_math_exp, simulated_no_imports, simulated_by_helper, simulated_by_default,
             simulated_by_dunders, simulated_by_import_builtin, rule_sets, rule_running_max, rule_sorted)}
    assert "an import" in said["simulated_math_exp"] and "`math`" in said["simulated_math_exp"]
    assert "2.718281828" in said["simulated_no_imports"] and "`**`" in said["simulated_no_imports"]
    assert "`_attend`" in said["simulated_by_helper"]
    assert "default argument" in said["simulated_by_default"]
    assert "__truediv__" in said["simulated_by_dunders"]
    assert "`__import__`" in said["simulated_by_import_builtin"]
    assert not said["rule_sets"] and not said["rule_running_max"] and not said["rule_sorted"]


# ----------------------------------------------------------------------------- exercise 2: the fix in other spellings

from test_edits import cell_function  # noqa: E402
from attncourse.classroom.checks import ch04, edits  # noqa: E402

_SPELLINGS = {  # the merge of the fix, as a learner may write it
    "transpose/reshape/transpose": "transpose(0, 1).reshape(T, B, d).transpose(0, 1)",
    "view/transpose/reshape": "view(B, n_heads, T, D).transpose(1, 2).reshape(B, T, d)",
    "unflatten/permute/flatten": "unflatten(0, (B, n_heads)).permute(0, 2, 1, 3).flatten(2)",
    "view/movedim/contiguous": "view(B, n_heads, T, D).movedim(1, 2).contiguous().view(B, T, d)",
}


def test_find_the_bug_accepts_every_spelling_of_the_fix():
    import inspect
    import torch
    case = checks.get("04-find-the-bug-1").make_cases()[0]
    for merge in _SPELLINGS.values():
        text = ch04.BUGGY_MHA.replace("(weights @ v).reshape(B, T, d)", f"(weights @ v).{merge}").replace("mha_buggy",
                                                                                                           "mha_fixed")
        assert edits.judge(ch04.FIX_MHA, text) is None, text           # the small-edit property holds
        fixed = cell_function(text, "mha_fixed", {"torch": torch, "math": math})
        torch.testing.assert_close(fixed(*case.args), case.expected)   # and the values are right
    assert edits.distance(ch04.BUGGY_MHA, inspect.getsource(ch04._breaker_rewrite_mha)) > ch04.FIX_MHA.most + 20
