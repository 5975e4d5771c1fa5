"""The guard (attncourse.classroom.checks.forbidden): what the answer runs is judged, not the names it uses. A
library function it is not allowed, an operator family it is asked not to use, a check's own reference, or a switch
that turns the watch off is refused however the answer reaches it, by the check cell and by the grader's
kernel-side code alike; the learner's own code never is."""

from __future__ import annotations

import sys

import pytest
import torch

import attncourse
import attncourse.positions
from attncourse.classroom import checks
from attncourse.classroom.checks import forbidden
from attncourse.classroom.grading.remote import KERNEL_SIDE, judge

REAL_SLOPES = attncourse.positions.alibi_slopes


def slope_cases():
    return [checks.Case(f"{n} heads", (n,), expected=REAL_SLOPES(n)) for n in (4, 6)]


def softmax_cases():
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return [checks.Case("rows", (x,), expected=torch.softmax(x, -1))]


def my_slopes(n):
    """The learner's own slopes (Press et al.'s rule, written out)."""
    import math

    def power_of_two(k):
        start = 2 ** (-(2 ** -(math.log2(k) - 3)))
        return [start * start**i for i in range(k)]

    if math.log2(n).is_integer():
        return torch.tensor(power_of_two(n))
    closest = 2 ** math.floor(math.log2(n))
    extra = power_of_two(2 * closest)[0::2][: n - closest]
    return torch.tensor(power_of_two(closest) + extra)


@pytest.fixture
def exercise(monkeypatch):
    def register(make_cases, forbid, target="answer", **kwargs):
        ex = checks.Exercise("99-guard", target, make_cases, forbid=forbid, category="implement", **kwargs)
        monkeypatch.setitem(checks._REGISTRY, ex.id, ex)
        return ex

    return register


@pytest.fixture
def verdicts(tmp_path, monkeypatch, capsys):
    """(check cell message or None, grader status and message) for an answer."""
    def run(ex, answer):
        try:
            checks.check(ex.id, answer)
            cell = None
        except checks.CheckFailed as err:
            cell = str(err)
        capsys.readouterr()
        namespace: dict = {}
        exec(KERNEL_SIDE, namespace)
        monkeypatch.setitem(sys.modules["__main__"].__dict__, ex.target, answer)
        cases = ex.make_cases()
        torch.save([(tuple(c.args), dict(c.kwargs)) for c in cases], tmp_path / "in.pt")
        namespace["__attncourse_grade"](str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), ex.target, ex.kind,
                                        ex.numpy, ex.policy)
        assert sys.getprofile() is None and not torch.overrides._get_current_function_mode_stack()
        return cell, judge(ex, cases, torch.load(tmp_path / "out.pt", weights_only=True))

    return run


def refused(result, name: str) -> bool:
    cell, (status, message) = result
    return (cell is not None and f"called {name}" in cell) and status == "failed" and f"called {name}" in message


def passed(result) -> bool:
    cell, (status, _) = result
    return cell is None and status == "passed"


def test_every_route_to_a_forbidden_package_function_is_refused(exercise, verdicts, monkeypatch):
    ex = exercise(slope_cases, ("attncourse.positions.alibi_slopes",))
    assert passed(verdicts(ex, my_slopes))
    assert refused(verdicts(ex, lambda n: attncourse.positions.alibi_slopes(n)), "attncourse.positions.alibi_slopes")
    assert refused(verdicts(ex, lambda n: attncourse.alibi_slopes(n)), "attncourse.positions.alibi_slopes")  # re-export
    from attncourse import alibi_slopes as renamed  # imported under another name before the check

    assert refused(verdicts(ex, lambda n: renamed(n)), "attncourse.positions.alibi_slopes")
    assert refused(verdicts(ex, REAL_SLOPES), "attncourse.positions.alibi_slopes")  # the library's function as the answer


