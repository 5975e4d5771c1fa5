"""Chapter 13's checks refuse what a learner could hand in without the skill, by the check cell and by the grader;
the right answers pass."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attncourse.classroom import checks
from attncourse.classroom.checks.ch13 import boundary_states
from exercise_routes import NOT_THE_WAY, accepted, as_learner, failure, refused  # noqa: E402

_boundary_states = as_learner(boundary_states)  # the checks module's state loop, as if typed in a cell


# The breakers (right outputs computed the wrong way) are run by check and grader for every chapter in
# test_exercise_standard.test_properties_refuse_their_breakers; here the shortcuts of every category.
@pytest.mark.parametrize("ex", [e for e in checks.exercises_for("13") if e.shortcuts], ids=lambda e: e.id)
def test_shortcuts_refused_by_check_and_grader(ex, tmp_path, monkeypatch):
    for shortcut in ex.shortcuts:
        msg, graded = refused(ex.id, shortcut, tmp_path, monkeypatch)
        assert "called" in msg and "called" in graded, (shortcut.__name__, msg)


# ----------------------------------------------------------------------------- 1. chunkwise decayed linear attention


def chunked_decay_attention(q, k, v, g, initial_state, chunk_size):
    T = q.shape[2]
    S = initial_state
    outs, states = [], [S]
    for a in range(0, T, chunk_size):
        qc, kc, vc = q[:, :, a:a + chunk_size], k[:, :, a:a + chunk_size], v[:, :, a:a + chunk_size]
        G = g[:, :, a:a + chunk_size].cumsum(-2)  # (B,H,c,Dk): one log-decay per key channel
        c = G.shape[-2]
        keep = torch.ones(c, c, dtype=torch.bool).tril()[..., None]
        diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~keep, -torch.inf)  # (B,H,c,c,Dk)
        outs.append((qc * G.exp()) @ S + torch.einsum("bhrd,bhsd,bhrsd->bhrs", qc, kc, diff.exp()) @ vc)
        S = S * G[..., -1, :, None].exp() + (kc * (G[..., -1:, :] - G).exp()).transpose(-2, -1) @ vc
        states.append(S)
    return torch.cat(outs, 2), torch.stack(states, 2)


def chunks_at_once(q, k, v, g, initial_state, chunk_size):
    """Every chunk in one batched step, the states combined by an (n, n) decay tensor per key channel: chunkwise, no
    Python loop."""
    B, H, T, Dk = q.shape
    n = -(-T // chunk_size)
    pad = n * chunk_size - T
    q, k, v, g = (F.pad(x, (0, 0, 0, pad)).reshape(B, H, n, chunk_size, -1) for x in (q, k, v, g))
    G = g.cumsum(-2)  # (B,H,n,C,Dk)
    c = chunk_size
    keep = torch.ones(c, c, dtype=torch.bool).tril()[..., None]
    diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~keep, -torch.inf)  # (B,H,n,C,C,Dk)
    intra = torch.einsum("bhnrd,bhnsd,bhnrsd->bhnrs", q, k, diff.exp()) @ v  # (B,H,n,C,Dv)
    own = (k * (G[..., -1:, :] - G).exp()).transpose(-2, -1) @ v  # (B,H,n,Dk,Dv) each chunk's own
    last = F.pad(G[..., -1, :], (0, 0, 1, 0)).cumsum(-2)  # (B,H,n+1,Dk) log-decay up to each chunk boundary
    before = torch.ones(n, n, dtype=torch.bool).tril(-1)[..., None]  # chunk j < i
    gap = (last[..., :-1, None, :] - last[..., None, 1:, :]).masked_fill(~before, -torch.inf).exp()  # end j -> start i
    starts = torch.einsum("bhijd,bhjdv->bhidv", gap, own) + last[..., :-1, :].exp()[..., None] * initial_state[:, :, None]
    final = starts[:, :, -1] * G[:, :, -1, -1, :, None].exp() + own[:, :, -1]  # (B,H,Dk,Dv) after the last chunk
    inter = (q * G.exp()) @ starts  # the state at each chunk's start
    return (intra + inter).reshape(B, H, n * c, -1)[:, :, :T], torch.cat([starts, final[:, :, None]], 2)


def with_initial_state(route):
    """An answer to the old exercise (zero initial state, the output only), completed by test code: the initial
    state's share of every output added and the boundary states carried chunk by chunk (checks/ch13.py's
    `boundary_states`, run as learner code: an answer that called the checks module would be refused for that call,
    not for what `route` does). Whatever `route` does wrong (its layout, its work, its arithmetic) stays."""
    def answer(q, k, v, g, initial_state, chunk_size):
        o = route(q, k, v, g, chunk_size) + (q * g.cumsum(-2).exp()) @ initial_state  # g (B, H, T, Dk)
        return o, _boundary_states(k, v, g, initial_state, chunk_size)

    answer.__name__ = route.__name__
    return answer


def test_chunked_decay_right_answers(tmp_path, monkeypatch):
    accepted("13-chunked-decay", chunks_at_once, tmp_path, monkeypatch)


def package_chunked_edited(q, k, v, g, initial_state, chunk_size):
    """Review 8's route: la.chunked copied with its validation, scale and helpers dropped, the decayed products
    inlined, and one line added to keep every boundary state. Right outputs, but it steps from chunk to chunk."""
    B, H, T, Dk = q.shape
    C = chunk_size
    n = -(-T // C)
    pad = n * C - T
    gg = g  # (B,H,T,Dk): one log-decay per key channel
    q, k, v, gg = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, gg))
    q, k, v, gg = (x.reshape(B, H, n, C, x.shape[-1]) for x in (q, k, v, gg))
    G = gg.cumsum(-2)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    qk = torch.einsum("bhnrd,bhnsd,bhnrsd->bhnrs", q, k, decay)
    state, outs, states = initial_state, [], [initial_state]
    for i in range(n):
        Gi = G[:, :, i]
        outs.append((q[:, :, i] * Gi.exp()) @ state + qk[:, :, i] @ v[:, :, i])
        last = Gi[:, :, -1:]
        state = state * last.transpose(-2, -1).exp() + (k[:, :, i] * (last - Gi).exp()).transpose(-2, -1) @ v[:, :, i]
        states.append(state)
    return torch.cat(outs, dim=2)[:, :, :T], torch.stack(states, 2)


def test_chunked_decay_chunk_loops_refused(tmp_path, monkeypatch):
    """Review 8: an edited copy of la.chunked passed 3/3. The exercise now asks for every chunk at once (Mamba-2's
    ssd_minimal), which the package does not implement: its loop from chunk to chunk, copied and given the boundary
    states, is refused by the property, and so is the loop written afresh."""
    for route in (package_chunked_edited, chunked_decay_attention):
        msg, graded = refused("13-chunked-decay", route, tmp_path, monkeypatch)
        assert NOT_THE_WAY in msg and NOT_THE_WAY in graded, (route.__name__, msg)
        assert "number of chunks" in msg, msg


def summaries_stepped_in_python(q, k, v, g, initial_state, chunk_size):
    """Review 12b's route F: every chunk's own part batched in torch, then the chunks' summaries read out once with
    tolist() and the chunk-to-chunk recurrence stepped on lists: a constant operator count, under the scalar budget."""
    B, H, T, Dk = q.shape
    Dv, C = v.shape[-1], chunk_size
    n = -(-T // C)
    q, k, v, g = (F.pad(x, (0, 0, 0, n * C - T)).view(B, H, n, C, x.shape[-1]) for x in (q, k, v, g))
    G = g.cumsum(-2)
    keep = torch.ones(C, C, dtype=torch.bool).tril()[..., None]
    diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~keep, -torch.inf)
    intra = torch.einsum("bhnrd,bhnsd,bhnrsd->bhnrs", q, k, diff.exp()) @ v
    lam, own = G[..., -1, :].exp().tolist(), ((k * (G[..., -1:, :] - G).exp()).transpose(-2, -1) @ v).tolist()
    out = []
    for b, s0 in enumerate(initial_state.tolist()):
        out.append([])
        for h, S in enumerate(s0):
            st = [S]
            for j in range(n):
                S = [[lam[b][h][j][c] * S[c][e] + own[b][h][j][c][e] for e in range(Dv)] for c in range(Dk)]
                st.append(S)
            out[-1].append(st)
    states = torch.tensor(out, dtype=q.dtype)
    return (intra + (q * G.exp()) @ states[:, :, :n]).reshape(B, H, n * C, Dv)[:, :, :T], states


def test_chunked_decay_recurrence_on_lists_refused(tmp_path, monkeypatch):
    """Review 12b, finding 1: the recurrence between chunks stepped in plain Python passed 3/3; the property now
    counts the numbers read out of the tensors."""
    msg, graded = refused("13-chunked-decay", summaries_stepped_in_python, tmp_path, monkeypatch)
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded, msg
    assert "read" in msg and "plain Python" in msg, msg


def test_chunked_decay_package_output_is_not_an_answer():
    """Review 8: an edited copy of la.chunked passed. The exercise now asks for every boundary state, which the
    package does not return: its (o, final state), however it is computed, is refused by shape."""
    def package_like(q, k, v, g, initial_state, chunk_size):
        o, states = chunked_decay_attention(q, k, v, g, initial_state, chunk_size)
        return o, states[:, :, -1]

    assert "shape" in failure("13-chunked-decay", package_like)


def test_chunked_decay_package_copies_refused(tmp_path, monkeypatch):
    """Routes around the forbidden names: the package's chunked form rebuilt from its code object, its source pasted
    and run against the package's helpers, a segsum or decay_mask for the intra-chunk mask. All refused."""
    import inspect
    import textwrap
    import types

    from attncourse import linear_attention as la

    rebuilt = types.FunctionType(la.chunked.__code__, vars(la), "chunked", la.chunked.__defaults__)

    def code_object(q, k, v, g, initial_state, chunk_size):
        return rebuilt(q, k, v, g, chunk_size=chunk_size, scale=1.0, initial_state=initial_state)

    space = dict(vars(la))
    exec(textwrap.dedent(inspect.getsource(la.chunked)), space)  # the package's source, pasted

    def pasted(q, k, v, g, initial_state, chunk_size):
        return space["chunked"](q, k, v, g, chunk_size=chunk_size, scale=1.0, initial_state=initial_state)

    for route in (code_object, pasted):
        msg, graded = refused("13-chunked-decay", route, tmp_path, monkeypatch)
        assert "called" in msg and "called" in graded, (route.__name__, msg)
    for ex_id, route in (("13-find-the-bug-1", lambda q, k, v, g, beta, initial_state, chunk_size:
                          space["chunked"](q, k, v, g, beta, chunk_size=chunk_size, scale=1.0,
                                           initial_state=initial_state)),):
        msg, graded = refused(ex_id, route, tmp_path, monkeypatch)
        assert "called" in msg and "called" in graded, msg


