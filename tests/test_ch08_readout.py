"""Chapter 08's small-input exercises: a plain-Python detour (read the inputs out with tolist, loop in Python) must
exceed the guard's read-out budget on at least one case, so the check refuses it (lead note, issue 23)."""

from __future__ import annotations

import math

import torch

from attncourse.classroom import checks
from attncourse.classroom.checks import forbidden
from exercise_routes import accepted, refused


def _largest_inputs(exercise_id):
    return max(forbidden._entries(list(case.args)) for case in checks.get(exercise_id).make_cases())


def merge_many_in_python(m_all, l_all):
    """The right merge, computed in plain Python from the inputs read out as lists."""
    k, r = m_all.shape
    m_rows, l_rows = m_all.tolist(), l_all.tolist()
    ms, ls = [], []
    for j in range(r):
        m = max(m_rows[i][j] for i in range(k))
        ref = 0.0 if m == -math.inf else m
        ms.append(m)
        ls.append(sum(math.exp(m_rows[i][j] - ref) * l_rows[i][j] for i in range(k)))
    return torch.tensor(ms, dtype=m_all.dtype), torch.tensor(ls, dtype=l_all.dtype)


def merge_many(m_all, l_all):
    m = m_all.amax(dim=0)
    shift = m.masked_fill(torch.isneginf(m), 0.0)
    return m, (torch.exp(m_all - shift) * l_all).sum(dim=0)


def test_merge_many_python_detour_refused(tmp_path, monkeypatch):
    assert _largest_inputs("08-merge-many") > 4 * forbidden.SCALAR_FLOOR   # reading it all out exceeds the budget
    accepted("08-merge-many", merge_many, tmp_path, monkeypatch)
    msg, graded = refused("08-merge-many", merge_many_in_python, tmp_path, monkeypatch)
    assert "tolist" in msg or "read" in msg or "Python" in msg, msg


PYTHON_MERGE = """\
def merge_partial_fixed(m_a, l_a, acc_a, m_b, l_b, acc_b):
    # the right merge, in plain Python on every input read out as lists
    import math
    ms_a, ls_a, ms_b, ls_b = (t.reshape(-1).tolist() for t in (m_a, l_a, m_b, l_b))
    accs_a, accs_b = (t.reshape(-1, t.shape[-1]).tolist() for t in (acc_a, acc_b))
    out_m, out_l, out_acc = [], [], []
    for ma, la, xa, mb, lb, xb in zip(ms_a, ls_a, accs_a, ms_b, ls_b, accs_b):
        m = max(ma, mb)
        ref = 0.0 if m == -math.inf else m
        wa, wb = math.exp(ma - ref), math.exp(mb - ref)
        out_m.append(m)
        out_l.append(wa * la + wb * lb)
        out_acc.append([wa * p + wb * q for p, q in zip(xa, xb)])
    return (torch.tensor(out_m, dtype=m_a.dtype).reshape(m_a.shape),
            torch.tensor(out_l, dtype=l_a.dtype).reshape(l_a.shape),
            torch.tensor(out_acc, dtype=acc_a.dtype).reshape(acc_a.shape))
"""


def test_merge_bug_inputs_exceed_the_read_out_floor():
    assert _largest_inputs("08-find-the-bug-1") > 4 * forbidden.SCALAR_FLOOR


def test_merge_bug_python_detour_refused(tmp_path, monkeypatch):
    from test_ch08_checks import merge_fixed
    from test_edits import cell_function

    accepted("08-find-the-bug-1", merge_fixed, tmp_path, monkeypatch)
    detour = cell_function(PYTHON_MERGE, "merge_partial_fixed", {"torch": torch})
    msg, _ = refused("08-find-the-bug-1", detour, tmp_path, monkeypatch)
    assert "read out" in msg, msg       # the guard's read-out budget refuses it, before the edit is judged
