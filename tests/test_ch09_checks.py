"""Chapter 09's checks refuse what a learner could hand in without the skill (issue 23): the review's routes and
others of the same kinds, by the check cell and by the grader; the right answers pass."""

from __future__ import annotations

import math
import re

import nbformat
import pytest
import torch

from attncourse import AttentionState, finalize_attention_state, online_attention_update
from attncourse.classroom import checks
from attncourse.classroom.grading.remote import judge
from attncourse.classroom.nbtools import ROOT
from test_exercise_standard import as_learner, grader_reply
from exercise_routes import NOT_THE_WAY, accepted, failure  # noqa: E402,F401
from exercise_routes import refused as _refused  # noqa: E402


refused = _refused


# The breakers (right outputs computed the wrong way) are run by check and grader for every chapter in
# test_exercise_standard.test_properties_refuse_their_breakers; here the shortcuts of every category.
@pytest.mark.parametrize("ex", [e for e in checks.exercises_for("09") if e.shortcuts], ids=lambda e: e.id)
def test_shortcuts_refused_by_check_and_grader(ex, tmp_path, monkeypatch):
    for shortcut in ex.shortcuts:
        msg, graded = refused(ex.id, shortcut, tmp_path, monkeypatch)
        assert "called" in msg and "called" in graded, (shortcut.__name__, msg)


# ----------------------------------------------------------------------------- 1. tile backward