def test_chunked_decay_quadratic_in_any_layout_refused(tmp_path, monkeypatch):
    """The review's route: the whole (T, T) masked product with a trailing singleton dim (so no tensor's last two
    dims are (T, T)), and the same product flattened to one (T*T) dim. Both ignore chunk_size; both refused."""
    import math

    def trailing_dim(q, k, v, g, chunk_size):
        G = g.cumsum(-2)  # (B,H,T,Dk)
        T = q.shape[2]
        keep = (torch.arange(T)[:, None] >= torch.arange(T)[None, :])[..., None]
        diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~keep, -math.inf)  # (B,H,T,T,Dk)
        s = (q.unsqueeze(3) * k.unsqueeze(2) * diff.exp()).sum(-1, keepdim=True)  # (B,H,T,T,1)
        return (s * v.unsqueeze(2)).sum(3)

    def flattened(q, k, v, g, chunk_size):
        B, H, T, Dk = q.shape
        G = g.cumsum(-2)
        keep = (torch.arange(T)[:, None] >= torch.arange(T)[None, :])[..., None]
        diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~keep, -math.inf)  # (B,H,T,T,Dk)
        s = (q.unsqueeze(3) * k.unsqueeze(2) * diff.exp()).sum(-1).reshape(B, H, T * T)  # one dim of T*T
        return (s.reshape(B, H, T, T).unsqueeze(-1) * v.unsqueeze(2)).sum(3)

    for route in (trailing_dim, flattened):
        msg, graded = refused("13-chunked-decay", with_initial_state_per_channel(route), tmp_path, monkeypatch)
        assert NOT_THE_WAY in msg and NOT_THE_WAY in graded, (route.__name__, msg)
        assert "T^2" in msg, msg


