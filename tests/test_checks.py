"""The learner-side check: a pass line, or a specific message (case, shape or first differing index, hint)."""

import math

import numpy as np
import pytest
import torch

from attncourse.classroom import checks
from attncourse.classroom.checks import CheckFailed, ExerciseNotDone, check


def right(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v


def fixed(q, k, v):  # the given function of 03-find-the-bug-1 with its one fix
    inv_scale = q.shape[-1] ** -0.5
    weights = (inv_scale * q @ k.transpose(-2, -1)).softmax(dim=-1)
    return weights @ v


def test_pass_line(capsys):
    check("03-batched-attention-bug", fixed)
    assert capsys.readouterr().out.strip() == "✓ 03-find-the-bug-1: all 5 case(s) passed"  # the old id is an alias


def test_wrong_values_name_case_index_and_hint():
    def wrong(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -2) @ v

    with pytest.raises(CheckFailed) as info:
        check("03-batched-attention-bug", wrong)
    msg = str(info.value)
    assert "case “square (1, 2, 4, 8)”" in msg
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
    def rule(q, k, v, mask):  # a prediction is a rule of the shapes: leading axes broadcast, then Tq and Tk (or Dv)
        lead = tuple(max(a, b) for a, b in zip(q[:-2], k[:-2]))
        return (*lead, q[-2], k[-2]), (*lead, q[-2], k[-2]), (*lead, q[-2], v[-1])

    globals()["predicted_shapes"] = rule
    try:
        check("03-predict-shapes")
        globals()["predicted_shapes"] = lambda q, k, v, m: (rule(q, k, v, m)[0], (*rule(q, k, v, m)[0][:-2], k[-2], q[-2]),
                                                            rule(q, k, v, m)[2])
        with pytest.raises(CheckFailed) as info:  # a prediction is judged whole: not which part, never the answer
            check("03-predict-shapes")
        assert str(info.value).splitlines()[1].strip() == checks.predictions.NOT_RIGHT
        assert "(2, 4, 5, 7)" not in str(info.value)
    finally:
        del globals()["predicted_shapes"]


def test_compare_rules():
    case = checks.Case("c")
    assert checks.compare(torch.ones(2), torch.ones(2), case) is None
    assert "NaN or inf" in checks.compare(torch.tensor([1.0, float("nan")]), torch.ones(2), case)
    assert "expected a tensor" in checks.compare([1, 2], torch.ones(2), case)
    assert checks.compare(3, 3, checks.Case("c", compare="equal")) is None
    tight = checks.Case("c", rtol=1e-9, atol=0.0)  # values equal to 6 digits are shown with the digits that differ
    message = checks.compare(torch.tensor([0.0, -0.0237447123999], dtype=torch.float64),
                             torch.tensor([0.0, -0.0237447123456], dtype=torch.float64), tight)
    assert "expected -0.0237447123, got -0.0237447124" in message, message
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
    assert lines[0] == "✗ 99-attention: case “square (1, 2, 4, 8)” failed"
    detail = " ".join(line.strip() for line in lines[1:-1])  # a long line is wrapped between words
    assert "expected" in detail and ", got " in detail and lines[-1] == "  hint: normalise over the keys"
    assert no_internals(lines) and all(line.startswith("  ") for line in lines[1:])

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
    assert lines[0] == "✗ 99-attention: case “square (1, 2, 4, 8)” failed"
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


# ----------------------------------------------------------------------------- feedback that diagnoses (issue 32)


def softmax_np(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def sdpa_np(scale=True, axis=-1, factor=1.0):
    def answer(Q, K, V):
        w = softmax_np(Q @ K.T / (np.sqrt(Q.shape[-1]) if scale else 1.0), axis)
        return factor * (w @ V), factor * w
    return answer


def failure_lines(exercise_id, answer):
    with pytest.raises(CheckFailed) as info:
        check(exercise_id, answer)
    return info.value._render_traceback_()


@pytest.mark.parametrize("answer, named", [
    (sdpa_np(scale=False), "without dividing the scores by √d_k"),
    (sdpa_np(axis=0), "sum to 1 along the queries"),
    (sdpa_np(factor=1.5), "1.5 times the right one"),
])
def test_a_common_mistake_is_named_in_the_hint(answer, named):
    """The hint names the mistake the learner's output shows (two different mistakes: two different hints), the
    returned tuple's part is named ("output", not "at [0]"), a NumPy exercise speaks of arrays, equal layouts are
    not printed, and the case name's own quote survives."""
    lines = failure_lines("03-sdpa-numpy", answer)
    text = "\n".join(lines)
    assert lines[0] == "✗ 03-sdpa-numpy: case “the notes' (4, 8) inputs” failed", lines
    assert lines[1].startswith("  output: ") and "at [0]" not in text
    assert "tensor" not in text and "expected (" not in text  # arrays; the (same) shapes are not repeated
    hint = text[text.index("  hint: "):]
    assert named in " ".join(hint.split()) and "@" not in hint and "softmax(" not in hint
    assert all(len(line) <= checks.WIDTH for line in lines)


def test_a_mask_read_the_wrong_way_round_is_named():
    def inverted(q, k, v, keep):
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        w = torch.exp(s - s.amax(-1, keepdim=True)) * keep.logical_not()
        return (w / w.sum(-1, keepdim=True).clamp_min(1e-30)) @ v

    text = " ".join(" ".join(failure_lines("03-masked-attention", inverted)).split())
    assert "your mask is the wrong way round" in text


def test_an_unrecognised_mistake_keeps_the_general_hint_and_shapes_that_differ_are_shown():
    ex = checks.get("03-sdpa-numpy")
    lines = failure_lines(ex.id, lambda Q, K, V: (np.zeros((4, 8)), np.full((4, 4), 0.3)))
    text = " ".join(" ".join(lines).split())
    assert text.split("hint: ")[1].startswith(" ".join(ex.hint.split())[:30]), lines
    case = ex.make_cases()[0]
    msg = checks.feedback(ex, (case.expected[0], case.expected[1][:, :2]), case)
    assert msg.startswith("weights: wrong shape") and "expected (" in msg  # the layouts differ: both shown


def test_grader_names_the_mistake_too():
    from attncourse.classroom.grading.remote import judge

    ex = checks.get("03-sdpa-numpy")
    cases = ex.make_cases()
    reply = {"status": "ok", "results": [("ok", tuple(torch.from_numpy(np.asarray(x)) for x in
                                                   sdpa_np(axis=0)(*(a.numpy() for a in c.args))), None)
                                         for c in cases]}
    status, message = judge(ex, cases, reply)
    assert status == "failed" and "this looks like: your weights sum to 1 along the queries" in message


def test_a_right_answer_is_never_diagnosed_and_a_bug_is_never_named():
    for ex_id in ("03-sdpa-numpy", "03-masked-attention", "03-find-the-bug-1"):
        ex = checks.get(ex_id)
        for case in ex.make_cases():
            assert checks.diagnose(ex, case.expected, case) is None
    bug = checks.get("03-find-the-bug-1")  # its wrong answers are often the bug itself: no diagnosis
    case = bug.make_cases()[0]
    assert checks.diagnose(bug, case.expected * 1.5, case) is None


def notebook_frame_error(source):
    """The exception `source` raises when run as a notebook cell (ipykernel's file name for cells)."""
    import linecache

    cell = "/tmp/ipykernel_1/456.py"
    linecache.cache[cell] = (len(source), None, source.splitlines(True), cell)
    try:
        exec(compile(source, cell, "exec"), {})
    except BaseException as err:
        return err
    raise AssertionError("no exception")


def test_unwritten_answers_become_notes_and_real_errors_stay():
    stub = notebook_frame_error("# YOUR CODE HERE\nraise NotImplementedError()\n")
    assert checks.quiet_note(stub).startswith("note: your answer goes in this cell")
    demo = notebook_frame_error("def attention_numpy(Q, K, V):\n    raise NotImplementedError()\n\n"
                                "attention_numpy(1, 2, 3)\n")
    assert checks.quiet_note(demo) == ("note: this cell runs `attention_numpy`, which is not written yet; it shows its "
                                       "result once it is")
    assert checks.quiet_note(notebook_frame_error("raise NotImplementedError('sparse tensors')\n")) is None
    assert checks.quiet_note(notebook_frame_error("x = [][1]\n")) is None
    with pytest.raises(ExerciseNotDone) as info:
        check("03-predict-shapes")
    assert checks.quiet_note(info.value).startswith("exercise 03-predict-shapes: not attempted yet")


def test_an_ipython_kernel_shows_notes_not_tracebacks_except_under_nbgrader(tmp_path):
    """In a real IPython shell: the stub's error and an unattempted check print a note on stdout and no traceback;
    a real error keeps its traceback; under nbgrader (NBGRADER_EXECUTION) the stub stays an error."""
    import os
    import subprocess
    import sys

    script = tmp_path / "shell.py"
    script.write_text("""
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shown = []
shell._showtraceback = lambda etype, value, stb: shown.append(etype.__name__)
from attncourse.classroom import checks
print("installed", checks.install_notes())
r = shell.run_cell("raise NotImplementedError()")
print("stub failed", not r.success)
shell.run_cell("checks.check('03-predict-shapes')".replace("checks.", "__import__('attncourse').classroom.checks."))
shell.run_cell("1/0")
print("errors shown", shown)
""", encoding="utf-8")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NBGRADER_EXECUTION": ""})
    out = run.stdout
    assert "installed True" in out and "stub failed True" in out, run.stderr[-2000:]
    assert "note: your answer goes in this cell" in out and "03-predict-shapes: not attempted yet" in out
    assert "errors shown ['ZeroDivisionError']" in out  # the stub and the check: notes; the real error: shown
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NBGRADER_EXECUTION": "autograde"})
    assert "installed False" in run.stdout and "errors shown ['NotImplementedError', 'ExerciseNotDone'" in run.stdout