def test_a_rebound_name_is_the_learners_code_but_the_original_is_still_refused(exercise, verdicts, monkeypatch):
    ex = exercise(slope_cases, ("attncourse.positions.alibi_slopes",))
    for name, module in list(sys.modules.items()):  # every module-level name of the library's function, re-bound
        if name.startswith("attncourse") and getattr(module, "alibi_slopes", None) is REAL_SLOPES:
            monkeypatch.setattr(module, "alibi_slopes", my_slopes)
    assert passed(verdicts(ex, lambda n: attncourse.alibi_slopes(n)))  # the learner's own function, by that name
    # ... but the original, saved in the notebook under another name before re-binding, is still the library's
    monkeypatch.setitem(sys.modules["__main__"].__dict__, "kept", REAL_SLOPES)
    assert refused(verdicts(ex, lambda n: REAL_SLOPES(n)), "attncourse.positions.alibi_slopes")


def test_every_spelling_of_a_pytorch_op_is_refused(exercise, verdicts):
    ex = exercise(softmax_cases, ("torch.softmax",))
    assert passed(verdicts(ex, lambda x: torch.exp(x - x.amax(-1, keepdim=True)) / torch.exp(
        x - x.amax(-1, keepdim=True)).sum(-1, keepdim=True)))
    for answer in (lambda x: torch.softmax(x, -1), lambda x: x.softmax(-1), lambda x: torch.nn.functional.softmax(x, -1),
                   lambda x: torch.special.softmax(x, -1)):
        assert refused(verdicts(ex, answer), "torch.")
    f = torch.nn.functional.softmax
    assert refused(verdicts(ex, lambda x, _f=f: _f(x, -1)), "torch.")  # a default argument bound earlier


def test_a_forbidden_class_forbids_building_or_calling_it(exercise, verdicts):
    ex = exercise(softmax_cases, ("torch.nn.MultiheadAttention",))

    def via_module(x):
        torch.nn.MultiheadAttention(5, 1)
        return torch.softmax(x, -1)

    assert refused(verdicts(ex, via_module), "torch.nn.MultiheadAttention")
    assert passed(verdicts(ex, lambda x: torch.softmax(x, -1)))


def test_switching_the_guard_off_is_refused(exercise, verdicts):
    ex = exercise(softmax_cases, ("torch.softmax",))

    def sneaky(x):
        sys.setprofile(None)
        return torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)

    assert refused(verdicts(ex, sneaky), "sys.setprofile")


def test_the_guard_chains_a_profiler_already_installed():
    events = []
    sys.setprofile(lambda frame, event, arg: events.append(event))
    try:
        with forbidden.CallGuard(("torch.softmax",)) as guard:
            torch.softmax(torch.ones(3), -1)
        assert guard.used == ["torch.softmax"] and events
        assert sys.getprofile() is not None  # the previous profiler is back
    finally:
        sys.setprofile(None)


def test_nothing_is_watched_without_a_forbidden_name():
    with forbidden.CallGuard(()) as guard:
        assert sys.getprofile() is None
    assert guard.used == []
    assert forbidden.resolve("attncourse.no_such_function") == []


# ----------------------------------------------------------------------------- what runs, not names