def test_chunked_decay_ratio_of_products_fails():
    def ratios(q, k, v, g, chunk_size):  # e^G_r / e^G_s inside a chunk: overflows with strong decays
        B, H, T, Dk = q.shape
        S = q.new_zeros(B, H, Dk, v.shape[-1])
        outs = []
        for a in range(0, T, chunk_size):
            qc, kc, vc = q[:, :, a:a + chunk_size], k[:, :, a:a + chunk_size], v[:, :, a:a + chunk_size]
            E = g[:, :, a:a + chunk_size].cumsum(-2).exp()  # (B,H,c,Dk)
            w = ((qc * E) @ (kc / E).transpose(-2, -1)).tril()
            outs.append((qc * E) @ S + w @ vc)
            S = S * E[..., -1, :, None] + (kc * (E[..., -1:, :] / E)).transpose(-2, -1) @ vc
        return torch.cat(outs, 2)

    assert "strong decay" in failure("13-chunked-decay", with_initial_state_per_channel(ratios))


def test_chunked_decay_forgets_the_short_last_chunk():
    def drops_tail(q, k, v, g, chunk_size):
        T = q.shape[2] // chunk_size * chunk_size
        zero = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
        out = chunks_at_once(q[:, :, :T], k[:, :, :T], v[:, :, :T], g[:, :, :T], zero, chunk_size)[0]
        return torch.cat([out, torch.zeros_like(v[:, :, T:])], 2)

    assert "45" in failure("13-chunked-decay", with_initial_state_per_channel(drops_tail)).split("\n")[0]


