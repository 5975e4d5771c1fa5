"""The learner-side check: a pass line, or a specific message (case, shape or first differing index, hint)."""

import math

import numpy as np
import pytest
import torch

from attncourse.classroom import checks
from attncourse.classroom.checks import CheckFailed, ExerciseNotDone, check


def right(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v


def test_pass_line(capsys):
    check("03-batched-attention-bug", right)
    assert capsys.readouterr().out.strip() == "✓ 03-find-the-bug-1: all 5 case(s) passed"  # the old id is an alias


def test_wrong_values_name_case_index_and_hint():
    def wrong(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -2) @ v

    with pytest.raises(CheckFailed) as info:
        check("03-batched-attention-bug", wrong)
    msg = str(info.value)
    assert "case 'square (1, 2, 4, 8)'" in msg
    assert "values differ (rtol=1e-05, atol=1e-06); first at index (0, 0, 0, 0): expected" in msg
    assert "hint:" in msg


def test_wrong_shape_is_reported():
    with pytest.raises(CheckFailed, match=r"wrong shape: expected \(1, 2, 4, 8\), got \(1, 2, 4, 4\)"):
        check("03-batched-attention-bug", lambda q, k, v: right(q, k, v)[..., :4])


def test_exceptions_and_stubs():
    with pytest.raises(CheckFailed, match="your code raised ZeroDivisionError"):
        check("03-batched-attention-bug", lambda q, k, v: 1 / 0)

    def stub(q, k, v):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        check("03-batched-attention-bug", stub)
    with pytest.raises(ExerciseNotDone, match="`predicted_shapes` is not defined yet"):
        check("03-predict-shapes")  # looked up in this module's globals, where it does not exist
    with pytest.raises(CheckFailed, match="should be a function"):
        check("03-batched-attention-bug", 42)


def test_forbidden_function_fails():
    import torch.nn.functional as F

    with pytest.raises(CheckFailed, match="scaled_dot_product_attention"):
        check("03-batched-attention-bug", lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    assert F.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"  # restored afterwards


def test_forbidden_function_fails_through_an_alias_bound_earlier():
    """Replacing the module attribute misses `from ... import f as g` done before the check: the call guard
    catches PyTorch's built-in kernel and the package's Python oracle by identity."""
    import sys

    from torch.nn.functional import scaled_dot_product_attention as fused

    from attncourse import scaled_dot_product_attention as oracle

    with pytest.raises(CheckFailed, match="scaled_dot_product_attention"):
        check("03-batched-attention-bug", lambda q, k, v: fused(q, k, v))
    with pytest.raises(CheckFailed, match=r"attncourse(\.sdpa)?\.scaled_dot_product_attention"):
        check("03-batched-attention-bug", lambda q, k, v: oracle(q, k, v))
    assert sys.gettrace() is None  # the call hook is removed afterwards
    x = torch.randn(1, 2, 3, 4)
    torch.testing.assert_close(fused(x, x, x), oracle(x, x, x))  # and both work again


def test_numpy_exercise_gets_arrays_and_value_lookup_by_name():
    seen = []

    def attention_numpy(Q, K, V):
        seen.append(type(Q))
        s = Q @ K.T / np.sqrt(Q.shape[-1])
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        return w @ V, w

    check("03-sdpa-numpy", attention_numpy)
    assert seen and all(t is np.ndarray for t in seen)
    globals()["predicted_shapes"] = ((2, 4, 5, 7), (2, 4, 5, 7), (2, 4, 5, 8))
    try:
        check("03-predict-shapes")
        globals()["predicted_shapes"] = ((2, 4, 5, 7), (2, 4, 7, 5), (2, 4, 5, 8))
        with pytest.raises(CheckFailed) as info:  # a prediction is told which part is wrong, never the answer
            check("03-predict-shapes")
        assert "wrong: weights (the other parts are right)" in str(info.value)
        assert "(2, 4, 5, 7)" not in str(info.value)
    finally:
        del globals()["predicted_shapes"]


def test_compare_rules():
    case = checks.Case("c")
    assert checks.compare(torch.ones(2), torch.ones(2), case) is None
    assert "NaN or inf" in checks.compare(torch.tensor([1.0, float("nan")]), torch.ones(2), case)
    assert "expected a tensor" in checks.compare([1, 2], torch.ones(2), case)
    assert checks.compare(3, 3, checks.Case("c", compare="equal")) is None
    # a scalar is never shown: how far off, not the value (a rule must not be read off a few failures)
    assert "off by about 33%" in checks.compare(4, 3, case) and "3" not in checks.compare(4, 3, case).split("33%")[1]
    assert "expected" not in checks.compare(1.5, 1.0, case) and "off by about 50%" in checks.compare(1.5, 1.0, case)
    assert "rtol" in checks.compare(1.5, 1.0, case)
    assert "mean" not in checks.compare("first", "mean", case)  # a choice is never shown either
    # a tensor's numbers are shown for an implement exercise, never when reveal=False (experiments, predictions)
    assert "expected 2" in checks.compare(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 2.0]), case)
    assert "expected" not in checks.compare(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 2.0]), case, reveal=False)
    assert checks.compare(1.0 + 1e-9, 1.0, case) is None
    assert checks.compare("x", 1, checks.Case("c", compare=lambda got: None)) is None


