"""Chapter 10's checks can fail: wrong answers of the kinds a learner writes are refused, for the right reason.

The first answers here are plain PyTorch (they judge the checks' cases), checked with the exercise's forbidden
list, operator families and property emptied: the guard would rightly refuse them for computing outside a kernel.
The routes of issue 23 (review ch10-12, section 4) are then tried against the real checks, with real Triton kernels
under the interpreter, through the check cell and the grader: plain PyTorch in place of a kernel, a kernel that does
nothing with the arithmetic around it, the package's private ``@triton.jit`` helper, heads rearranged around the
buggy kernel, the checks' own reference, and one decode copied for every number of splits.
"""

from __future__ import annotations

import dataclasses
import math
import os
from unittest import mock

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: kernels run in NumPy

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from attncourse.classroom import checks  # noqa: E402
from test_exercise_standard import Grader, as_learner  # noqa: E402

from attncourse.triton_common import _query_range  # noqa: E402 (the review's X3: the package's own @triton.jit helper)


def check(exercise_id, answer):
    """checks.check with nothing forbidden and no property: these PyTorch answers stand in for the learner's Triton."""
    ex = dataclasses.replace(checks.get(exercise_id), forbid=(), ops=(), prop=None)
    with mock.patch.dict(checks._REGISTRY, {ex.id: ex}):
        checks.check(ex.id, answer)


def failure(exercise_id, answer):
    with pytest.raises(checks.CheckFailed) as info:
        check(exercise_id, answer)
    assert "called" not in str(info.value)  # a wrong answer, not a forbidden call
    return str(info.value)


def lse_update_torch(out, lse, s, v, *, guard=True, weight_old=True):
    ref = torch.maximum(lse, s.amax(-1))
    if guard:
        ref = torch.where(torch.isinf(ref), torch.zeros_like(ref), ref)
    w_old = (lse - ref).exp() if weight_old else torch.ones_like(lse)
    p = (s - ref[:, None]).exp()  # (R, C)
    total = w_old + p.sum(-1)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out_new = (w_old[:, None] * out + p @ v) / safe[:, None]  # (R, C) @ (C, D) -> (R, D)
    lse_new = torch.where(total > 0, ref + safe.log(), torch.full_like(ref, float("-inf")))
    return out_new, lse_new


def test_online_update_check():
    check("10-online-update", lse_update_torch)
    assert "has seen no key and sees none" in failure("10-online-update",
                                                      lambda *a: lse_update_torch(*a, guard=False))
    failure("10-online-update", lambda *a: lse_update_torch(*a, weight_old=False))


def query_blocks_torch(t_q, t_k, block_q, block_k, causal_align, window, *, round_down=True, use_window=True):
    offset = t_k - t_q if causal_align == "bottom_right" else 0
    n_qb, n_kb = math.ceil(t_q / block_q), math.ceil(t_k / block_k)
    visit = torch.zeros(n_kb, n_qb, dtype=torch.bool)
    for kb in range(n_kb):
        k_start = kb * block_k
        lo = max(k_start - offset, 0)
        lo = lo // block_q * block_q if round_down else lo
        hi = t_q
        if window is not None and use_window:
            hi = max(min(t_q, min(k_start + block_k, t_k) - 1 + window - offset), 0)
        for qb in range(n_qb):
            visit[kb, qb] = lo <= qb * block_q < hi
    return visit


def test_causal_blocks_check():
    check("10-causal-blocks", query_blocks_torch)
    failure("10-causal-blocks", lambda *a: query_blocks_torch(*a, round_down=False))
    assert "window" in failure("10-causal-blocks", lambda *a: query_blocks_torch(*a, use_window=False))


def decode_torch(query, key, value, *, kv_head):
    heads, kv_heads = query.shape[1], key.shape[1]
    index = torch.tensor([kv_head(h, heads, kv_heads) for h in range(heads)])
    k, v = key[:, index], value[:, index]  # (B, H, Tk, D)
    weights = torch.softmax((query @ k.transpose(-2, -1)) / math.sqrt(query.shape[-1]), -1)  # (B, H, 1, Tk)
    return weights @ v  # (B, H, 1, Tk) @ (B, H, Tk, D) -> (B, H, 1, D)