# ----------------------------------------------------------------------------- 2. the bug


def _gdn_chunks(q, k, v, g, beta, initial_state, chunk_size, twice=False):
    """The notebook's chunked gated delta rule; `twice=True` is its bug (the write's read of the earlier chunks'
    state decayed over the whole chunk as well as by e^{G_r})."""
    S = initial_state
    outs, states = [], [S]
    for a in range(0, q.shape[2], chunk_size):
        qc, kc, vc, bc = (x[:, :, a:a + chunk_size] for x in (q, k, v, beta))
        G = g[:, :, a:a + chunk_size].cumsum(-1)
        c = G.shape[-1]
        D = (G[..., :, None] - G[..., None, :]).masked_fill(~torch.ones(c, c, dtype=torch.bool).tril(), -torch.inf).exp()
        S_end = S * G[..., -1, None, None].exp()
        A = (bc[..., None] * (kc @ kc.transpose(-2, -1)) * D).tril(-1)
        predicted = (kc * G[..., None].exp()) @ (S_end if twice else S)
        u = torch.linalg.solve_triangular(torch.eye(c, dtype=q.dtype) + A, bc[..., None] * (vc - predicted),
                                          upper=False, unitriangular=True)
        outs.append((qc * G[..., None].exp()) @ S + ((qc @ kc.transpose(-2, -1)) * D) @ u)
        S = S_end + (kc * (G[..., -1:] - G)[..., None].exp()).transpose(-2, -1) @ u
        states.append(S)
    return torch.cat(outs, 2), torch.stack(states, 2)


def gated_delta_chunked_fixed(q, k, v, g, beta, initial_state, chunk_size):
    return _gdn_chunks(q, k, v, g, beta, initial_state, chunk_size)


def _buggy(q, k, v, g, beta, initial_state, chunk_size):  # the notebook's version
    return _gdn_chunks(q, k, v, g, beta, initial_state, chunk_size, twice=True)