def test_registry_is_consistent():
    reg = checks.registry()
    assert all(ex.id.split("-")[0].isdigit() and ex.points > 0 for ex in reg.values())
    assert all(ex.kind in ("function", "value") for ex in reg.values())
    with pytest.raises(KeyError, match="no exercise 'nope'"):
        checks.get("nope")
    with pytest.raises(ValueError, match="registered twice"):
        checks.exercise("03-sdpa-numpy", "x")(lambda: [])


# ----------------------------------------------------------------------------- what a learner sees in a notebook
# A private exercise (not a chapter's, which their authors rewrite): scaled dot-product attention, hint and all.


def attention_cases():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    return [checks.Case("square (1, 2, 4, 8)", (q, k, v), expected=right(q, k, v))]


@pytest.fixture
def ex(monkeypatch):
    for exercise in (checks.Exercise("99-attention", "attention", attention_cases, hint="normalise over the keys",
                                     forbid=("torch.nn.functional.scaled_dot_product_attention",)),
                     checks.Exercise("99-shapes", "predicted_shapes", lambda: [checks.Case("c", expected=(1, 2))],
                                     kind="value")):
        monkeypatch.setitem(checks._REGISTRY, exercise.id, exercise)
    return "99-attention"


def rendered(exercise_id, answer=checks._MISSING):
    """The lines IPython shows for the check's exception (its ``_render_traceback_``), or None if it passed."""
    try:
        check(exercise_id) if answer is checks._MISSING else check(exercise_id, answer)
    except (CheckFailed, ExerciseNotDone) as err:
        return err._render_traceback_()
    return None


def no_internals(lines):
    text = "\n".join(lines)
    return "Traceback" not in text and "File " not in text and "attncourse/" not in text and "site-packages" not in text


def test_not_attempted_is_two_lines(ex):
    def stub(q, k, v):
        raise NotImplementedError()

    for lines in (rendered("99-shapes"), rendered(ex, stub)):
        assert len(lines) == 2 and no_internals(lines)
        assert lines[0].endswith("not attempted yet; write your answer in the cell above")
    assert rendered("99-shapes")[0] == "exercise 99-shapes: not attempted yet; write your answer in the cell above"
    assert "`predicted_shapes` is not defined yet" in rendered("99-shapes")[1]
    assert "`attention` still raises NotImplementedError" in rendered(ex, stub)[1]
    assert rendered(ex, right) is None


def test_failure_shows_case_detail_hint_and_only_the_learners_frames(ex):
    def wrong(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -2) @ v

    lines = rendered(ex, wrong)
    assert lines[0] == "✗ 99-attention: case 'square (1, 2, 4, 8)' failed"
    assert "expected" in lines[1] and ", got " in lines[1] and lines[-1] == "  hint: normalise over the keys"
    assert no_internals(lines) and len(lines) == 3

    import linecache

    source, cell = "def crashes(q, k, v):\n    return q[99]\n", "/tmp/ipykernel_1/123.py"  # as ipykernel names cells
    linecache.cache[cell] = (len(source), None, source.splitlines(True), cell)
    namespace: dict = {}
    exec(compile(source, cell, "exec"), namespace)
    lines = rendered(ex, namespace["crashes"])
    assert lines[1].startswith("  your code raised IndexError")
    assert lines[2] == "  your code in crashes, line 2 of its cell: return q[99]"  # a notebook frame, no others
    assert no_internals(lines) and lines[-1].startswith("  hint: ")


def test_forbidden_call_has_the_same_layout(ex):
    import torch.nn.functional as F

    lines = rendered(ex, lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    assert lines[0] == "✗ 99-attention: case 'square (1, 2, 4, 8)' failed"
    assert "called torch.nn.functional.scaled_dot_product_attention" in lines[1]
    assert lines[-1] == "  hint: normalise over the keys" and no_internals(lines)


def test_long_values_are_cut_between_items_never_mid_number():
    brief = checks._brief(tuple(range(1000, 1300)))
    assert len(brief) < 200 and brief.endswith(", …)") and brief.startswith("(1000, 1001, ")
    assert checks._brief([0.123456789] * 100).endswith(", …]")
    assert checks._brief(torch.arange(100.0)) == "tensor of shape (100,)"
    assert checks._brief((1,)) == "(1,)" and checks._brief({"a": (1, 2)}) == "{'a': (1, 2)}"
    cut = checks._cut("x" * 10 + " 123456789" * 60, 100)
    assert cut.endswith(" …") and cut[:-2].split()[-1] == "123456789"  # a whole number before the cut


def test_uses_turns_an_unwritten_answer_into_one_note(capsys):
    """A demo cell wrapped in `checks.uses` prints one note for a stub or an undefined answer, and re-raises
    anything else (a learner's real error must still show)."""
    ex = next(iter(checks.registry().values()))
    with checks.uses(ex.id):
        raise NotImplementedError
    with checks.uses(ex.id):
        raise NameError(f"name {ex.target!r} is not defined", name=ex.target)
    out = capsys.readouterr().out
    assert out.count("note:") == 2 and ex.id in out
    with pytest.raises(NameError):
        with checks.uses(ex.id):
            raise NameError("name 'other' is not defined", name="other")
    with pytest.raises(ValueError):
        with checks.uses(ex.id):
            raise ValueError("a real mistake")
    with pytest.raises(KeyError):
        checks.uses("99-no-such-exercise")