def test_decode_bug_check_catches_the_bug_and_only_it():
    check("10-find-the-bug-1", lambda q, k, v: decode_torch(q, k, v, kv_head=lambda h, H, G: h // (H // G)))
    message = failure("10-find-the-bug-1", lambda q, k, v: decode_torch(q, k, v, kv_head=lambda h, H, G: h % G))
    assert "GQA: 8 query heads over 2 KV heads" in message  # MHA and MQA cases pass with the bug


def decode_rule(batch, heads, kv_heads, k_len, head_dim, num_splits, bytes_per_element):
    """A learner's rule for 10-predict-decode, in plain integers."""
    once = 2 * k_len * head_dim * bytes_per_element
    return (batch * heads, batch * kv_heads, batch * heads * once, batch * kv_heads * once,
            batch * kv_heads * num_splits, -(-k_len // num_splits))


def test_prediction_is_a_rule_judged_whole_never_the_value(tmp_path, monkeypatch):
    """10-predict-decode is a function of the step: the right rule passes, the package's decode_work, the checker's
    own reference, a tensor computation and the exercise's six numbers typed in are refused, and a wrong rule is
    told only that the prediction is not right."""
    ex = checks.get("10-predict-decode")
    cases = ex.make_cases()
    assert len(cases) >= 3 and len({c.args for c in cases}) == len(cases)  # the exercise's step and two drawn ones
    assert any(c.args[3] % c.args[5] for c in cases)  # a cache the splits do not divide: the rounding counts
    checks.check("10-predict-decode", decode_rule)
    assert Grader(tmp_path, monkeypatch)(ex, as_learner(decode_rule), cases)[0] == "passed"

    def package(batch, heads, kv_heads, k_len, head_dim, num_splits, bytes_per_element):  # the lesson's function
        from attncourse.triton_decode import decode_work
        plain = decode_work(batch, heads, kv_heads, k_len, head_dim, pack_gqa=False,
                            bytes_per_element=bytes_per_element)
        packed = decode_work(batch, heads, kv_heads, k_len, head_dim, bytes_per_element=bytes_per_element)
        split = decode_work(batch, heads, kv_heads, k_len, head_dim, num_splits=num_splits,
                            bytes_per_element=bytes_per_element)
        return (plain["programs"], packed["programs"], plain["kv_bytes"], packed["kv_bytes"], split["programs"],
                split["keys_per_program"])

    refused("10-predict-decode", as_learner(package), tmp_path, monkeypatch, because="called attncourse")

    def checker(*args):  # the checks' own reference
        from attncourse.classroom.checks.ch10_predict import _decode_expected
        return _decode_expected(*args)

    refused("10-predict-decode", as_learner(checker), tmp_path, monkeypatch, because="called attncourse")

    def tensors(batch, heads, kv_heads, k_len, head_dim, num_splits, bytes_per_element):  # arithmetic on tensors
        t = torch.tensor([batch, heads, kv_heads, k_len, head_dim, num_splits, bytes_per_element])
        return tuple(int(x) for x in decode_rule(*t.tolist())[:5]) + (int(torch.ceil(t[3] / t[5])),)

    with pytest.raises(checks.CheckFailed):
        checks.check("10-predict-decode", as_learner(tensors))

    typed = decode_rule(2, 64, 8, 8192, 128, 16, 2)  # the exercise's six numbers, worked out once and typed in

    def hard_coded(*args):
        return typed

    with pytest.raises(checks.CheckFailed) as info:
        checks.check("10-predict-decode", as_learner(hard_coded))
    assert checks.predictions.NOT_RIGHT in str(info.value)

    def floor_keys(*args):  # the keys per program rounded down: right on the exercise's step, wrong on drawn ones
        return decode_rule(*args)[:5] + (args[3] // args[5],)

    with pytest.raises(checks.CheckFailed) as info:
        checks.check("10-predict-decode", as_learner(floor_keys))
    message = str(info.value)
    assert checks.predictions.NOT_RIGHT in message
    assert not any(part in message.split("hint:")[0] for part in ex.parts)  # never which part
    assert str(decode_rule(*cases[1].args)[5]) not in message.split("hint:")[0]  # never the value


def test_experiment_recomputes_per_seed():
    reference = checks.get("10-split-experiment").make_cases()[0].expected
    with pytest.raises(checks.CheckFailed):
        checks.check("10-split-experiment", lambda seed: reference)  # seed 0's numbers for every seed


# ----------------------------------------------------------------------------- the routes, against the real checks


def refused(exercise_id, answer, tmp_path, monkeypatch, *, because):
    """`answer` is refused by the check cell and by the grader, with `because` in both messages."""
    ex = checks.get(exercise_id)
    with pytest.raises(checks.CheckFailed) as info:
        checks.check(exercise_id, answer)
    status, message = Grader(tmp_path, monkeypatch)(ex, answer, ex.make_cases())
    assert status == "failed", message
    assert because in str(info.value) and because in message, (str(info.value), message)


@triton.jit
def lse_update_kernel(OUT, LSE, S, V, OUT_NEW, LSE_NEW, n_rows, n_keys, head_dim,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols, dims = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_D)
    r_ok, c_ok, d_ok = rows < n_rows, cols < n_keys, dims < head_dim
    s = tl.load(S + rows[:, None] * n_keys + cols[None, :], mask=r_ok[:, None] & c_ok[None, :], other=float("-inf"))
    v = tl.load(V + cols[:, None] * head_dim + dims[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.load(OUT + rows[:, None] * head_dim + dims[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(LSE + rows, mask=r_ok, other=float("-inf"))
    ref = tl.maximum(lse, tl.max(s, 1))
    ref = tl.where(ref == float("-inf"), 0.0, ref)
    w_old = tl.exp(lse - ref)
    p = tl.exp(s - ref[:, None])
    total = w_old + tl.sum(p, 1)
    safe = tl.where(total > 0, total, 1.0)
    acc = w_old[:, None] * out + tl.dot(p, v)
    tl.store(OUT_NEW + rows[:, None] * head_dim + dims[None, :], acc / safe[:, None], mask=r_ok[:, None] & d_ok[None, :])
    tl.store(LSE_NEW + rows, tl.where(total > 0, ref + tl.log(safe), float("-inf")), mask=r_ok)


def lse_update_triton(out, lse, s, v):
    out, lse, s, v = (x.float().contiguous() for x in (out, lse, s, v))
    (n_rows, n_keys), head_dim = s.shape, v.shape[1]
    out_new, lse_new = torch.empty_like(out), torch.empty_like(lse)
    lse_update_kernel[(triton.cdiv(n_rows, 16),)](out, lse, s, v, out_new, lse_new, n_rows, n_keys, head_dim,
                                                  BLOCK_R=16, BLOCK_C=max(16, triton.next_power_of_2(n_keys)),
                                                  BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
    return out_new, lse_new


@triton.jit
def copy_kernel(X, Y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i, mask=i < n), mask=i < n)


def test_online_update_in_triton_passes_and_every_route_around_the_kernel_is_refused(tmp_path, monkeypatch):
    checks.check("10-online-update", lse_update_triton)

    def exp2_pytorch(out, lse, s, v):  # the review's X2: torch.exp2 in plain PyTorch, no kernel
        c = 1.4426950408889634
        ref = torch.maximum(lse, s.amax(-1))
        ref = torch.where(torch.isinf(ref), torch.zeros_like(ref), ref)
        w_old, p = torch.exp2((lse - ref) * c), torch.exp2((s - ref[:, None]) * c)
        total = w_old + p.sum(-1)
        safe = torch.where(total > 0, total, torch.ones_like(total))
        return ((w_old[:, None] * out + p @ v) / safe[:, None],
                torch.where(total > 0, ref + torch.log(safe), torch.full_like(ref, float("-inf"))))

    refused("10-online-update", exp2_pytorch, tmp_path, monkeypatch, because="no Triton kernel ran")

    def kernel_for_show(out, lse, s, v):  # a kernel launched (it copies), the arithmetic in PyTorch around it
        spare = torch.empty_like(lse)
        copy_kernel[(1,)](lse, spare, lse.numel(), BLOCK=max(16, triton.next_power_of_2(lse.numel())))
        return exp2_pytorch(out, spare, s, v)

    refused("10-online-update", kernel_for_show, tmp_path, monkeypatch, because="outside the kernel")

    def chapter_08(out, lse, s, v):
        from attncourse.online_softmax import AttentionState, finalize_attention_state, online_attention_update
        state = AttentionState(lse, torch.isfinite(lse).to(out.dtype), out)
        return finalize_attention_state(online_attention_update(state, s, v))

    refused("10-online-update", chapter_08, tmp_path, monkeypatch, because="called attncourse.online_softmax")
    for breaker in checks.get("10-online-update").breakers:
        refused("10-online-update", as_learner(breaker), tmp_path, monkeypatch, because="not the way")


@triton.jit
def query_blocks_kernel(VISIT, T_Q, T_K, OFFSET, WINDOW, n_qb, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, QB: tl.constexpr):
    k_start = tl.program_id(0) * BLOCK_K
    q_blocks = tl.arange(0, QB)
    lo = tl.maximum(k_start - OFFSET, 0) // BLOCK_Q * BLOCK_Q
    hi = T_Q
    if HAS_WINDOW:
        hi = tl.maximum(tl.minimum(T_Q, tl.minimum(k_start + BLOCK_K, T_K) - 1 + WINDOW - OFFSET), 0)
    starts = q_blocks * BLOCK_Q
    tl.store(VISIT + tl.program_id(0) * QB + q_blocks, ((starts >= lo) & (starts < hi) & (q_blocks < n_qb)).to(tl.int32))


@triton.jit
def query_blocks_kernel_package(VISIT, T_Q, T_K, OFFSET, WINDOW, n_qb, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                                HAS_WINDOW: tl.constexpr, QB: tl.constexpr):
    lo, hi = _query_range(tl.program_id(0) * BLOCK_K, T_Q, T_K, OFFSET, WINDOW, BLOCK_Q, BLOCK_K, True, HAS_WINDOW)
    q_blocks = tl.arange(0, QB)
    starts = q_blocks * BLOCK_Q
    tl.store(VISIT + tl.program_id(0) * QB + q_blocks, ((starts >= lo) & (starts < hi) & (q_blocks < n_qb)).to(tl.int32))


def launch_query_blocks(kernel, t_q, t_k, block_q, block_k, causal_align, window):
    offset = t_k - t_q if causal_align == "bottom_right" else 0
    n_qb, n_kb = triton.cdiv(t_q, block_q), triton.cdiv(t_k, block_k)
    qb = triton.next_power_of_2(n_qb)
    visit = torch.zeros(n_kb, qb, dtype=torch.int32)
    kernel[(n_kb,)](visit, t_q, t_k, offset, window or 0, n_qb, BLOCK_Q=block_q, BLOCK_K=block_k,
                    HAS_WINDOW=window is not None, QB=qb)
    return visit[:, :n_qb].bool()


def test_causal_blocks_in_triton_passes_and_the_routes_are_refused(tmp_path, monkeypatch):
    checks.check("10-causal-blocks", lambda *a: launch_query_blocks(query_blocks_kernel, *a))
    with pytest.raises(checks.CheckFailed, match="triton_common"):
        checks.check("10-causal-blocks", lambda *a: launch_query_blocks(query_blocks_kernel_package, *a))

    def python_table(*args):  # a kernel launched for show, the table computed in Python and written from Python
        table = query_blocks_torch(*args)
        spare = torch.zeros(16, dtype=torch.int32)
        copy_kernel[(1,)](spare, spare.clone(), 16, BLOCK=16)
        return table

    refused("10-causal-blocks", python_table, tmp_path, monkeypatch, because="outside the kernel")
    for breaker in checks.get("10-causal-blocks").breakers:
        refused("10-causal-blocks", as_learner(breaker), tmp_path, monkeypatch, because="no Triton kernel ran")


FRESH_KERNEL = """
@triton.jit
def decode_kernel_fixed(Q, K, V, O, T_K, H, H_KV, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = (pid // H) * H_KV + (pid % H) // (H // H_KV)
    dims = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_K)
    mask = (cols[:, None] < T_K) & (dims[None, :] < HEAD_DIM)
    q = tl.load(Q + pid * HEAD_DIM + dims, mask=dims < HEAD_DIM, other=0.0)
    k = tl.load(K + kv_head * T_K * HEAD_DIM + cols[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    v = tl.load(V + kv_head * T_K * HEAD_DIM + cols[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    s = tl.where(cols < T_K, tl.sum(k * q[None, :], 1) / tl.sqrt(HEAD_DIM * 1.0), float("-inf"))
    p = tl.exp(s - tl.max(s, 0))
    tl.store(O + pid * HEAD_DIM + dims, tl.sum(p[:, None] * v, 0) / tl.sum(p, 0), mask=dims < HEAD_DIM)


def decode_fixed(query, key, value):  # one block holds every key: no loop, no online softmax
    query, key, value = (x.to(DEVICE, torch.float32).contiguous() for x in (query, key, value))
    b, h, _, d = query.shape
    out = torch.empty_like(query)
    decode_kernel_fixed[(b * h,)](query, key, value, out, key.shape[2], h, key.shape[1], HEAD_DIM=d,
                                  BLOCK_K=triton.next_power_of_2(key.shape[2]), BLOCK_D=triton.next_power_of_2(d))
    return out
"""


def test_decode_bug_routes_are_refused(tmp_path, monkeypatch):
    import nbformat

    from attncourse.classroom.nbtools import ROOT

    nb = nbformat.read(ROOT / "exercises" / "10_flash_attention_triton.ipynb", as_version=4)
    given = next(c.source for c in nb.cells if c.source.startswith("@triton.jit\ndef decode_kernel("))
    header = ("import torch, triton\nimport triton.language as tl\n"
              "from attncourse import scaled_dot_product_attention, triton_common\n"
              "DEVICE, TOL = triton_common.device(), triton_common.tolerance()\n")
    import importlib.util

    def load(text, name):  # a file of the learner's: the notebook's header, the given code, then `text`
        path = tmp_path / f"{name}.py"
        path.write_text(header + given + "\n\n" + text)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    given_mod = load("", "given_decode")

    def heads_rearranged(query, key, value):  # the buggy kernel, fed query heads in the order its bug expects
        h, h_kv = query.shape[1], key.shape[1]
        g = h // h_kv
        order = torch.tensor([(j % h_kv) * g + j // h_kv for j in range(h)])  # program j reads KV head j % Hkv
        out = given_mod.launch_decode(given_mod.decode_kernel, query[:, order], key, value)
        return out[:, torch.argsort(order)]

    # a right output (the property's message comes only after the outputs matched), refused by check and grader
    refused("10-find-the-bug-1", heads_rearranged, tmp_path, monkeypatch, because="outside the kernel")
    refused("10-decode-bug", lambda q, k, v: decode_torch(q, k, v, kv_head=lambda h, H, G: h // (H // G)),
            tmp_path, monkeypatch, because="softmax")  # the old id still grades

    def package_kernel(query, key, value):
        from attncourse.triton_decode import triton_flash_decode
        return triton_flash_decode(query, key, value)

    refused("10-find-the-bug-1", package_kernel, tmp_path, monkeypatch, because="called attncourse.triton_decode")

    # graded as a small edit of the kernel: the fix passes; a kernel written afresh, or an edit of lines that are
    # right, does not, however right its values
    launcher = "\n\ndef decode_fixed(q, k, v):\n    return launch_decode(decode_kernel_fixed, q, k, v)\n"
    fixed = given.split("\n\n\ndef launch_decode")[0].replace("def decode_kernel(", "def decode_kernel_fixed(")
    mine = load(fixed.replace("h_kv = h % H_KV", "h_kv = h // (H // H_KV)") + launcher, "fixed_decode")
    checks.check("10-find-the-bug-1", mine.decode_fixed)
    assert Grader(tmp_path, monkeypatch)(checks.get("10-find-the-bug-1"), mine.decode_fixed,
                                         checks.get("10-find-the-bug-1").make_cases())[0] == "passed"
    elsewhere = fixed.replace("h_kv = h % H_KV", "h_kv = h // (H // H_KV)").replace("tl.exp2(m - m_new)",
                                                                                    "tl.exp2(m - m_new) * 1.0")
    refused("10-find-the-bug-1", load(elsewhere + launcher, "edit_elsewhere").decode_fixed, tmp_path, monkeypatch,
            because="where it is not wrong")
    refused("10-find-the-bug-1", load(FRESH_KERNEL, "fresh_decode").decode_fixed, tmp_path, monkeypatch,
            because="differs from the given function in")
    # the exercise's breakers: test_exercise_standard.test_properties_refuse_their_breakers, by check and grader


def test_split_experiment_routes_are_refused(tmp_path, monkeypatch):
    from attncourse.classroom.checks.ch10 import split_errors_reference
    from attncourse.triton_decode import triton_flash_decode

    with pytest.raises(checks.CheckFailed, match="called attncourse.classroom"):
        checks.check("10-split-experiment", split_errors_reference)

    def one_decode_three_times(seed):  # the splits measured once, with one split, and copied
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(1, 4, 1, 32, generator=gen)
        k, v = (torch.randn(1, 1, 128, 32, generator=gen) for _ in range(2))
        kk, vv = (x.double().expand(1, 4, 128, 32) for x in (k, v))
        w = torch.softmax(q.double() @ kk.transpose(-2, -1) / math.sqrt(32), -1)
        error = (triton_flash_decode(q, k, v, num_splits=1).double() - w @ vv).abs().max().item()
        return torch.tensor([error] * 3, dtype=torch.float64)

    with pytest.raises(checks.CheckFailed, match="seed 0"):
        checks.check("10-split-experiment", one_decode_three_times)
    with pytest.raises(checks.CheckFailed):
        checks.check("10-split-experiment", lambda seed: torch.full((3,), 1e-7, dtype=torch.float64))


def test_plain_pytorch_instead_of_triton_is_refused():
    """The exercise asks for Triton: a launcher rewritten in PyTorch tensor methods calls torch.exp and fails."""
    with pytest.raises(checks.CheckFailed, match="torch.exp"):
        checks.check("10-online-update", lse_update_torch)


# ----------------------------------------------------------------------------- the capstone: the whole forward


@triton.jit
def _scores_kernel(Q, K, S, T, HEAD_DIM, scale, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """A learner's half-way kernel: only the scores in Triton (one program per batch-head, T <= BLOCK)."""
    bh = tl.program_id(0)
    rows, dims = tl.arange(0, BLOCK), tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < T) & (dims[None, :] < HEAD_DIM)
    q = tl.load(Q + bh * T * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :], mask=ok, other=0.0)
    kt = tl.load(K + bh * T * HEAD_DIM + rows[None, :] * HEAD_DIM + dims[:, None],
                 mask=(rows[None, :] < T) & (dims[:, None] < HEAD_DIM), other=0.0)
    s = tl.dot(q, kt) * scale
    tl.store(S + bh * T * T + rows[:, None] * T + rows[None, :], s, mask=(rows[:, None] < T) & (rows[None, :] < T))


def scores_in_kernel_softmax_outside(q, k, v, is_causal=False):
    """The scores from a kernel, then the softmax, the causal mask and P @ V in PyTorch on the host."""
    bh, t, d = q.shape
    q, k, v = (x.float().contiguous() for x in (q, k, v))
    s = torch.empty(bh, t, t)
    _scores_kernel[(bh,)](q, k, s, t, d, 1.0 / math.sqrt(d), BLOCK=64, BLOCK_D=max(16, triton.next_power_of_2(d)))
    if is_causal:
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = (s - m).exp()
    return p @ v / p.sum(-1, keepdim=True), (m.squeeze(-1) + p.sum(-1).log())


def test_forward_capstone_needs_the_whole_forward_in_the_kernel():
    """A kernel launched for part of the work is not the exercise: the softmax and P @ V on the host are refused by
    the property, and the package's forward kernel and the tiled PyTorch loop by the standard test's shortcut and
    breaker."""
    with pytest.raises(checks.CheckFailed, match="outside the kernel"):
        checks.check("10-forward-kernel", as_learner(scores_in_kernel_softmax_outside))
    out, lse = scores_in_kernel_softmax_outside(*checks.get("10-forward-kernel").make_cases()[0].args)
    assert out.shape[-1] == 16 and lse.dim() == 2  # it computes the right numbers: only the property refuses it