def test_bug_fixed_passes_and_buggy_fails(tmp_path, monkeypatch):
    from attncourse.classroom.checks.ch13_breakers import BUGGY_GDN
    from test_edits import cell_function

    edited = cell_function(BUGGY_GDN.replace("exp()) @ S_end", "exp()) @ S").replace("chunked(", "chunked_fixed("),
                           "gated_delta_chunked_fixed", {"torch": torch, "math": math})
    accepted("13-find-the-bug-1", edited, tmp_path, monkeypatch)
    msg, graded = refused("13-find-the-bug-1", gated_delta_chunked_fixed, tmp_path, monkeypatch)  # not the given code
    assert "not the way" in msg and "not the way" in graded
    msg = failure("13-find-the-bug-1", _buggy)
    assert "g = 0" not in msg.split("\n")[0] and "zero initial state" not in msg.split("\n")[0], msg


def test_the_bug_shows_only_with_a_gate_and_a_state():
    from attncourse import linear_attention as la

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    k = F.normalize(k, dim=-1)
    beta = torch.rand(1, 2, 20, generator=gen, dtype=torch.float64)
    s0 = torch.randn(1, 2, 4, 4, generator=gen, dtype=torch.float64)
    g0 = torch.zeros(1, 2, 20, dtype=torch.float64)
    torch.testing.assert_close(_buggy(q, k, v, g0, beta, s0, 8)[0], la.recurrent(q, k, v, g0, beta, scale=1.0,
                                                                                  initial_state=s0)[0])
    g = F.logsigmoid(torch.randn(1, 2, 20, generator=gen, dtype=torch.float64))
    torch.testing.assert_close(_buggy(q[:, :, :8], k[:, :, :8], v[:, :, :8], g[..., :8], beta[..., :8], 0 * s0, 8)[0],
                               la.recurrent(q[:, :, :8], k[:, :, :8], v[:, :, :8], g[..., :8], beta[..., :8],
                                            scale=1.0)[0])  # one chunk from an empty state
    ref, final = la.recurrent(q, k, v, g, beta, scale=1.0, initial_state=s0)
    assert not torch.allclose(_buggy(q, k, v, g, beta, s0, 8)[0], ref)
    o, states = gated_delta_chunked_fixed(q, k, v, g, beta, s0, 8)
    torch.testing.assert_close(o, ref)
    torch.testing.assert_close(states[:, :, -1], final)
    torch.testing.assert_close(states[:, :, 0], s0)


def test_bug_package_edit_without_boundary_states_refused():
    """Review 8: an edited copy of la.chunked (what the package computes: the output and the final state) is no
    longer an answer: the exercise asks for the state at every chunk boundary, which the package does not return."""
    def package_like(q, k, v, g, beta, initial_state, chunk_size):
        o, states = _gdn_chunks(q, k, v, g, beta, initial_state, chunk_size)
        return o, states[:, :, -1]  # la.chunked's (o, final state)

    assert "shape" in failure("13-find-the-bug-1", package_like)


# ----------------------------------------------------------------------------- 3. predict


def predicted_bytes(n_layers, linear_per_attention, n_kv_heads, head_dim, n_heads, key_dim, value_dim, seq_len):
    n_attention = n_layers // (linear_per_attention + 1)
    per_token = 2 * n_kv_heads * head_dim * 2
    state = n_heads * key_dim * value_dim * 2
    return n_attention * per_token * seq_len / 2**20, (n_layers - n_attention) * state / 2**20, state / per_token


