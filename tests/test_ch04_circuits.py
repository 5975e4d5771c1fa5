"""Chapter 04, exercise 7 (04-head-circuits): the check judges the head algebra by structure. A right answer passes
the check cell and the grader; an answer that orthonormalises the whole matrices (ignoring which rows are whose
head), one that forgets to move R into W^O, and the given weights unchanged all fail; reading the circuits off the
course's module is refused as a call; the reference circuits are the layer's function."""

from __future__ import annotations

import pytest
import torch

from attncourse import MultiHeadAttention
from attncourse.classroom import checks
from attncourse.classroom.checks import ch04_circuits
from test_ch04_checks import graded, refused


def orthonormal_heads(w_q, w_k, w_v, w_o, n_heads):
    d = w_q.shape[0]
    dh = d // n_heads
    out = [w.clone() for w in (w_q, w_k, w_v, w_o)]
    for h in range(n_heads):
        r = slice(h * dh, (h + 1) * dh)
        u, s, vh = torch.linalg.svd(w_k[r].T, full_matrices=False)       # another factorisation than the solution's
        out[1][r], out[0][r] = (u @ vh).T, (vh.T * s) @ vh @ w_q[r]       # polar: w_k[r].T = (u vh)(vh.T s vh)
        basis, tri = torch.linalg.qr(w_v[r].T)
        out[2][r], out[3][:, r] = basis.T, w_o[:, r] @ tri.T
    return tuple(out)


def whole_matrices(w_q, w_k, w_v, w_o, n_heads):
    bk, rk = torch.linalg.qr(w_k.T)
    bv, rv = torch.linalg.qr(w_v.T)
    return rk @ w_q, bk.T, bv.T, w_o @ rv.T


def values_only_moved(w_q, w_k, w_v, w_o, n_heads):
    out = list(orthonormal_heads(w_q, w_k, w_v, w_o, n_heads))
    out[3] = w_o.clone()
    return tuple(out)


def unchanged(w_q, w_k, w_v, w_o, n_heads):
    return w_q.clone(), w_k.clone(), w_v.clone(), w_o.clone()


def test_right_answer_passes(tmp_path, monkeypatch):
    checks.check("04-head-circuits", orthonormal_heads)
    assert graded("04-head-circuits", orthonormal_heads, tmp_path, monkeypatch) == "passed"


@pytest.mark.parametrize("wrong", [whole_matrices, values_only_moved, unchanged])
def test_wrong_algebra_fails(wrong, tmp_path, monkeypatch):
    msg = refused("04-head-circuits", wrong, tmp_path, monkeypatch, called=False)
    assert "circuit" in msg or "orthonormal" in msg


def test_reading_the_module_is_refused(tmp_path, monkeypatch):
    refused("04-head-circuits", ch04_circuits._orthonormal_by_module, tmp_path, monkeypatch)


def test_circuits_are_the_layers_function():
    torch.manual_seed(0)
    m = MultiHeadAttention(12, 3).double()
    x, c = torch.randn(2, 4, 12, dtype=torch.float64), torch.randn(2, 5, 12, dtype=torch.float64)
    ws = [p.weight.detach() for p in (m.q_proj, m.k_proj, m.v_proj, m.o_proj)]
    qk, ov = ch04_circuits.circuits(*ws, 3)
    out = sum(torch.softmax(x @ qk[h] @ c.mT / 2.0, -1) @ c @ ov[h] for h in range(3))   # sqrt(D) = 2
    with torch.no_grad():
        torch.testing.assert_close(out, m(x, c))
