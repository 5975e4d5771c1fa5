"""Chapter 14's check module holds no readable answer: exercise 3's reference counts come from the package's gate
(a copy of that route is refused, and calls the gate, which the exercise forbids), and exercise 1's ranking lives
only in the package's gate (the module's references and shortcuts call it)."""

from __future__ import annotations

import types

import torch

from attncourse.classroom import checks
from attncourse.classroom.checks import ch14
from exercise_routes import refused
from test_exercise_standard import as_learner


def typed(fn, **names):
    """`fn` typed by the learner in a cell, its global names (helpers it calls) replaced by `names`."""
    new = as_learner(fn)
    return types.FunctionType(new.__code__, {**fn.__globals__, **names}, new.__name__, new.__defaults__,
                              new.__closure__)


def test_reference_counts_agree_with_the_closed_form():
    def by_blocks(t, block, top_k):
        sizes = [block] * (-(-t // block) - 1)
        sizes.append(t - len(sizes) * block)
        blocks = sum(n * min(top_k, b + 1) for b, n in enumerate(sizes))
        return blocks, sum(n * (n + 1) // 2 for n in sizes) + block * (blocks - t)

    for case in checks.get("14-predict-tiles").make_cases():
        assert case.expected == by_blocks(*case.args), case.name
    gen = torch.Generator().manual_seed(0)
    assert ch14._counted(2 ** 21 + 37, 64, 5, gen) == by_blocks(2 ** 21 + 37, 64, 5)  # the extended route


def test_copied_reference_routes_are_refused(tmp_path, monkeypatch):
    counts = typed(ch14._gate_counts)
    counted = typed(ch14._counted, _gate_counts=counts)

    def tiles_prediction(seq_len, block_size, top_k):
        return counted(seq_len, block_size, top_k, torch.Generator().manual_seed(0))

    msg, graded = refused("14-predict-tiles", typed(tiles_prediction), tmp_path, monkeypatch)
    assert ("moba_gate" in msg or "copy of" in msg) and "called" in graded, msg  # exercise 1's route: test_ch14_checks
    assert not hasattr(ch14, "_select_blocks") and "by_blocks" not in open(ch14.__file__).read()