def test_predict_is_a_rule_checked_on_drawn_hybrids(tmp_path, monkeypatch):
    assert predicted_bytes(32, 3, 4, 128, 16, 128, 128, 32768) == (512.0, 12.0, 256.0)
    accepted("13-predict-hybrid-bytes", predicted_bytes, tmp_path, monkeypatch)
    cases = checks.get("13-predict-hybrid-bytes").make_cases()
    assert len(cases) == 3 and len({c.args for c in cases}) == 3  # the exercise's model and two drawn ones

    def package(n_layers, linear_per_attention, n_kv_heads, head_dim, n_heads, key_dim, value_dim, seq_len):
        from attncourse.hybrid import HybridConfig, attention_layers, linear_layers  # the review's route (E)
        n_attn = n_layers // (linear_per_attention + 1)
        attn = attention_layers("a", n_attn, n_kv_heads=n_kv_heads, head_dim=head_dim)
        lin = linear_layers("l", n_layers - n_attn, n_heads=n_heads, key_dim=key_dim, value_dim=value_dim)
        parts = HybridConfig("h", (attn, lin), "").bytes(seq_len)
        return parts["a"] / 2**20, parts["l"] / 2**20, lin.fixed / attn.per_token

    def checker(*cfg):  # the checker's own cases
        from attncourse.classroom import checks as c
        for case in c.get("13-predict-hybrid-bytes").make_cases():
            if case.args == cfg:
                return case.expected
        return None

    def with_tensors(n_layers, linear_per_attention, n_kv_heads, head_dim, n_heads, key_dim, value_dim, seq_len):
        out = predicted_bytes(n_layers, linear_per_attention, n_kv_heads, head_dim, n_heads, key_dim, value_dim, seq_len)
        return tuple(float(torch.tensor(x) * 1) for x in out)

    for route in (package, checker):
        msg, graded = refused("13-predict-hybrid-bytes", route, tmp_path, monkeypatch)
        assert "called attncourse" in msg and "called attncourse" in graded, (route.__name__, msg)
    msg, graded = refused("13-predict-hybrid-bytes", with_tensors, tmp_path, monkeypatch)
    assert "torch" in msg, msg

    def printed(*cfg):  # the exercise's own numbers, typed in: wrong on the drawn hybrids
        return 512.0, 12.0, 256.0

    def k_only(n_layers, linear_per_attention, n_kv_heads, head_dim, n_heads, key_dim, value_dim, seq_len):
        kv, state, even = predicted_bytes(n_layers, linear_per_attention, n_kv_heads, head_dim, n_heads, key_dim,
                                          value_dim, seq_len)
        return kv / 2, state, even * 2  # forgets that V is cached too

    def state_wrong(*cfg):
        kv, state, even = predicted_bytes(*cfg)
        return kv, 2 * state, even

    said = set()
    for route in (printed, k_only, state_wrong):
        msg, graded = refused("13-predict-hybrid-bytes", route, tmp_path, monkeypatch)
        body = msg.split("\n", 1)[1]  # past the first line (the exercise and the case)
        assert "prediction is not right" in body, (route.__name__, msg)
        assert "state_MiB" not in body and "kv_cache_MiB" not in body and "other parts" not in msg + graded
        said.add(body)
    assert len(said) == 1, said  # judged whole: the same words whichever part is wrong