def tile_backward(q, k, v, out, lse, d_out, scale):
    p = torch.exp(q @ k.transpose(-2, -1) * scale - lse[..., None])
    ds = p * (d_out @ v.transpose(-2, -1) - (d_out * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ d_out


def test_tile_backward_right_and_library_routes(tmp_path, monkeypatch):
    accepted("09-tile-backward", tile_backward, tmp_path, monkeypatch)
    from attncourse import flash

    def private_backward(q, k, v, out, lse, d_out, scale):  # the review's route: the package's private helper
        flat = lambda x: x.reshape(-1, *x.shape[-2:])  # noqa: E731
        return flash._tiled_backward(flat(q)[:, None], flat(k), flat(v), flat(out)[:, None], lse.reshape(-1, 1, lse.shape[-1]),
                                     flat(d_out)[:, None], None, None, scale, 64, 64)

    def func_vjp(q, k, v, out, lse, d_out, scale):
        def block(q, k, v):
            p = (q @ k.transpose(-2, -1) * scale - lse[..., None]).exp()
            delta = (d_out * out).sum(-1, keepdim=True)
            return (d_out * (p @ v)).sum() - (delta * p.sum(-1, keepdim=True)).sum()
        return torch.func.grad(block, argnums=(0, 1, 2))(q, k, v)

    def autograd_functional(q, k, v, out, lse, d_out, scale):
        def block(q, k, v):
            p = (q @ k.transpose(-2, -1) * scale - lse[..., None]).exp()
            delta = (d_out * out).sum(-1, keepdim=True)
            return (d_out * (p @ v)).sum() - (delta * p.sum(-1, keepdim=True)).sum()
        return torch.autograd.functional.vjp(block, (q, k, v))[1]

    def backward_method(q, k, v, out, lse, d_out, scale):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        p = (q @ k.transpose(-2, -1) * scale - lse[..., None]).exp()
        delta = (d_out * out).sum(-1, keepdim=True)
        ((d_out * (p @ v)).sum() - (delta * p.sum(-1, keepdim=True)).sum()).backward()
        return q.grad, k.grad, v.grad

    def jacfwd_route(q, k, v, out, lse, d_out, scale):  # the cold review's route 09-b: forward-mode AD
        def block(q, k, v):
            p = (q @ k.transpose(-2, -1) * scale - lse[..., None]).exp()
            delta = (d_out * out).sum(-1, keepdim=True)
            return (d_out * (p @ v)).sum() - (delta * p.sum(-1, keepdim=True)).sum()
        return torch.func.jacfwd(block, argnums=(0, 1, 2))(q, k, v)

    def dual_numbers(q, k, v, out, lse, d_out, scale):  # forward-mode AD one basis direction at a time
        import torch.autograd.forward_ad as fwAD
        grads = []
        for which, x in enumerate((q, k, v)):
            g = torch.zeros_like(x).reshape(-1)
            for i in range(g.numel()):
                tangent = torch.zeros_like(x).reshape(-1)
                tangent[i] = 1.0
                with fwAD.dual_level():
                    args = [q, k, v]
                    args[which] = fwAD.make_dual(x, tangent.view_as(x))
                    p = (args[0] @ args[1].transpose(-2, -1) * scale - lse[..., None]).exp()
                    loss = (d_out * (p @ args[2])).sum() - ((d_out * out).sum(-1, keepdim=True) * p.sum(-1, keepdim=True)).sum()
                    g[i] = fwAD.unpack_dual(loss).tangent
                break  # one direction is enough to meet the guard
            grads.append(g.view_as(x))
        return tuple(grads)

    for route in (private_backward, func_vjp, autograd_functional, backward_method, jacfwd_route, dual_numbers):
        msg = refused("09-tile-backward", route, tmp_path, monkeypatch)[0]
        assert "called" in msg, (route.__name__, msg)


def engine_backward(q, k, v, out, lse, d_out, scale):  # review 6 (b09b.py): autograd's engine called directly
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    with torch.enable_grad():
        p = (q @ k.transpose(-2, -1) * scale - lse[..., None]).exp()
        delta = (d_out * out).sum(-1, keepdim=True)
        loss = (d_out * (p @ v)).sum() - (delta * p.sum(-1, keepdim=True)).sum()
    return torch.autograd.Variable._execution_engine.run_backward(
        (loss,), (torch.ones_like(loss),), False, False, (q, k, v), False)


def test_tile_backward_autograd_engine_refused(tmp_path, monkeypatch):
    case = checks.get("09-tile-backward").make_cases()[0]
    for got, want in zip(engine_backward(*case.args), case.expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    msg = refused("09-tile-backward", engine_backward, tmp_path, monkeypatch)[0]
    assert "called" in msg, msg


def node_walk_backward(q, k, v, out, lse, d_out, scale):  # review 10b (routes9.py): autograd's nodes called by hand
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    with torch.enable_grad():
        p = (q @ k.transpose(-2, -1) * scale - lse[..., None]).exp()
        loss = (d_out * (p @ v)).sum() - ((d_out * out).sum(-1, keepdim=True) * p.sum(-1, keepdim=True)).sum()
    order, seen = [], set()

    def visit(node):
        if node is not None and node not in seen:
            seen.add(node)
            for nxt, _ in node.next_functions:
                visit(nxt)
            order.append(node)
    visit(loss.grad_fn)
    grads, leaves = {loss.grad_fn: torch.ones_like(loss)}, {}
    for node in reversed(order):
        if node not in grads:
            continue
        if type(node).__name__ == "AccumulateGrad":
            leaves[id(node.variable)] = grads[node]
            continue
        outs = node(grads[node])
        for (nxt, _), g in zip(node.next_functions, outs if isinstance(outs, tuple) else (outs,)):
            if nxt is not None and g is not None:
                grads[nxt] = grads[nxt] + g if nxt in grads else g
    return tuple(leaves[id(x)] for x in (q, k, v))


def test_tile_backward_graph_nodes_called_by_hand_refused(tmp_path, monkeypatch):
    case = checks.get("09-tile-backward").make_cases()[0]
    for got, want in zip(node_walk_backward(*case.args), case.expected):  # the route is right: only the guard stops it
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    msg, graded = refused("09-tile-backward", node_walk_backward, tmp_path, monkeypatch)
    assert "grad_fn" in msg and "grad_fn" in graded, (msg, graded)


def _surrogate(q, k, v, out, lse, d_out, scale):
    p = torch.exp(q @ k.transpose(-2, -1) * scale - lse[..., None])
    return (d_out * (p @ v)).sum(-1).sum(-1) - ((d_out * out).sum(-1, keepdim=True) * p).sum(-1).sum(-1)


def finite_differences(q, k, v, out, lse, d_out, scale, eps=1e-6):  # review 9 (t8.py): passed the check cell
    grads = []
    for which, x in enumerate((q, k, v)):
        g = torch.zeros(x.numel(), dtype=x.dtype)
        for i in range(x.numel()):
            step = torch.zeros(x.numel(), dtype=x.dtype)
            step[i] = eps
            args = [q, k, v]
            args[which] = x + step.view_as(x)
            up = _surrogate(*args, out, lse, d_out, scale).sum()
            args[which] = x - step.view_as(x)
            g[i] = (up - _surrogate(*args, out, lse, d_out, scale).sum()) / (2 * eps)
        grads.append(g.view_as(x))
    return tuple(grads)


def stacked_finite_differences(q, k, v, out, lse, d_out, scale, eps=1e-6):  # every perturbation in one tensor
    grads = []
    for which, x in enumerate((q, k, v)):
        steps = (torch.eye(x.numel(), dtype=x.dtype) * eps).view(x.numel(), *x.shape)  # (n, *x.shape)
        args = [q.expand(x.numel(), *q.shape), k.expand(x.numel(), *k.shape), v.expand(x.numel(), *v.shape)]
        up, down = list(args), list(args)
        up[which], down[which] = args[which] + steps, args[which] - steps
        diff = _surrogate(*up, out, lse, d_out, scale) - _surrogate(*down, out, lse, d_out, scale)
        grads.append((diff.reshape(x.numel(), -1).sum(-1) / (2 * eps)).view_as(x))
    return tuple(grads)


def test_tile_backward_finite_differences_refused_in_check_and_grader(tmp_path, monkeypatch):
    case = checks.get("09-tile-backward").make_cases()[1]
    for route in (finite_differences, stacked_finite_differences):
        for got, want in zip(route(*case.args), case.expected):  # right to 1e-6: only the guard tells them apart
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    msg, graded = refused("09-tile-backward", stacked_finite_differences, tmp_path, monkeypatch)
    assert "chain rule" in msg and "chain rule" in graded, (msg, graded)
    # the loop over entries is judged on one small block (the full cases trace thousands of operators: minutes)
    from attncourse.classroom.checks import Case, evaluate_run
    from attncourse.classroom.checks.ch09 import _no_numeric_differentiation

    ex = checks.get("09-tile-backward")
    q, k, v, out, lse, d_out, scale = case.args
    small = Case("small", (q[:, :3, :4], k[:, :2, :4], v[:, :2, :3], out[:, :3, :3], lse[:, :3], d_out[:, :3, :3],
                           scale))
    assert _no_numeric_differentiation([evaluate_run(ex, as_learner(tile_backward), small)]) is None
    msg = _no_numeric_differentiation([evaluate_run(ex, as_learner(finite_differences), small)])
    assert msg and "chain rule" in msg, msg


# ----------------------------------------------------------------------------- 2. find the bug: the window


def _fold(m, l, acc, s, v_blk):
    """One tile into the running state, safe for rows that have seen no key yet (m = -inf)."""
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    ref = m_new.masked_fill(torch.isinf(m_new), 0.0)
    p, alpha = torch.exp(s - ref), torch.exp(m - ref)
    return m_new, alpha * l + p.sum(-1, keepdim=True), alpha * acc + p @ v_blk


def _tiled(q, k, v, window, block_q, block_k, first_block, fold=_fold):
    t, d = q.shape[-2], q.shape[-1]
    out = torch.empty_like(q)
    for q0 in range(0, t, block_q):
        q1 = min(q0 + block_q, t)
        m = q.new_full((*q.shape[:-2], q1 - q0, 1), -math.inf)
        l, acc = q.new_zeros(*q.shape[:-2], q1 - q0, 1), q.new_zeros(*q.shape[:-2], q1 - q0, v.shape[-1])
        for k0 in range(first_block(q0, window, block_k), q1, block_k):
            k1 = min(k0 + block_k, q1)
            s = q[..., q0:q1, :] @ k[..., k0:k1, :].transpose(-2, -1) / math.sqrt(d)
            rows, cols = torch.arange(q0, q1)[:, None], torch.arange(k0, k1)[None, :]
            s = s.masked_fill((cols > rows) | (cols <= rows - window), -math.inf)
            m, l, acc = fold(m, l, acc, s, v[..., k0:k1, :])
        out[..., q0:q1, :] = acc / l
    return out


def _unsafe_fold(m, l, acc, s, v_blk):  # the exercise's bug: exp(-inf - (-inf)) for a row that saw nothing yet
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    p, alpha = torch.exp(s - m_new), torch.exp(m - m_new)
    return m_new, alpha * l + p.sum(-1, keepdim=True), alpha * acc + p @ v_blk


def windowed(q, k, v, window, block_q, block_k):
    return _tiled(q, k, v, window, block_q, block_k, lambda q0, w, bk: max(q0 - w + 1, 0) // bk * bk)


def buggy(q, k, v, window, block_q, block_k):
    return _tiled(q, k, v, window, block_q, block_k, lambda q0, w, bk: max(q0 - w + 1, 0) // bk * bk, _unsafe_fold)


def dense_masked(q, k, v, window, block_q, block_k):  # the review's route: one update over all keys
    t, d = q.shape[-2], q.shape[-1]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    s = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill((j > i) | (j <= i - window), -math.inf)
    m, l, acc = _fold(q.new_full((*q.shape[:-1], 1), -math.inf), q.new_zeros(*q.shape[:-1], 1), torch.zeros_like(q), s, v)
    return acc / l


def dense_by_query_block(q, k, v, window, block_q, block_k):  # query blocks, but all keys at once per block
    return _tiled(q, k, v, window, block_q, q.shape[-2], lambda q0, w, bk: 0)


def one_block_early(q, k, v, window, block_q, block_k):  # a safe margin: one tile before the band, every time
    return _tiled(q, k, v, window, block_q, block_k, lambda q0, w, bk: max(max(q0 - w + 1, 0) // bk * bk - bk, 0))


def one_query_per_block(q, k, v, window, block_q, block_k):  # the cold review's route 09-a, for this bug: the buggy
    return buggy(q, k, v, window, 1, block_k)                  # loop with blocks of one query, where it is right


def one_key_per_tile(q, k, v, window, block_q, block_k):  # tiles of one key: still the buggy loop
    return windowed(q, k, v, window, block_q, 1)


def copies_keys_first(q, k, v, window, block_q, block_k):  # a copy of all keys, then tiles of the copy
    return windowed(q, k.clone(), v.clone(), window, block_q, block_k)


def by_hand_softmax(q, k, v, window, block_q, block_k):
    t, d = q.shape[-2], q.shape[-1]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    s = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill((j > i) | (j <= i - window), -math.inf)
    return torch.softmax(s, -1) @ v


def window_fixed_by_edit():
    """The given windowed_attention_buggy with the solution's edit, typed in a cell (the edit judge reads it)."""
    from attncourse.classroom.checks.ch09 import BUGGY_WINDOW
    from test_edits import cell_function

    source = (BUGGY_WINDOW.replace("_buggy(", "_fixed(")
              .replace("p = torch.exp(s - m_new)", "ref = m_new.masked_fill(torch.isinf(m_new), 0.0)\n"
                                                  "            p = torch.exp(s - ref)")
              .replace("alpha = torch.exp(m - m_new)", "alpha = torch.exp(m - ref)"))
    return cell_function(source, "windowed_attention_fixed", {"torch": torch, "math": math})


def test_window_bug_right_answer_and_old_id(tmp_path, monkeypatch):
    fixed = window_fixed_by_edit()
    accepted("09-find-the-bug-1", fixed, tmp_path, monkeypatch)
    checks.check("09-window-bug", fixed)  # the earlier id still checks
    msg, graded = refused("09-find-the-bug-1", windowed, tmp_path, monkeypatch)  # right, written afresh
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded
    msg = failure("09-find-the-bug-1", buggy)  # the bug itself fails, on the cases the author did not test
    assert "called" not in msg
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64) for _ in range(3))
    for window, bq, bk in ((1, 1, 8), (5, 1, 8), (40, 8, 8), (100, 16, 4)):  # the author's tests: right there
        torch.testing.assert_close(buggy(q, k, v, window, bq, bk), windowed(q, k, v, window, bq, bk))
    assert torch.isnan(buggy(q, k, v, 8, 8, 8)).any()


def test_window_bug_finite_mask_value_accepted(tmp_path, monkeypatch):
    """The finite-mask fix (review 11): -1e30 on the masking line. A fully masked first tile then gives a finite
    max and finite garbage in (l, acc), which alpha = exp(-1e30 - m) = 0 wipes at the row's first visible key;
    right on every case, fully masked tiles included, so the line it changes is a place for a fix."""
    from attncourse.classroom.checks.ch09 import BUGGY_WINDOW
    from test_edits import cell_function

    line = "(cols <= rows - window), -math.inf)"
    assert BUGGY_WINDOW.count(line) == 1
    source = BUGGY_WINDOW.replace("_buggy(", "_fixed(").replace(line, "(cols <= rows - window), -1e30)")
    fixed = cell_function(source, "windowed_attention_fixed", {"torch": torch, "math": math})
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64) for _ in range(3))
    assert torch.isnan(buggy(q, k, v, 8, 8, 8)).any()  # these sizes have fully masked first tiles
    torch.testing.assert_close(fixed(q, k, v, 8, 8, 8), windowed(q, k, v, 8, 8, 8))
    accepted("09-find-the-bug-1", fixed, tmp_path, monkeypatch)


def test_window_bug_other_block_sizes_refused(tmp_path, monkeypatch):
    for route in (one_query_per_block, one_key_per_tile):
        case = checks.get("09-find-the-bug-1").make_cases()[1]
        torch.testing.assert_close(route(*case.args), case.expected)
        msg, graded = refused("09-find-the-bug-1", route, tmp_path, monkeypatch)
        assert NOT_THE_WAY in msg and NOT_THE_WAY in graded and "grid" in msg, (route.__name__, msg)


@pytest.mark.parametrize("route", [dense_masked, dense_by_query_block, one_block_early, copies_keys_first])
def test_window_bug_routes_that_read_outside_the_band_refused(route, tmp_path, monkeypatch):
    case = checks.get("09-find-the-bug-1").make_cases()[1]
    torch.testing.assert_close(route(*case.args), case.expected)
    msg, graded = refused("09-find-the-bug-1", route, tmp_path, monkeypatch)
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded
    assert not re.search(r"-inf|nan|finite", msg.split("hint")[0])


def test_window_bug_library_routes_refused(tmp_path, monkeypatch):
    from attncourse import flash_attention, scaled_dot_product_attention

    def package(q, k, v, window, bq, bk):
        return flash_attention(q, k, v, is_causal=True, window=window, block_q=bq, block_k=bk)

    def oracle(q, k, v, window, bq, bk):
        t = q.shape[-2]
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        return scaled_dot_product_attention(q, k, v, (j <= i) & (j > i - window))

    def aten_sdpa(q, k, v, window, bq, bk):
        t = q.shape[-2]
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, (j <= i) & (j > i - window))[0]

    def chapter_08_helpers(q, k, v, window, bq, bk):  # the package's safe update in place of the fix
        def fold(m, l, acc, s, v_blk):
            state = online_attention_update(AttentionState(m[..., 0], l[..., 0], acc), s, v_blk)
            return state.m[..., None], state.l[..., None], state.acc
        return _tiled(q, k, v, window, bq, bk, lambda q0, w, b: max(q0 - w + 1, 0) // b * b, fold)

    for route in (package, oracle, aten_sdpa, by_hand_softmax, chapter_08_helpers):
        assert "called" in refused("09-find-the-bug-1", route, tmp_path, monkeypatch)[0], route.__name__


def test_bug_words_stay_out_of_the_exercise_notebook():
    nb = nbformat.read(ROOT / "exercises" / "09_flash_attention.ipynb", as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    ex = checks.get("09-find-the-bug-1")
    assert "09-window-bug" in ex.aliases and "What was wrong" not in text
    for word in ex.bug_words:
        assert not re.search(rf"(?<![A-Za-z0-9]){re.escape(word)}", text, flags=re.IGNORECASE), word


# ----------------------------------------------------------------------------- 3. predict


def test_prediction_verify_cell_waits_for_a_pass():
    nb = nbformat.read(ROOT / "exercises" / "09_flash_attention.ipynb", as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and "hbm_traffic" in cell.source:
            assert cell.source.startswith('if passed("09-predict-hbm")'), i


def hbm_prediction(seq_len, head_dim, block_q, block_k, is_causal, window):
    n, d = seq_len, head_dim
    reads, writes = 2 * n * d, n
    for k0 in range(0, n, block_k):
        rows_k = min(block_k, n - k0)
        reads, writes = reads + 2 * rows_k * d, writes + 2 * rows_k * d
        stop = min(n, k0 + rows_k - 1 + window) if window else n
        for q0 in range(k0 // block_q * block_q if is_causal else 0, stop, block_q):
            rows_q = min(block_q, stop - q0)
            reads, writes = reads + rows_q * (3 * d + 2), writes + rows_q * d
    return reads, writes


def test_backward_count_equals_the_rule_and_extends_in_d():
    from attncourse.classroom.checks.ch09 import _counted_backward, hbm_backward_reference
    from attncourse.flash import flash_attention_backward, flash_attention_forward
    from attncourse.flash_io import TrafficCounter

    for n, d, bq, bk, window in ((37, 4, 8, 16, None), (64, 8, 16, 16, 5), (101, 8, 32, 8, 40), (90, 8, 16, 32, 7)):
        for causal in ((False, True) if window is None else (True,)):
            x, do = torch.randn(1, 1, n, d, dtype=torch.float64), torch.randn(1, 1, n, d, dtype=torch.float64)
            o, lse = flash_attention_forward(x, x, x, is_causal=causal, window=window, block_q=bq, block_k=bk)
            counter = TrafficCounter()
            flash_attention_backward(x, x, x, o, lse, do, is_causal=causal, window=window, block_q=bq, block_k=bk,
                                     traffic=counter)
            counted = (counter.total_reads, counter.total_writes)
            assert counted == hbm_prediction(n, d, bq, bk, causal, window) == _counted_backward(n, d, bq, bk, causal,
                                                                                                 window)
            assert hbm_backward_reference(n, d, bq, bk, causal, window) == counted  # counted at d = 1, 2, extended
    threads = torch.get_num_threads()
    hbm_backward_reference(64, 8, 16, 16, True)
    assert torch.get_num_threads() == threads


def test_prediction_is_a_rule_the_package_cannot_answer(tmp_path, monkeypatch):
    from test_salting import SALT, _grader as salted_grader

    import attncourse.flash_io
    assert not hasattr(attncourse.flash_io, "hbm_traffic_fa2_backward")  # no formula in the package to retype
    accepted("09-predict-hbm", hbm_prediction, tmp_path, monkeypatch)
    ex = checks.get("09-predict-hbm")
    assert salted_grader(ex, hbm_prediction, SALT, tmp_path, monkeypatch)[0] == "passed"

    def checker_reference(seq_len, head_dim, block_q, block_k, is_causal, window):
        from attncourse.classroom.checks.ch09 import hbm_backward_reference
        return hbm_backward_reference(seq_len, head_dim, block_q, block_k, is_causal, window)

    def counted(seq_len, head_dim, block_q, block_k, is_causal, window):  # run the instrumented loop, read its count
        from attncourse.flash import flash_attention_backward, flash_attention_forward
        from attncourse.flash_io import TrafficCounter
        x = torch.zeros(1, 1, seq_len, head_dim)
        o, lse = flash_attention_forward(x, x, x, is_causal=is_causal, window=window, block_q=block_q,
                                         block_k=block_k)
        c = TrafficCounter()
        flash_attention_backward(x, x, x, o, lse, x, is_causal=is_causal, window=window, block_q=block_q,
                                 block_k=block_k, traffic=c)
        return c.total_reads, c.total_writes

    for route in (checker_reference, counted):
        msg = refused("09-predict-hbm", route, tmp_path, monkeypatch)[0]
        assert "called" in msg or "ran" in msg, (route.__name__, msg)

    printed = hbm_prediction(4096, 128, 128, 64, True, None)

    def typed(seq_len, head_dim, block_q, block_k, is_causal, window):  # the exercise's configuration, typed in
        return printed

    def floor_blocks(seq_len, head_dim, block_q, block_k, is_causal, window):  # a partial last block forgotten
        n, d = seq_len, head_dim
        t_c = n // block_k
        return 2 * n * d + 2 * n * d + t_c * n * (3 * d + 2), n + 2 * n * d + t_c * n * d

    def no_skip(seq_len, head_dim, block_q, block_k, is_causal, window):  # the causal mask ignored
        return hbm_prediction(seq_len, head_dim, block_q, block_k, False, None)

    def no_window(seq_len, head_dim, block_q, block_k, is_causal, window):  # the window's early stop ignored
        return hbm_prediction(seq_len, head_dim, block_q, block_k, is_causal, None)

    def window_on_the_grid(seq_len, head_dim, block_q, block_k, is_causal, window):  # whole last query block
        if window:
            window = -(-(block_k + window - 1) // block_q) * block_q + block_q
        return hbm_prediction(seq_len, head_dim, block_q, block_k, is_causal, window)

    def skip_by_key_grid(seq_len, head_dim, block_q, block_k, is_causal, window):  # the first query row, not its block
        n, d = seq_len, head_dim
        reads, writes = 2 * n * d, n
        for k0 in range(0, n, block_k):
            rows_k = min(block_k, n - k0)
            reads, writes = reads + 2 * rows_k * d, writes + 2 * rows_k * d
            stop = min(n, k0 + rows_k - 1 + window) if window else n
            rows = stop - k0 if is_causal else n
            reads, writes = reads + rows * (3 * d + 2), writes + rows * d
        return reads, writes

    def forward_only(seq_len, head_dim, block_q, block_k, is_causal, window):  # the forward's model, recalled
        n, d = seq_len, head_dim
        return n * d + -(-n // block_q) * 2 * n * d, n * d + n

    for wrong in (typed, floor_blocks, no_skip, no_window, window_on_the_grid, skip_by_key_grid, forward_only):
        msg = failure("09-predict-hbm", wrong)
        assert "prediction is not right" in msg and f"{printed[0]}" not in msg and f"{printed[0]:,}" not in msg


# ----------------------------------------------------------------------------- 4. experiment


def _bf16_measured(q, k, v, *, round_once=True, library_for_bf16=False):
    t, d = q.shape[-2], q.shape[-1]
    from attncourse.flash import flash_attention
    from attncourse.sdpa import scaled_dot_product_attention as sdpa
    exact = sdpa(q.double(), k.double(), v.double(), is_causal=True)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)

    def formula(q, k, v):
        return torch.softmax((q @ k.mT / math.sqrt(d)).masked_fill(future, -math.inf), dim=-1) @ v

    same = formula(q.float(), k.float(), v.float())
    same = same.to(torch.bfloat16) if round_once else same
    bf16 = sdpa(q, k, v, is_causal=True) if library_for_bf16 else formula(q, k, v)
    outs = (flash_attention(q, k, v, is_causal=True), same, bf16)
    return tuple(float((o.double() - exact).abs().max()) for o in outs)


def test_bf16_error_reference_constants_and_confounds_refused(tmp_path, monkeypatch):
    from attncourse.classroom.checks.ch09 import bf16_errors

    accepted("09-bf16-error", _bf16_measured, tmp_path, monkeypatch)
    assert "called" in failure("09-bf16-error", bf16_errors)
    cases = checks.get("09-bf16-error").make_cases()
    mean = [sum(c.expected[0][i] for c in cases) / len(cases) for i in range(3)]
    failure("09-bf16-error", lambda q, k, v: tuple(mean))  # constants read off the reference
    by_len = {c.args[0].shape[-2]: c.expected[0] for c in cases}
    failure("09-bf16-error", lambda q, k, v: by_len[q.shape[-2]])  # one constant triple per length
    # the untiled method kept in float32 (not rounded like the kernel's output): not the same precision
    failure("09-bf16-error", lambda q, k, v: _bf16_measured(q, k, v, round_once=False))
    # a library attention for the all-bfloat16 method: it computes in float32 inside
    failure("09-bf16-error", lambda q, k, v: _bf16_measured(q, k, v, library_for_bf16=True))
    # the untiled formula in float32 for the third method too: not bfloat16 at every step
    failure("09-bf16-error", lambda q, k, v: _bf16_measured(q, k, v)[:2] + _bf16_measured(q, k, v)[1:2])


def _all_bf16(q, k, v, spelling):
    """Three ways to keep every operation's result in bfloat16 (review 9 found them refused by a float32 softmax)."""
    t, d = q.shape[-2], q.shape[-1]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    if spelling == "scale on q":
        s = ((q * (1 / math.sqrt(d))) @ k.mT).masked_fill(future, -math.inf)
        p = torch.softmax(s, -1)
        return p @ v
    s = (q @ k.mT / math.sqrt(d)).masked_fill(future, -math.inf)
    e = torch.exp(s - s.amax(-1, keepdim=True))  # bfloat16
    if spelling == "written out":
        return (e / e.sum(-1, keepdim=True)) @ v
    return (e @ v) / e.sum(-1, keepdim=True)  # normalised after P V


@pytest.mark.parametrize("spelling", ["scale on q", "written out", "normalised after PV"])
def test_bf16_error_accepts_every_all_bf16_spelling(spelling, tmp_path, monkeypatch):
    from attncourse.flash import flash_attention
    from attncourse.sdpa import scaled_dot_product_attention as sdpa

    def measured(q, k, v):
        exact = sdpa(q.double(), k.double(), v.double(), is_causal=True)
        first_two = _bf16_measured(q, k, v)[:2]
        return first_two + (float((_all_bf16(q, k, v, spelling).double() - exact).abs().max()),)

    accepted("09-bf16-error", measured, tmp_path, monkeypatch)


def test_bf16_reference_rounds_every_step():
    from attncourse.classroom.checks.ch09 import _bf16_formula

    gen = torch.Generator().manual_seed(3)
    q, k, v = ((2 * torch.randn(1, 1, 64, 32, generator=gen)).to(torch.bfloat16) for _ in range(3))
    written = _bf16_formula(q, k, v)
    upcast = _bf16_formula(q.float(), k.float(), v.float(), normalise="torch").to(torch.bfloat16)
    assert written.dtype == torch.bfloat16 and not torch.equal(written, upcast)  # not float32 rounded once


# ----------------------------------------------------------------------------- 5. the tiled forward, keys outside


def tiled_forward_keys_outside(q, k, v, block_q, block_k, is_causal):
    # q, k (..., T, D); v (..., T, Dv); returns out (..., T, Dv) and lse (..., T); key tiles in the outer loop
    t, d = q.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(d)
    m = q.new_full((*q.shape[:-1], 1), -math.inf)          # (..., T, 1): every row's running max, kept "in HBM"
    l = q.new_zeros(*q.shape[:-1], 1)                      # (..., T, 1): running sums relative to m  # noqa: E741
    acc = q.new_zeros(*q.shape[:-1], v.shape[-1])          # (..., T, Dv): unnormalised outputs relative to m
    for k0 in range(0, t, block_k):                        # each key tile once
        k1 = min(k0 + block_k, t)
        k_j, v_j = k[..., k0:k1, :], v[..., k0:k1, :]      # (..., Bk, D), (..., Bk, Dv)
        first = k0 // block_q * block_q if is_causal else 0   # query blocks before it see none of these keys
        for q0 in range(first, t, block_q):
            q1 = min(q0 + block_q, t)
            s = q[..., q0:q1, :] @ k_j.transpose(-2, -1) * scale   # (..., Bq, Bk)
            if is_causal and k1 - 1 > q0:                  # the tile crosses the diagonal
                s = s.masked_fill(torch.arange(k0, k1)[None, :] > torch.arange(q0, q1)[:, None], -math.inf)
            m_old = m[..., q0:q1, :]                       # this block's state, read back
            m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))   # finite: tile 0 came first for every row
            p, alpha = torch.exp(s - m_new), torch.exp(m_old - m_new)
            l[..., q0:q1, :] = alpha * l[..., q0:q1, :] + p.sum(-1, keepdim=True)   # written back
            acc[..., q0:q1, :] = alpha * acc[..., q0:q1, :] + p @ v_j
            m[..., q0:q1, :] = m_new
    return acc / l, (m + l.log())[..., 0]


def dense_forward(q, k, v, block_q, block_k, is_causal):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., T, T)
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    return (p @ v) / p.sum(-1, keepdim=True), (m + p.sum(-1, keepdim=True).log())[..., 0]


def keys_outside_no_skip(q, k, v, block_q, block_k, is_causal):
    """Keys outside, right values, but every query block met by every key tile (masked, not skipped)."""
    t, d = q.shape[-2], q.shape[-1]
    m = q.new_full((*q.shape[:-1], 1), -math.inf)
    l, acc = q.new_zeros(*q.shape[:-1], 1), q.new_zeros(*q.shape[:-1], v.shape[-1])  # noqa: E741
    for k0 in range(0, t, block_k):
        k1 = min(k0 + block_k, t)
        for q0 in range(0, t, block_q):
            q1 = min(q0 + block_q, t)
            s = q[..., q0:q1, :] @ k[..., k0:k1, :].transpose(-2, -1) / math.sqrt(d)
            if is_causal:
                s = s.masked_fill(torch.arange(k0, k1)[None, :] > torch.arange(q0, q1)[:, None], -math.inf)
            m_old = m[..., q0:q1, :]
            m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p, alpha = torch.exp(s - safe), torch.exp(m_old - safe)
            l[..., q0:q1, :] = alpha * l[..., q0:q1, :] + p.sum(-1, keepdim=True)
            acc[..., q0:q1, :] = alpha * acc[..., q0:q1, :] + p @ v[..., k0:k1, :]
            m[..., q0:q1, :] = m_new
    return acc / l, (m + l.log())[..., 0]


def keys_outside_flat_statistics(q, k, v, block_q, block_k, is_causal):
    """The same algorithm with each row's max and sum kept as (..., T) and a block's as (..., B_q), no keepdim, and
    the lse taken over all T rows at the end (review 8: refused as "wider than any tile" before)."""
    t, d = q.shape[-2], q.shape[-1]
    m = q.new_full(q.shape[:-1], -math.inf)                # (..., T)
    l, acc = q.new_zeros(q.shape[:-1]), q.new_zeros(*q.shape[:-1], v.shape[-1])  # noqa: E741
    for k0 in range(0, t, block_k):
        k1 = min(k0 + block_k, t)
        for q0 in range(k0 // block_q * block_q if is_causal else 0, t, block_q):
            q1 = min(q0 + block_q, t)
            s = q[..., q0:q1, :] @ k[..., k0:k1, :].transpose(-2, -1) / math.sqrt(d)   # (..., Bq, Bk)
            if is_causal and k1 - 1 > q0:
                s = s.masked_fill(torch.arange(k0, k1)[None, :] > torch.arange(q0, q1)[:, None], -math.inf)
            m_old = m[..., q0:q1]                          # (..., Bq)
            m_new = torch.maximum(m_old, s.amax(-1))
            p, alpha = torch.exp(s - m_new[..., None]), torch.exp(m_old - m_new)
            l[..., q0:q1] = alpha * l[..., q0:q1] + p.sum(-1)
            acc[..., q0:q1, :] = alpha[..., None] * acc[..., q0:q1, :] + p @ v[..., k0:k1, :]
            m[..., q0:q1] = m_new
    return acc / l[..., None], m + torch.log(l)


def test_tiled_forward_right_answer_and_other_routes_refused(tmp_path, monkeypatch):
    accepted("09-tiled-forward", keys_outside_flat_statistics, tmp_path, monkeypatch)
    accepted("09-tiled-forward", tiled_forward_keys_outside, tmp_path, monkeypatch)
    case = checks.get("09-tiled-forward").make_cases()[1]  # causal, Dv != D
    for route, word in ((dense_forward, "wider than any tile"), (keys_outside_no_skip, "skip that block")):
        torch.testing.assert_close(route(*case.args), case.expected)
        msg, graded = refused("09-tiled-forward", route, tmp_path, monkeypatch)
        assert NOT_THE_WAY in msg and NOT_THE_WAY in graded and word in msg, (route.__name__, msg)


# ----------------------------------------------------------------------------- 4b. the study, graded


def bf16_three(q, k, v):
    from attncourse import flash_attention, scaled_dot_product_attention
    t, d = q.shape[-2], q.shape[-1]
    exact = scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)

    def formula(q, k, v):
        return torch.softmax((q @ k.mT / math.sqrt(d)).masked_fill(future, -math.inf), dim=-1) @ v

    outs = (flash_attention(q, k, v, is_causal=True), formula(q.float(), k.float(), v.float()).to(torch.bfloat16),
            formula(q, k, v))
    return tuple(float((o.double() - exact).abs().max()) for o in outs)


def study_of(draws):
    e = torch.tensor(draws, dtype=torch.float64)
    a, b = e[..., 0] / e[..., 1], e[..., 2] / e[..., 1]
    return e, (float(a.min()), float(a.max())), (float(b.min()), float(b.max()))


def bf16_study(seeds, shapes):
    rows = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        rows.append([bf16_three(*((s * torch.randn(1, 2, t, 32, generator=gen)).to(torch.bfloat16) for _ in range(3)))
                     for t, s in shapes])
    return study_of(rows)


def one_generator_per_draw(seeds, shapes):
    rows = []
    for seed in seeds:
        row = []
        for t, s in shapes:
            gen = torch.Generator().manual_seed(seed)  # the same generator restarted for every shape
            row.append(bf16_three(*((s * torch.randn(1, 2, t, 32, generator=gen)).to(torch.bfloat16) for _ in range(3))))
        rows.append(row)
    return study_of(rows)


def test_bf16_study_judges_the_measurement(tmp_path, monkeypatch):
    from attncourse.classroom.checks.ch09_tiled import bf16_study_reference

    accepted("09-bf16-study", bf16_study, tmp_path, monkeypatch)
    typed = bf16_study_reference((0, 1, 2), ((64, 1.0), (300, 2.0)))  # one design's numbers, typed in
    msg, graded = refused("09-bf16-study", lambda seeds, shapes: typed, tmp_path, monkeypatch)
    assert "shape" in msg and "called" not in msg
    msg, graded = refused("09-bf16-study", one_generator_per_draw, tmp_path, monkeypatch)
    assert "draw the inputs exactly" in msg, msg
