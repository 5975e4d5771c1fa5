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


@pytest.mark.parametrize("ex", [e for e in checks.exercises_for("09") if e.shortcuts or e.breakers], ids=lambda e: e.id)
def test_shortcuts_and_breakers_refused_by_check_and_grader(ex, tmp_path, monkeypatch):
    for shortcut in ex.shortcuts:
        msg, graded = refused(ex.id, shortcut, tmp_path, monkeypatch)
        assert "called" in msg and "called" in graded, (shortcut.__name__, msg)
    for breaker in ex.breakers:
        msg, graded = refused(ex.id, breaker, tmp_path, monkeypatch)
        assert NOT_THE_WAY in msg and NOT_THE_WAY in graded, (breaker.__name__, msg)


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

    for route in (private_backward, func_vjp, autograd_functional, backward_method):
        msg = refused("09-tile-backward", route, tmp_path, monkeypatch)[0]
        assert "called" in msg, (route.__name__, msg)


# ----------------------------------------------------------------------------- 2. find the bug: the window


def windowed(q, k, v, window, block_q, block_k):
    t, d = q.shape[-2], q.shape[-1]
    out = torch.empty_like(q)
    for q0 in range(0, t, block_q):
        q1 = min(q0 + block_q, t)
        k_lo = max(q0 - window + 1, 0) // block_k * block_k
        m0 = q.new_full((*q.shape[:-2], q1 - q0), -math.inf)
        state = AttentionState(m0, torch.zeros_like(m0), q.new_zeros(*m0.shape, v.shape[-1]))
        for k0 in range(k_lo, q1, block_k):
            k1 = min(k0 + block_k, q1)
            s = q[..., q0:q1, :] @ k[..., k0:k1, :].transpose(-2, -1) / math.sqrt(d)
            rows, cols = torch.arange(q0, q1)[:, None], torch.arange(k0, k1)[None, :]
            s = s.masked_fill((cols > rows) | (cols <= rows - window), -math.inf)
            state = online_attention_update(state, s, v[..., k0:k1, :])
        out[..., q0:q1, :] = finalize_attention_state(state)[0]
    return out


def dense_masked(q, k, v, window, block_q, block_k):  # the review's route: one update over all keys
    t, d = q.shape[-2], q.shape[-1]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    s = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill((j > i) | (j <= i - window), -math.inf)
    m0 = q.new_full(q.shape[:-1], -math.inf)
    return finalize_attention_state(online_attention_update(AttentionState(m0, torch.zeros_like(m0),
                                                                           torch.zeros_like(q)), s, v))[0]


def dense_by_query_block(q, k, v, window, block_q, block_k):  # query blocks, but all keys at once per block
    t, d = q.shape[-2], q.shape[-1]
    out = torch.empty_like(q)
    for q0 in range(0, t, block_q):
        q1 = min(q0 + block_q, t)
        i, j = torch.arange(q0, q1)[:, None], torch.arange(t)[None, :]
        s = (q[..., q0:q1, :] @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill((j > i) | (j <= i - window), -math.inf)
        m0 = q.new_full((*q.shape[:-2], q1 - q0), -math.inf)
        state = online_attention_update(AttentionState(m0, torch.zeros_like(m0), q.new_zeros(*m0.shape, v.shape[-1])),
                                        s, v)
        out[..., q0:q1, :] = finalize_attention_state(state)[0]
    return out


def one_block_early(q, k, v, window, block_q, block_k):  # a safe margin: one tile before the band, every time
    t, d = q.shape[-2], q.shape[-1]
    out = torch.empty_like(q)
    for q0 in range(0, t, block_q):
        q1 = min(q0 + block_q, t)
        k_lo = max(max(q0 - window + 1, 0) // block_k * block_k - block_k, 0)
        m0 = q.new_full((*q.shape[:-2], q1 - q0), -math.inf)
        state = AttentionState(m0, torch.zeros_like(m0), q.new_zeros(*m0.shape, v.shape[-1]))
        for k0 in range(k_lo, q1, block_k):
            k1 = min(k0 + block_k, q1)
            s = q[..., q0:q1, :] @ k[..., k0:k1, :].transpose(-2, -1) / math.sqrt(d)
            rows, cols = torch.arange(q0, q1)[:, None], torch.arange(k0, k1)[None, :]
            s = s.masked_fill((cols > rows) | (cols <= rows - window), -math.inf)
            state = online_attention_update(state, s, v[..., k0:k1, :])
        out[..., q0:q1, :] = finalize_attention_state(state)[0]
    return out


def copies_keys_first(q, k, v, window, block_q, block_k):  # a copy of all keys, then tiles of the copy
    return windowed(q, k.clone(), v.clone(), window, block_q, block_k)


def by_hand_softmax(q, k, v, window, block_q, block_k):
    t, d = q.shape[-2], q.shape[-1]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    s = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill((j > i) | (j <= i - window), -math.inf)
    return torch.softmax(s, -1) @ v


def test_window_bug_right_answer_and_old_id(tmp_path, monkeypatch):
    accepted("09-find-the-bug-1", windowed, tmp_path, monkeypatch)
    checks.check("09-window-bug", windowed)  # the earlier id still checks


@pytest.mark.parametrize("route", [dense_masked, dense_by_query_block, one_block_early, copies_keys_first])
def test_window_bug_routes_that_read_outside_the_band_refused(route, tmp_path, monkeypatch):
    case = checks.get("09-find-the-bug-1").make_cases()[1]
    torch.testing.assert_close(route(*case.args), case.expected)
    msg, graded = refused("09-find-the-bug-1", route, tmp_path, monkeypatch)
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded
    assert not re.search(r"round|floor|ceil", msg.split("hint")[0])


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

    for route in (package, oracle, aten_sdpa, by_hand_softmax):
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


# ----------------------------------------------------------------------------- 4. experiment


def test_bf16_error_reference_and_constants_refused():
    from attncourse.classroom.checks.ch09 import bf16_errors

    assert "called" in failure("09-bf16-error", bf16_errors)
    cases = checks.get("09-bf16-error").make_cases()
    mean = [sum(c.expected[i] for c in cases) / len(cases) for i in (0, 1)]
    failure("09-bf16-error", lambda seed, t: tuple(mean))  # constants read off the reference
    per_len = {t: [c.expected for c in cases if c.args[1] == t] for t in (64, 300)}
    table = {t: tuple(sum(e[i] for e in v) / len(v) for i in (0, 1)) for t, v in per_len.items()}
    failure("09-bf16-error", lambda seed, t: table[t])  # one constant pair per length