def test_predict_answer_is_importable_from_nowhere():
    """The checks module keeps the prediction's model and answer in local names: nothing public returns it, and the
    exercise notebook imports nothing from the checks but `check` and `passed`."""
    import ast
    import inspect

    import nbformat

    from attncourse.classroom.nbtools import ROOT

    from attncourse.classroom.checks import ch13
    from attncourse.hybrid import HybridConfig, LayerKind

    answer = {512.0, 12.0, 256.0}
    for name, value in vars(ch13).items():
        if name.startswith("_") or inspect.ismodule(value):
            continue
        assert not isinstance(value, (HybridConfig, LayerKind, tuple, float, int)), name
        if callable(value) and getattr(value, "__module__", "") == ch13.__name__:
            try:
                out = value()
            except TypeError:
                continue
            assert not answer & set(out if isinstance(out, tuple) else [out]), name
    for nb in ("exercises", "solutions"):
        cells = nbformat.read(ROOT / nb / "13_linear_attention.ipynb", 4).cells
        for cell in cells:
            if cell.cell_type != "code":
                continue
            for node in ast.walk(ast.parse("\n".join(line for line in cell.source.splitlines()
                                                     if not line.lstrip().startswith(("%", "!"))))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attncourse.classroom.checks"):
                    assert node.module == "attncourse.classroom.checks", (nb, node.module)
                    assert {a.name for a in node.names} <= {"check", "passed"}, (nb, [a.name for a in node.names])


# ----------------------------------------------------------------------------- 4. experiment


def recall_measured(rule, n_pairs, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(n_pairs, dim, generator=gen, dtype=torch.float64), dim=-1)
    values = F.normalize(torch.randn(n_pairs, dim, generator=gen, dtype=torch.float64), dim=-1)
    S = torch.zeros(dim, dim, dtype=torch.float64)
    for key, value in zip(keys, values):
        write = value - S.T @ key if rule == "delta" else value
        S = S + torch.outer(key, write)
    read = keys @ S
    return float(((read @ values.T).argmax(-1) == torch.arange(n_pairs)).double().mean())


def test_recall_experiment(tmp_path, monkeypatch):
    accepted("13-recall-capacity", recall_measured, tmp_path, monkeypatch)

    def values_first(rule, n_pairs, dim, seed):  # the draws in the other order
        gen = torch.Generator().manual_seed(seed)
        values = F.normalize(torch.randn(n_pairs, dim, generator=gen, dtype=torch.float64), dim=-1)
        keys = F.normalize(torch.randn(n_pairs, dim, generator=gen, dtype=torch.float64), dim=-1)
        S = torch.zeros(dim, dim, dtype=torch.float64)
        for key, value in zip(keys, values):
            S = S + torch.outer(key, value - S.T @ key if rule == "delta" else value)
        return float(((keys @ S @ values.T).argmax(-1) == torch.arange(n_pairs)).double().mean())

    def capacity_rule(rule, n_pairs, dim, seed):  # "perfect up to dim pairs, then dim / n": a closed form
        return min(1.0, dim / n_pairs)

    for route in (values_first, capacity_rule, lambda rule, n_pairs, dim, seed: 1.0):
        failure("13-recall-capacity", route)


def test_memory_recall_beta():
    """The lesson's step-size sweep: beta = 1 is the default, small steps make the delta rule level with the plain
    sum at N = 64, bad steps are refused."""
    from attncourse.recall import memory_recall
    assert memory_recall("delta", 32, 32, 0) == memory_recall("delta", 32, 32, 0, beta=1.0)
    assert memory_recall("delta", 64, 32, 0, beta=0.1) > memory_recall("delta", 64, 32, 0)
    for bad in (0.0, 1.5, "1"):
        with pytest.raises(ValueError, match="beta"):
            memory_recall("delta", 8, 8, 0, beta=bad)


# ----------------------------------------------------------------------------- review 6: the work leaves PyTorch


def _plain_python_recurrence(q, k, v, g, beta=None):
    """The token-by-token recurrence on Python lists (.tolist(), math.exp): no chunk and no tensor operator."""
    Q, K, V, G = q.tolist(), k.tolist(), v.tolist(), g.tolist()
    Bt = beta.tolist() if beta is not None else None
    out = []
    for b in range(len(Q)):
        ob = []
        for h in range(len(Q[b])):
            dk, dv = len(K[b][h][0]), len(V[b][h][0])
            S = [[0.0] * dv for _ in range(dk)]  # S[i][j]: key dim i, value dim j
            oh = []
            for t in range(len(Q[b][h])):
                a, kt, vt = math.exp(G[b][h][t]), K[b][h][t], V[b][h][t]
                S = [[a * S[i][j] for j in range(dv)] for i in range(dk)]
                if Bt is None:
                    S = [[S[i][j] + kt[i] * vt[j] for j in range(dv)] for i in range(dk)]
                else:
                    err = [vt[j] - sum(S[i][j] * kt[i] for i in range(dk)) for j in range(dv)]
                    S = [[S[i][j] + Bt[b][h][t] * kt[i] * err[j] for j in range(dv)] for i in range(dk)]
                oh.append([sum(Q[b][h][t][i] * S[i][j] for i in range(dk)) for j in range(dv)])
            ob.append(oh)
        out.append(ob)
    return torch.tensor(out, dtype=q.dtype)


def test_chunked_decay_in_plain_python_refused(tmp_path, monkeypatch):
    """Review 6: the recurrence token by token on .tolist() lists passed 3/3; the property now asks for matrix
    products over chunk-sized blocks that take in at least q, k and v, and the guard refuses reading the inputs out
    into plain Python (whichever sees it first)."""
    def plain(q, k, v, g, chunk_size):
        return _plain_python_recurrence(q, k, v, g)

    msg, graded = refused("13-chunked-decay", with_initial_state(plain), tmp_path, monkeypatch)
    assert all(("matrix products over chunk-sized" in m or "numbers read out of tensors" in m) for m in (msg, graded)), msg


def test_gated_delta_bug_in_plain_python_refused(tmp_path, monkeypatch):
    """Review 6: the gated delta recurrence in plain Python, no chunk and no fix of the given code, passed 2/2."""
    def plain(q, k, v, g, beta, initial_state, chunk_size):
        o = _plain_python_recurrence(q, k, v, g, beta)
        n = -(-q.shape[2] // chunk_size)
        return o, initial_state[:, :, None].expand(-1, -1, n + 1, -1, -1)

    msg, graded = refused("13-find-the-bug-1", plain, tmp_path, monkeypatch)
    assert all(("matrix products over chunk-sized" in m or "numbers read out of tensors" in m) for m in (msg, graded)), msg


# ----------------------------------------------------------------------------- review 10: one decay per key channel


def with_initial_state_per_channel(route):
    """:func:`with_initial_state`, named for exercise 1 as it is now (g (B, H, T, Dk), one log-decay per key channel)."""
    return with_initial_state(route)


def _segsum(x):  # Mamba-2's ssd_minimal helper, as its listing writes it
    T = x.size(-1)
    x = x[..., None].expand(*x.shape, T)
    x = x.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=-1), 0)
    x = torch.cumsum(x, dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=0), -torch.inf)