def _rows(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def test_library_code_is_refused_by_any_route_unless_allowed(exercise, verdicts):
    import functools
    import types

    import attncourse.online_softmax as online

    ex = exercise(softmax_cases, ())
    assert passed(verdicts(ex, _rows))
    routes = {
        "the function handed in": online.one_pass_softmax,
        "a lambda": lambda x: online.one_pass_softmax(x),
        "functools.partial": functools.partial(online.one_pass_softmax, dim=-1),
        "torch.no_grad()": torch.no_grad()(lambda x: online.one_pass_softmax(x)),
        "its code in a new function": types.FunctionType(online.one_pass_softmax.__code__, {**vars(online)}, "mine",
                                                         online.one_pass_softmax.__defaults__),
        "a private helper": lambda x: (attncourse.sdpa._check_qkv(x, x, x), _rows(x))[1],
        "a check's reference": lambda x: checks.ch08._log_softmax_reference(x).exp(),
    }
    for route, answer in routes.items():
        cell, (status, message) = verdicts(ex, answer)
        assert cell is not None and "called attncourse." in cell and status == "failed" and "called" in message, route


def test_an_allowed_helper_runs_its_own_library_code_but_not_the_learners_callback(exercise, verdicts):
    from attncourse.mha import MultiHeadAttention

    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = MultiHeadAttention(8, 2)
    want = model(x).detach()

    def cases():
        return [checks.Case("mha", (x,), expected=want)]

    def via_module(x):
        torch.manual_seed(0)
        return MultiHeadAttention(8, 2)(x).detach()  # __init__, forward through nn.Module.__call__, its helpers

    assert refused(verdicts(exercise(cases, ()), via_module), "attncourse.mha.MultiHeadAttention")
    assert passed(verdicts(exercise(cases, (), allow=("attncourse.mha.MultiHeadAttention",)), via_module))


def test_operator_families_are_refused_under_every_spelling(exercise, verdicts):
    ex = exercise(softmax_cases, (), ops=("softmax",))
    aten = torch.ops.aten

    def disabled(x):
        with torch._C.DisableTorchFunction():
            return aten._softmax.default(x, -1, False)

    def both_disabled(x):
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            return aten._softmax.default(x, -1, False)

    for answer in (lambda x: aten._softmax(x, -1, False), lambda x: aten._safe_softmax(x, -1),
                   lambda x: torch.log_softmax(x, -1).exp(), lambda x: torch.nn.Softmax(-1)(x),
                   lambda x: torch.nn.functional.softmin(-x, -1), disabled, both_disabled):
        cell, (status, message) = verdicts(ex, answer)
        assert cell is not None and "called" in cell and status == "failed", (cell, status, message)
    assert passed(verdicts(ex, _rows))  # exp, amax and sum are not a softmax


def test_torch_masked_is_judged_as_the_masked_operator_it_is(exercise, verdicts):
    """torch.masked.softmax is Python that masks and then calls a plain softmax: where a plain softmax is allowed and
    the masked one is not, the guard judges torch.masked's functions by what they are (masked_softmax, ...)."""
    ex = exercise(softmax_cases, (), ops=("aten::_masked_softmax", "aten::masked_log_softmax"))
    keep = lambda x: torch.ones_like(x, dtype=torch.bool)  # noqa: E731
    for answer in (lambda x: torch.masked.softmax(x, -1, mask=keep(x)),
                   lambda x: torch.masked.log_softmax(x, -1, mask=keep(x)).exp()):
        cell, (status, message) = verdicts(ex, answer)
        assert cell is not None and "masked" in cell and status == "failed", (cell, status, message)
    assert passed(verdicts(ex, lambda x: torch.softmax(x.masked_fill(~keep(x), float("-inf")), -1)))
    assert passed(verdicts(exercise(softmax_cases, (), ops=("logsumexp",)), lambda x: torch.masked.softmax(x, -1)))


def test_an_answer_that_catches_the_refusal_is_still_refused(exercise, verdicts):
    ex = exercise(softmax_cases, (), ops=("softmax",))

    def catcher(x):
        try:
            return torch.softmax(x, -1)
        except BaseException:
            return _rows(x)

    assert refused(verdicts(ex, catcher), "torch.softmax")
    assert sys.getprofile() is None and not torch._C._len_torch_dispatch_stack()


def test_numpy_alone_refuses_any_pytorch_operation(exercise, verdicts):
    import numpy as np

    ex = exercise(softmax_cases, (), numpy=True)

    def by_torch(x):
        return torch.from_numpy(np.asarray(x)).log_softmax(-1).exp().numpy()

    def by_numpy(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    cell, (status, _) = verdicts(ex, by_torch)
    assert cell is not None and "NumPy alone" in cell and status == "failed"
    assert passed(verdicts(ex, by_numpy))


def test_a_rule_in_plain_python_refuses_numpy_by_every_usual_route(exercise, verdicts):
    """ops=("torch", "numpy"): a prediction written as a rule may not measure with NumPy either."""
    import math

    import numpy as np

    def cases():
        return [checks.Case("three sizes", (3,), expected=6), checks.Case("five sizes", (5,), expected=15)]

    ex = exercise(cases, (), kind="function", ops=("torch", "numpy"), allow=())

    def rule(n):
        return n * (n + 1) // 2 + 0 * math.floor(0.5)

    routes = {
        "numpy.arange": lambda n: int(np.arange(1, n + 1).sum()),
        "numpy.array": lambda n: int(np.array(range(1, n + 1)).sum()),
        "numpy.ndarray.sum": lambda n: int(np.exp([0.0] * n).sum() * (n + 1) / 2),  # a ufunc's result, then a method
        "numpy._core.einsumfunc": lambda n: int(np.einsum("i->", list(range(1, n + 1)))),
        "torch.arange": lambda n: int(torch.arange(1, n + 1).sum()),
    }
    for name, route in routes.items():
        cell, (status, message) = verdicts(ex, route)
        assert cell is not None and f"called {name}" in cell and status == "failed", (name, cell, status)
        assert "plain Python" in cell or "PyTorch" in cell
    assert passed(verdicts(ex, rule))


def test_a_tensor_exercise_refuses_leaving_pytorch_for_numpy(exercise, verdicts):
    """An implement exercise is judged by what it runs in PyTorch: NumPy would run the arithmetic unseen."""
    import numpy as np

    ex = exercise(softmax_cases, ())
    assert "numpy" in ex.forbidden_ops

    def in_numpy(x):
        a = x.numpy()
        e = np.exp(a - a.max(-1, keepdims=True))
        return torch.from_numpy(e / e.sum(-1, keepdims=True))

    def as_array(x):
        a = np.asarray(x)
        return torch.from_numpy(np.exp(a) / np.exp(a).sum(-1, keepdims=True))

    assert refused(verdicts(ex, in_numpy), "torch.Tensor.numpy")
    assert refused(verdicts(ex, as_array), "numpy.asarray")
    assert passed(verdicts(ex, lambda x: (x - x.amax(-1, keepdim=True)).exp() / (x - x.amax(-1, keepdim=True)).exp().sum(-1, keepdim=True)))


def test_the_courses_code_copied_as_text_is_the_courses_code(exercise, verdicts):
    """Pasted or exec'd, renamed, without its docstring or comments: a copy of a library function is refused;
    code with its own structure is the learner's."""
    import inspect
    import re

    source = inspect.getsource(attncourse.positions.alibi_slopes)
    source = re.sub(r'""".*?"""', "pass", source, count=1, flags=re.S).replace("def alibi_slopes", "def mine")
    source = re.sub(r"#.*", "", source)
    for local in sorted(set(attncourse.positions.alibi_slopes.__code__.co_varnames) - {"n_heads"}):
        source = re.sub(rf"\b{local}\b", local + "_x", source)
    namespace = dict(vars(attncourse.positions))
    exec(compile(source, "<pasted>", "exec"), namespace)
    copy = namespace["mine"]
    assert copy.__code__.co_varnames != attncourse.positions.alibi_slopes.__code__.co_varnames
    ex = exercise(slope_cases, ())
    assert refused(verdicts(ex, copy), "a copy of attncourse.positions.alibi_slopes")
    assert passed(verdicts(ex, my_slopes))  # the same rule, written afresh


def _without_input_checks(function, blank_with_pass=False):
    """`function`'s source with its input checks deleted (or each replaced by `pass`), exec'd afresh as `mine`."""
    import ast
    import inspect
    import textwrap

    def is_check(node):
        if isinstance(node, (ast.Raise, ast.Assert)):
            return True
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            return ast.unparse(node.value.func).startswith(("_validate", "_check"))
        return isinstance(node, (ast.If, ast.For)) and not getattr(node, "orelse", None) and \
            all(is_check(n) for n in node.body)

    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    body = tree.body[0].body
    tree.body[0].body = [ast.Pass() if blank_with_pass and is_check(n) else n for n in body
                         if blank_with_pass or not is_check(n)]
    tree.body[0].name = "mine"
    assert len(tree.body[0].body) < len(body) or blank_with_pass
    namespace = dict(vars(inspect.getmodule(function)))
    exec(compile(ast.unparse(tree), "<edited>", "exec"), namespace)
    return namespace["mine"]


def test_a_copy_with_its_input_checks_deleted_is_still_the_courses_code(exercise, verdicts):
    """The checks of a library function (a raise, its `if`, a `_validate` call, a loop of them) deleted or made
    `pass`: the rest of its body is the course's code. The same merge written afresh is the learner's."""
    from attncourse import cascade, kv_quant

    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(2, 5, 4, generator=gen), torch.randn(2, 5, generator=gen)] * 2

    def merge_cases():
        return [checks.Case("two parts", tuple(parts), expected=cascade.merge_attention_outputs(*parts))]

    def my_merge(out_a, lse_a, out_b, lse_b):
        top = torch.maximum(lse_a, lse_b)
        a, b = (lse_a - top).exp(), (lse_b - top).exp()
        return (a[..., None] * out_a + b[..., None] * out_b) / (a + b)[..., None], top + (a + b).log()

    ex = exercise(merge_cases, ())
    for blank in (False, True):
        copy = _without_input_checks(cascade.merge_attention_outputs, blank)
        assert refused(verdicts(ex, copy), "a copy of attncourse.cascade.merge_attention_outputs")
    assert passed(verdicts(ex, my_merge))
    x = torch.randn(3, 8, generator=gen)
    ex = exercise(lambda: [checks.Case("4 bits", (x, 4, -1), expected=kv_quant.fake_quantize(x, 4, -1))], ())
    assert refused(verdicts(ex, _without_input_checks(kv_quant.fake_quantize)),
                   "a copy of attncourse.kv_quant.fake_quantize")


def test_a_stream_can_be_read_once_and_forgets_its_chunks():
    x = torch.arange(10.0)
    seen = []

    def keeps_chunks(stream, size):
        chunks = list(stream)
        seen.append([c.clone() for c in chunks])
        try:
            list(stream)
        except RuntimeError as err:
            seen.append(str(err))
        return torch.cat(chunks)

    ran = forbidden.run(keeps_chunks, (x, 4), {}, forbidden.policy(stream=(0, 0, "arg1"), trace=True))
    assert ran["trace"]["chunks"] == 3 and "only once" in seen[1]
    assert torch.isnan(ran["result"]).all()  # every chunk was overwritten once the next was asked for
    assert all(torch.isnan(c).all() for c in seen[0])  # kept references see NaN


def test_the_trace_labels_the_inputs_and_their_slices():
    q, k = torch.randn(4, 8), torch.randn(16, 8)

    def tiles(q, k):
        return [q @ k[i:i + 4].T for i in range(0, 16, 4)]

    ran = forbidden.run(tiles, (q, k), {}, forbidden.policy(trace=True))
    reads = [(t[0], t[1], t[2]) for op in ran["trace"]["ops"] for t in op[3] if t[0] == "arg1"]
    starts = sorted({offset // 8 for label, offset, shape in reads if shape[0] == 4})
    assert starts == [0, 4, 8, 12]


def _tamper_via(frame):
    """What a learner would do with a frame: walk up to the check's frames and switch the guard off."""
    while frame is not None:
        guard = frame.f_locals.get("guard") or frame.f_locals.get("self")
        if isinstance(guard, forbidden.Guard):
            guard.builtins, guard.families, guard.stop = {}, (), False
        frame = frame.f_back


def test_a_frame_reached_by_an_attribute_or_a_library_is_refused(exercise, verdicts):
    """Frames reached without a call the profile hook sees (a traceback's tb_frame, a generator's gi_frame,
    logging's currentframe, traceback.walk_tb) lead to the guard: each route is refused, tampering or not."""
    ex = exercise(softmax_cases, ("torch.softmax",))

    # each reaches for the guard first, then calls the forbidden function
    def by_traceback(x):
        try:
            raise ValueError
        except ValueError as err:
            _tamper_via(err.__traceback__.tb_frame)
        return torch.softmax(x, -1)

    def by_generator(x):
        gen = (i for i in range(1))
        _tamper_via(gen.gi_frame)
        return torch.softmax(x, -1)

    def by_logging(x):
        import logging
        _tamper_via(logging.currentframe())
        return torch.softmax(x, -1)

    def by_walk_tb(x):
        import traceback
        try:
            raise ValueError
        except ValueError as err:
            for frame, _ in traceback.walk_tb(err.__traceback__):
                _tamper_via(frame)
        return torch.softmax(x, -1)

    for answer, name in ((by_traceback, "the attribute tb_frame"), (by_generator, "the attribute gi_frame"),
                         (by_logging, "sys._getframe"), (by_walk_tb, "traceback.walk_tb")):
        cell, (status, message) = verdicts(ex, answer)
        assert cell is not None and name in cell and status == "failed" and name in message, (answer.__name__, cell, status, message)


def test_exceptions_and_generators_inside_an_answer_still_work(exercise, verdicts):
    """The frame routes are refused, not the things that carry frames: an answer that raises and catches, or
    uses a generator, passes."""
    ex = exercise(softmax_cases, ("torch.softmax",))

    def honest(x):
        try:
            int("not a number")
        except ValueError as err:
            assert "not a number" in str(err)
        rows = list(torch.exp(r - r.max()) for r in x)
        return torch.stack([r / r.sum() for r in rows])

    assert passed(verdicts(ex, honest))


def test_the_guards_bookkeeping_runs_no_learner_code_unwatched(exercise, verdicts):
    """The modes' bookkeeping runs without the profile hook (a 2x faster check) only on plain tensors and plain
    functions: a tensor subclass whose methods the guard reads, or a callable of the learner's handed to the
    torch-function mode, stays watched, so a forbidden call made from there is refused."""
    ex = exercise(slope_cases, ("attncourse.positions.alibi_slopes",), ops=("softmax",), trace=True)
    smuggled = []

    class Sneaky(torch.Tensor):
        def untyped_storage(self):  # the guard reads each operand's storage while it records the trace
            smuggled.append(attncourse.positions.alibi_slopes(4))
            return super().untyped_storage()

    def sneaky(n):
        x = torch.zeros(n).as_subclass(Sneaky)
        (x + 1).sum()
        return smuggled[-1] if smuggled else my_slopes(n)

    assert refused(verdicts(ex, sneaky), "attncourse.positions.alibi_slopes")
    assert passed(verdicts(ex, my_slopes))


def doubled_cases():
    x = torch.randn(40, 40, generator=torch.Generator().manual_seed(1))
    return [checks.Case("40 x 40", (x,), expected=2 * x)]


def test_complex_numbers_are_refused_where_the_exercise_asks_for_real_arithmetic(exercise, verdicts):
    ex = exercise(doubled_cases, (), ops=("complex",))
    assert passed(verdicts(ex, lambda x: x + x))
    for answer in (lambda x: (x.view(torch.complex64) * 2).view(torch.float32),
                   lambda x: torch.view_as_real(torch.view_as_complex(x.reshape(40, 20, 2)) * 2).reshape(40, 40),
                   lambda x: (x * (2 + 0j)).real,
                   lambda x: torch.polar(x.abs(), torch.zeros_like(x)).real * 2 * x.sign()):
        cell, (status, message) = verdicts(ex, answer)
        assert cell is not None and "complex numbers" in cell and status == "failed", (cell, status, message)
        assert "complex numbers" in message


def test_the_numbers_stay_in_pytorch_bar_a_few(exercise, verdicts):
    """An implement exercise on tensors refuses reading its inputs out into plain Python in bulk (tolist, item,
    float(t), a storage's tolist): the arithmetic would run where no trace sees it. A few numbers (a loop bound, an
    index) are fine."""
    ex = exercise(doubled_cases, ())
    assert "numpy" in ex.forbidden_ops
    assert passed(verdicts(ex, lambda x: x * 2))
    assert passed(verdicts(ex, lambda x: x * (int(x.shape[0] > 0) + float(x[0, 0] * 0 + 1))))

    def by_list(x):
        return torch.tensor([[2 * v for v in row] for row in x.tolist()])

    def by_item(x):
        out = torch.empty_like(x)
        for i in range(x.shape[0]):
            for j in range(x.shape[1]):
                out[i, j] = 2 * float(x[i, j])
        return out

    def by_storage(x):  # the bytes of the storage, read out and put back: the learner's arithmetic could go between
        raw = x.contiguous().untyped_storage().tolist()
        return torch.tensor(raw, dtype=torch.uint8).view(torch.float32).view(40, 40) * 2

    def by_bits(x):  # integers are not counted, but floats' bits read as integers are refused
        import struct
        words = x.contiguous().view(torch.int32).tolist()
        return torch.tensor([[2 * struct.unpack("f", struct.pack("i", w))[0] for w in row] for row in words])

    cell, (status, message) = verdicts(ex, by_bits)
    assert cell is not None and "reinterpreted as integers" in cell and status == "failed", (cell, message)
    class Plain(torch.Tensor):
        pass

    def by_subclass_list(x):  # the same read-out through a tensor subclass
        return torch.tensor([[2 * v for v in row] for row in x.as_subclass(Plain).tolist()])

    for answer in (by_list, by_item, by_storage, by_subclass_list):
        cell, (status, message) = verdicts(ex, answer)
        assert cell is not None and "numbers read out of tensors" in cell and status == "failed", (answer.__name__, cell, message)
        assert "numbers read out of tensors" in message


def test_forbidding_autograd_forbids_its_engine(exercise, verdicts):
    def cases():
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        return [checks.Case("x", (x,), expected=3 * x**2)]

    ex = exercise(cases, ("torch.autograd.grad", "torch.Tensor.backward"))
    assert passed(verdicts(ex, lambda x: 3 * x * x))

    def engine(x):
        x = x.detach().requires_grad_()
        y = (x**3).sum()
        torch.autograd.Variable._execution_engine.run_backward((y,), (torch.ones_like(y),), False, False, (),
                                                                False)
        return x.grad

    def engine_inputs(x):
        x = x.detach().requires_grad_()
        y = (x**3).sum()
        return torch.autograd.Variable._execution_engine.run_backward((y,), (torch.ones_like(y),), False, False,
                                                                       (x,), False)[0]

    for answer in (engine, engine_inputs, lambda x: torch.autograd.grad((x.detach().requires_grad_() ** 3).sum(),
                                                                          [x])[0]):
        cell, (status, message) = verdicts(ex, answer)
        assert cell is not None and "called" in cell and status == "failed", (cell, status, message)


def test_the_trace_counts_every_number_read_out_whatever_its_dtype():
    """Booleans and integers escape the float read-out budget (they are control flow), but the trace records them,
    so an exercise's property can refuse a mask read out into lists (chapter 11's tile states)."""
    import torch

    mask = torch.rand(6, 7, generator=torch.Generator().manual_seed(0)) < 0.5

    def as_lists(m):
        return sum(map(sum, m.tolist())) + len(m.nonzero().tolist())

    ran = forbidden.run(as_lists, (mask,), {}, forbidden.policy(ops=("numpy",), trace=True))
    assert not ran["used"] and ran["trace"]["read"] == 42 + 2 * int(mask.sum())  # the booleans, then the indices
    assert forbidden.run(as_lists, (mask,), {}, forbidden.policy(ops=("numpy",)))["trace"] is None
