"""Chapter 13, exercise 2's diagnosis part (13-find-the-bug-1-inputs): the rule passes, check cell and grader; the
routes that skip the diagnosis are refused (review 11: the one-token fix can be found by a blind search)."""

from __future__ import annotations

import math

import torch

from attncourse.classroom import checks
from exercise_routes import accepted, failure, refused
from test_salting import SALT, _grader

ID = "13-find-the-bug-1-inputs"


def wrong_heads(g, initial_state, chunk_size):
    in_first = (g[..., :chunk_size] != 0).any(-1) & (initial_state != 0).flatten(-2).any(-1)  # state there: S_0
    return in_first | (g[..., chunk_size:] != 0).any(-1)  # later chunks start from the writes: never zero


def test_the_rule_passes(tmp_path, monkeypatch):
    accepted(ID, wrong_heads, tmp_path, monkeypatch)
    assert _grader(checks.get(ID), wrong_heads, SALT, tmp_path, monkeypatch)[0] == "passed"


def test_running_the_given_code_against_the_recurrence_is_refused(tmp_path, monkeypatch):
    """The blind route: draw q, k, v, beta and compare the given function with the recurrence, head by head."""
    from attncourse.classroom.checks.ch13_breakers import BUGGY_GDN

    ns = {"torch": torch, "math": math}
    exec(BUGGY_GDN, ns)
    given = ns["gated_delta_chunked"]

    def side_by_side(g, initial_state, chunk_size):
        B, H, T = g.shape
        Dk, Dv = initial_state.shape[-2:]
        q, k, v = (torch.randn(B, H, T, d, dtype=g.dtype) for d in (Dk, Dk, Dv))
        k = k / k.norm(dim=-1, keepdim=True)
        beta = torch.rand(B, H, T, dtype=g.dtype)
        o, _ = given(q, k, v, g, beta, initial_state, chunk_size)
        S, outs = initial_state, []
        for t in range(T):  # the recurrence, token by token
            S = S * g[..., t, None, None].exp()
            kt = k[:, :, t]
            S = S + beta[..., t, None, None] * kt[..., :, None] * (v[:, :, t] - (S * kt[..., :, None]).sum(-2))[..., None, :]
            outs.append((S * q[:, :, t, :, None]).sum(-2))
        return (o - torch.stack(outs, 2)).abs().amax((-2, -1)) > 1e-9

    msg, graded = refused(ID, side_by_side, tmp_path, monkeypatch)
    assert "mm" in msg or "solve" in msg or "matmul" in msg, msg


def test_rules_that_miss_a_factor_fail():
    routes = (lambda g, initial_state, chunk_size: (g != 0).any(-1),  # ignores the initial state in chunk 1
              lambda g, initial_state, chunk_size: (g != 0).any(-1) & (initial_state != 0).flatten(-2).any(-1),
              lambda g, initial_state, chunk_size: (g[..., chunk_size:] != 0).any(-1),  # ignores chunk 1
              lambda g, initial_state, chunk_size: torch.ones(g.shape[:2], dtype=torch.bool))
    for route in routes:
        assert "not right" in failure(ID, route)


def test_a_table_of_the_check_cells_answer_fails_the_grader(tmp_path, monkeypatch):
    ex = checks.get(ID)
    (case,) = ex.make_cases()
    table = case.expected.clone()
    checks.check(ID, lambda g, initial_state, chunk_size: table)
    assert _grader(ex, lambda g, initial_state, chunk_size: table, SALT, tmp_path, monkeypatch)[0] in ("failed", "error")


# ----------------------------------------------------------------------------- 13-recall-capacity: no recipe passes


def test_recall_capacity_needs_the_measurement(tmp_path, monkeypatch):
    """Review 11 (issue 23): typed numbers and formulas. A table of the check cell's values fools the cell but not the
    salted grader; the per-configuration mean of those values (a 'typical recall' recipe) fails the cell already."""
    ex = checks.get("13-recall-capacity")
    cases = ex.make_cases()
    table = {tuple(c.args): c.expected for c in cases}

    def lookup(rule, n_pairs, dim, seed):
        return table[(rule, n_pairs, dim, seed)]

    checks.check(ex.id, lookup)
    assert _grader(ex, lookup, SALT, tmp_path, monkeypatch)[0] in ("failed", "error")
    typical = {}
    for c in cases:
        typical.setdefault(tuple(c.args[:3]), []).append(c.expected)

    def recipe(rule, n_pairs, dim, seed):
        values = typical[(rule, n_pairs, dim)]
        return sum(values) / len(values)

    failure(ex.id, recipe)