def ssd_transcribed(q, k, v, g, initial_state, chunk_size):
    """Review 10's route: Mamba's public `ssd_minimal_discrete` transcribed to (B, H, T, D), with the initial state
    and padding; one decay per head, read from the first key channel (the transcription's only way to take g)."""
    B, H, T, Dk = q.shape
    Dv, C, n = v.shape[-1], chunk_size, -(-T // chunk_size)
    pad = n * C - T
    X = F.pad(v, (0, 0, 0, pad)).reshape(B, H, n, C, Dv)
    Bm = F.pad(k, (0, 0, 0, pad)).reshape(B, H, n, C, Dk)
    Cm = F.pad(q, (0, 0, 0, pad)).reshape(B, H, n, C, Dk)
    A = F.pad(g[..., 0], (0, pad)).reshape(B, H, n, C)
    A_cumsum = torch.cumsum(A, dim=-1)
    Y_diag = torch.einsum("bhcln,bhcsn,bhcls,bhcsp->bhclp", Cm, Bm, torch.exp(_segsum(A)), X)
    states = torch.einsum("bhcln,bhcl,bhclp->bhcnp", Bm, torch.exp(A_cumsum[..., -1:] - A_cumsum), X)
    states = torch.cat([initial_state[:, :, None], states], dim=2)
    new_states = torch.einsum("bhzc,bhcnp->bhznp", torch.exp(_segsum(F.pad(A_cumsum[..., -1], (1, 0)))), states)
    Y_off = torch.einsum("bhcln,bhcnp,bhcl->bhclp", Cm, new_states[:, :, :-1], torch.exp(A_cumsum))
    return (Y_diag + Y_off).reshape(B, H, n * C, Dv)[:, :, :T], new_states


def test_chunked_decay_ssd_minimal_transcribed_fails():
    """Review 10: the transcription of `ssd_minimal_discrete` passed 3/3 when the decay was one per head. With one
    decay per key channel it is right on the case with one decay per head only: the decay must enter the sum over
    channels, within a chunk and between chunks."""
    ex = checks.get("13-chunked-decay")
    first = ex.make_cases()[0]
    assert "one decay per head" in first.name
    o, states = ssd_transcribed(*first.args)
    torch.testing.assert_close((o, states), first.expected, rtol=1e-7, atol=1e-8)  # the per-head case: right
    msg = failure("13-chunked-decay", ssd_transcribed)
    assert "one decay per head" not in msg.split("\n")[0], msg


def test_chunked_decay_per_channel_answer_passes_and_mean_decay_fails():
    """The accepted answer handles a different decay per key channel; replacing the channels' decays by their mean (a
    per-head answer fed a per-channel gate) fails."""
    def mean_decay(q, k, v, g, initial_state, chunk_size):
        return chunks_at_once(q, k, v, g.mean(-1, keepdim=True).expand_as(g), initial_state, chunk_size)

    assert "failed" in failure("13-chunked-decay", mean_decay).split("\n")[0]
