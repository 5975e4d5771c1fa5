"""Chapter 06's checks can fail: the course's slope, bias, RoPE and permutation functions (under any route),
complex arithmetic for a "real arithmetic" exercise, the checks' own references and a closed form in place of a
measurement are refused by the check cell and by the grader, and right answers pass."""

from __future__ import annotations

import math

import pytest
import torch

from attncourse import alibi_bias, alibi_slopes
from attncourse.classroom import checks
from attncourse.classroom.checks import ch06
from attncourse.positions import alibi_bias_at, apply_rope, grouped_alibi_bias, rope_permutation
from test_ch04_checks import graded, refused
from test_edits import cell_function


# ----------------------------------------------------------------------------- 1. slopes (bug)


def slopes_rewrite(n_heads, max_bias=8.0):  # Press et al.'s get_slopes written afresh: no diagnosis
    def power_of_two(n):
        return [2 ** (-max_bias * (h + 1) / n) for h in range(n)]

    p = 2 ** math.floor(math.log2(n_heads))
    extra = power_of_two(2 * p)[0::2][: n_heads - p] if p < n_heads else []
    return torch.tensor(power_of_two(p) + extra)


# the minimal fix: the power of two at or below the head count, 3 tokens on the given function's line 2
slopes_fixed = cell_function(ch06.BUGGY_SLOPES.replace("round(", "math.floor(").replace("def slopes_buggy(", "def slopes_fixed("),
                             "slopes_fixed", {"torch": torch, "math": math})


def slopes_buggy(n_heads, max_bias=8.0):  # the exercise's engine: the power of two rounded to the nearest
    p = 2 ** round(math.log2(n_heads))
    slopes = [2 ** (-max_bias * k / p) for k in range(1, p + 1)][:n_heads]
    if p < n_heads:
        slopes += [2 ** (-max_bias * k / (2 * p)) for k in range(1, 2 * (n_heads - p), 2)]
    return torch.tensor(slopes)


def slopes_consecutive(n_heads, max_bias=8.0):  # the earlier engine's bug: consecutive powers for the extra heads
    p = 2 ** math.floor(math.log2(n_heads))
    slopes = [2 ** (-max_bias * k / p) for k in range(1, p + 1)]
    slopes += [2 ** (-max_bias * k / (2 * p)) for k in range(1, n_heads - p + 1)]
    return torch.tensor(slopes)


def slopes_lesson_rule(n_heads, max_bias=8.0):  # the lesson's rule transcribed with its 8: max_bias ignored
    return slopes_fixed(n_heads, 8.0)


def slopes_only_power_of_two(n_heads, max_bias=8.0):  # the earlier notes' bug: too few slopes
    p = 2 ** math.floor(math.log2(n_heads))
    return torch.tensor([2 ** (-max_bias * (h + 1) / p) for h in range(p)])


def slopes_geometric(n_heads, max_bias=8.0):  # 2^(-b h / H) for every H: not Press et al.'s rule
    return torch.tensor([2 ** (-max_bias * (h + 1) / n_heads) for h in range(n_heads)])


MPT_SLOPES = """\
def slopes_buggy(n_heads, max_bias=8.0):
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, _n_heads + 1, dtype=torch.float32)
    m = m.mul(max_bias / _n_heads)
    slopes = 1.0 / torch.pow(2, m)
    if _n_heads != n_heads:
        slopes = torch.concat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes
"""


def test_slopes_bug(tmp_path, monkeypatch):
    assert torch.equal(slopes_buggy(10), slopes_fixed(10)) and torch.equal(slopes_buggy(20, 4.0), slopes_fixed(20, 4.0))
    assert not torch.equal(slopes_buggy(12), slopes_fixed(12))  # right at some head counts, wrong at others
    checks.check("06-find-the-bug-1", slopes_fixed)
    checks.check("06-slopes-bug", slopes_fixed)  # the earlier id still grades
    assert graded("06-find-the-bug-1", slopes_fixed, tmp_path, monkeypatch) == "passed"
    for wrong in (slopes_buggy, slopes_consecutive, slopes_lesson_rule, slopes_only_power_of_two, slopes_geometric):
        refused("06-find-the-bug-1", wrong, tmp_path, monkeypatch, called=False)
    assert torch.equal(slopes_rewrite(12, 4.0), slopes_fixed(12, 4.0))
    assert "not the way" in refused("06-find-the-bug-1", slopes_rewrite, tmp_path, monkeypatch, called=False)
    # a floor-log2 by bit_length is a correct fix of line 2 (10 and 12 tokens): accepted
    for alt in ("2 ** (n_heads.bit_length() - 1)", "1 << (n_heads.bit_length() - 1)"):
        src = ch06.BUGGY_SLOPES.replace("2 ** round(math.log2(n_heads))", alt)
        fixed = cell_function(src.replace("def slopes_buggy(", "def slopes_bits("), "slopes_bits", {"torch": torch, "math": math})
        assert torch.equal(fixed(12, 4.0), slopes_fixed(12, 4.0))
        checks.check("06-find-the-bug-1", fixed)
    # MPT's gen_slopes transcribed under the given name: right values, 100+ tokens and other lines changed: refused
    mpt = cell_function(MPT_SLOPES, "slopes_buggy", {"torch": torch, "math": math})
    assert torch.allclose(mpt(12, 4.0), slopes_fixed(12, 4.0))
    assert "not the way" in refused("06-find-the-bug-1", mpt, tmp_path, monkeypatch, called=False)
    for route in (lambda h, b=8.0: alibi_slopes(h) ** (b / 8), lambda h, b=8.0: (-alibi_bias(h, 2)[:, 1, 0]) ** (b / 8),
                  lambda h, b=8.0: (-grouped_alibi_bias(h, 1, 2, 2)[0, :, 1, 0]) ** (b / 8),
                  ch06._slopes_reference):
        refused("06-find-the-bug-1", route, tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- 2. and 3. decode and grouped bias


def decode_alibi_bias(n_heads, q_len, k_len):
    rel = (torch.arange(k_len)[None, :] - torch.arange(k_len - q_len, k_len)[:, None]).float()
    return (alibi_slopes(n_heads)[:, None, None] * rel).masked_fill(rel > 0, float("-inf"))


def test_decode_bias(tmp_path, monkeypatch):
    checks.check("06-decode-bias", decode_alibi_bias)  # the slopes are a helper the learner may use
    assert graded("06-decode-bias", decode_alibi_bias, tmp_path, monkeypatch) == "passed"
    by_bias = lambda h, tq, tk: alibi_bias(h, tk)[:, tk - tq:].masked_fill(  # noqa: E731
        torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq).logical_not(), float("-inf"))
    by_bias_at = lambda h, tq, tk: alibi_bias_at(alibi_slopes(h), torch.arange(tk - tq, tk), torch.arange(tk))\
        .masked_fill(torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq).logical_not(), float("-inf"))  # noqa: E731
    for route in (by_bias, by_bias_at, ch06._shortcut_decode_bias):
        refused("06-decode-bias", route, tmp_path, monkeypatch)


def add_grouped_alibi(scores, n_heads):
    _, g, r, tq, tk = scores.shape
    slopes = alibi_slopes(n_heads).to(scores.dtype).reshape(g, r, 1, 1)
    rel = torch.arange(tk, dtype=scores.dtype)[None, :] - torch.arange(tk - tq, tk, dtype=scores.dtype)[:, None]
    return scores + slopes * rel


def test_grouped_alibi(tmp_path, monkeypatch):
    checks.check("06-grouped-alibi", add_grouped_alibi)
    by_bias = lambda s, h: s + alibi_bias(h, s.shape[-1])[:, -s.shape[-2]:].to(s.dtype).view(  # noqa: E731
        s.shape[1], s.shape[2], s.shape[-2], s.shape[-1])
    for route in (by_bias, lambda s, h: s + grouped_alibi_bias(h, s.shape[1], s.shape[-2], s.shape[-1]).to(s.dtype)):
        refused("06-grouped-alibi", route, tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- 5. and 6. RoPE


def rope_pairs(x, positions, base):
    d = x.shape[-1]
    angle = positions.double()[:, None, :, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    c, s = torch.cos(angle), torch.sin(angle)
    even, odd = x[..., 0::2].double(), x[..., 1::2].double()
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).to(x.dtype)


def rope_by_exp_1j(x, positions, base):  # complex numbers without view_as_complex, polar or complex
    d = x.shape[-1]
    rot = torch.exp(1j * positions.double()[:, None, :, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))
    z = (x[..., 0::2].double() + 1j * x[..., 1::2].double()) * rot
    return torch.stack([z.real, z.imag], dim=-1).flatten(-2).to(x.dtype)


def rope_by_halves(x, positions, base):  # the course's halves RoPE on permuted dims
    d = x.shape[-1]
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    return apply_rope(x[..., perm], positions[:, None], base=base)[..., perm.argsort()]


def test_rope_pairs(tmp_path, monkeypatch):
    checks.check("06-rope-pairs", rope_pairs)
    assert graded("06-rope-pairs", rope_pairs, tmp_path, monkeypatch) == "passed"
    for route in (rope_by_exp_1j, rope_by_halves, ch06._shortcut_rope_complex, ch06._shortcut_rope_pairs):
        refused("06-rope-pairs", route, tmp_path, monkeypatch)


def rope_by_complex_view(x, positions, base):  # the cold review's route: a dtype view and a complex scalar
    d = x.shape[-1]
    cdt = torch.complex128 if x.dtype == torch.float64 else torch.complex64
    ang = positions.to(x.dtype)[:, None, :, None] * base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    return (x.contiguous().view(cdt) * torch.exp(1j * ang)).view(x.dtype)


def rope_pairs_over_heads(x, positions, base):  # positions lined up with the heads, not the sequences: (B, T) as (H, T)
    d = x.shape[-1]
    angle = positions.double()[..., None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (B, T, D/2)
    c, s = torch.cos(angle), torch.sin(angle)
    even, odd = x[..., 0::2].double(), x[..., 1::2].double()
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).to(x.dtype)


def test_rope_pairs_positions_per_sequence():  # a batch with as many sequences as heads catches the broadcast
    with pytest.raises(Exception) as info:
        checks.check("06-rope-pairs", rope_pairs_over_heads)
    assert "called" not in str(info.value)


def test_rope_pairs_refuses_complex_dtype_view(tmp_path, monkeypatch):
    refused("06-rope-pairs", rope_by_complex_view, tmp_path, monkeypatch)


def pairs_to_halves_weight(w, n_heads):
    d = w.shape[0] // n_heads
    return w.view(n_heads, d // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def test_rope_convert(tmp_path, monkeypatch):
    checks.check("06-rope-convert", pairs_to_halves_weight)
    by_library = lambda w, h: w.view(h, -1, w.shape[1])[:, rope_permutation(w.shape[0] // h)].reshape(w.shape)  # noqa
    refused("06-rope-convert", by_library, tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- 7. encoder ALiBi (bug)


# the minimal fix: the keys after the query get minus the decoder's bias, on the given function's last line
encoder_alibi_bias = cell_function(ch06.BUGGY_ENCODER.replace("before.flip(-1)", "-before")
                                   .replace("def encoder_alibi_buggy(", "def encoder_alibi_bias("),
                                   "encoder_alibi_bias", {"torch": torch, "alibi_slopes": alibi_slopes})


def encoder_rewrite(n_heads, seq_len):  # the bias written afresh from its formula: no diagnosis
    pos = torch.arange(seq_len)
    return -alibi_slopes(n_heads)[:, None, None] * (pos[None, :] - pos[:, None]).abs().float()


def test_encoder_alibi(tmp_path, monkeypatch):
    checks.check("06-find-the-bug-2", encoder_alibi_bias)
    checks.check("06-encoder-alibi", encoder_alibi_bias)  # the earlier id still grades
    assert graded("06-find-the-bug-2", encoder_alibi_bias, tmp_path, monkeypatch) == "passed"
    refused("06-find-the-bug-2", lambda h, t: alibi_bias(h, t), tmp_path, monkeypatch)  # the decoder's bias
    assert "not the way" in refused("06-find-the-bug-2", encoder_rewrite, tmp_path, monkeypatch, called=False)

    def buggy(n_heads, seq_len):  # the notebook's: right on the middle query and the last one only
        pos = torch.arange(seq_len)
        signed = (pos[None, :] - pos[:, None]).float()
        before = alibi_slopes(n_heads)[:, None, None] * signed
        return torch.where(signed <= 0, before, before.flip(-1))

    with pytest.raises(checks.CheckFailed):
        checks.check("06-find-the-bug-2", buggy)
    # transposing the last two axes gives m_h (i - j) after the query, the right bias: accepted in every spelling
    for alt in ("before.transpose(-2, -1)", "before.mT", "before.neg()", "before.swapaxes(1, 2)"):
        src = ch06.BUGGY_ENCODER.replace("before.flip(-1)", alt).replace("def encoder_alibi_buggy(", "def enc_t(")
        fixed = cell_function(src, "enc_t", {"torch": torch, "alibi_slopes": alibi_slopes})
        checks.check("06-find-the-bug-2", fixed)
    assert graded("06-find-the-bug-2", fixed, tmp_path, monkeypatch) == "passed"
    # the stated distance put on line 3, `signed = -(j - i).abs()`, is a right fix too (the flip is then never
    # taken): accepted (review 13); a rewrite of line 3 that needs more than 8 tokens is still not an edit
    src = ch06.BUGGY_ENCODER.replace("signed = (pos[None, :] - pos[:, None]).float()",
                                     "signed = -(pos[None, :] - pos[:, None]).float().abs()")
    by_abs = cell_function(src.replace("def encoder_alibi_buggy(", "def enc_abs("), "enc_abs",
                           {"torch": torch, "alibi_slopes": alibi_slopes})
    checks.check("06-find-the-bug-2", by_abs)
    assert graded("06-find-the-bug-2", by_abs, tmp_path, monkeypatch) == "passed"
    half = cell_function(src.replace("-(pos[None, :]", "(pos[None, :]").replace("def encoder_alibi_buggy(",
                                                                                  "def enc_half("),
                         "enc_half", {"torch": torch, "alibi_slopes": alibi_slopes})  # |j - i| without the sign
    with pytest.raises(checks.CheckFailed):
        checks.check("06-find-the-bug-2", half)
    for route in (lambda h, t: -alibi_bias(h, t).abs(),
                  lambda h, t: -alibi_bias_at(alibi_slopes(h), torch.arange(t), torch.arange(t)).abs(),
                  ch06._encoder_bias_reference):
        refused("06-find-the-bug-2", route, tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- 8. experiment


def rope_similarity(seed, base):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(512, 64, generator=gen, dtype=torch.float64)
    out = [((apply_rope(q[:, None], torch.tensor([m]), base=base)[:, 0] * q).sum(-1) / (q * q).sum(-1)).mean()
           for m in ch06.ROPE_DISTANCES]
    return torch.stack(out)


def rope_closed_form(seed, base):  # the expectation over Gaussian vectors, no measurement
    theta = base ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    return torch.stack([torch.cos(m * theta).mean() for m in ch06.ROPE_DISTANCES])


def test_rope_decay(tmp_path, monkeypatch):
    checks.check("06-rope-decay", rope_similarity)
    assert graded("06-rope-decay", rope_similarity, tmp_path, monkeypatch) == "passed"
    refused("06-rope-decay", ch06.rope_similarity_reference, tmp_path, monkeypatch)
    refused("06-rope-decay", rope_closed_form, tmp_path, monkeypatch, called=False)


# ----------------------------------------------------------------------------- 4. predict a weight, as a rule


def slope_rule(n_heads, head):
    closest = 2 ** math.floor(math.log2(n_heads))
    if head < closest:
        return 2 ** (-8 * (head + 1) / closest)
    return 2 ** (-8 * (2 * (head - closest) + 1) / (2 * closest))  # every other slope of twice as many heads


def predicted_weight(n_heads, head, query, key):
    r = math.exp(-slope_rule(n_heads, head))
    return r ** (query - key) * (1 - r) / (1 - r ** (query + 1))


def weight_geometric_slopes(n_heads, head, query, key):  # 2^(-8 (h + 1) / H) for every H: right for powers of two
    r = math.exp(-(2 ** (-8 * (head + 1) / n_heads)))
    return r ** (query - key) * (1 - r) / (1 - r ** (query + 1))


def weight_unnormalised(n_heads, head, query, key):  # exp of the bias, the softmax's sum forgotten
    return math.exp(-slope_rule(n_heads, head) * (query - key))


def weight_wrong_sign(n_heads, head, query, key):  # the far keys favoured
    return predicted_weight(n_heads, head, query, query - key)


def test_predict_bias_is_a_rule(tmp_path, monkeypatch):
    from test_salting import SALT, _grader as salted_grader

    ex = checks.get("06-predict-bias")
    checks.check("06-predict-bias", predicted_weight)
    assert graded("06-predict-bias", predicted_weight, tmp_path, monkeypatch) == "passed"
    assert salted_grader(ex, predicted_weight, SALT, tmp_path, monkeypatch)[0] == "passed"
    for case in ex.make_cases():  # the reference is the lesson's softmax of the lesson's bias
        h, hd, q, k = case.args
        assert math.isclose(case.expected, predicted_weight(h, hd, q, k), rel_tol=1e-5)
    assert max(c.args[2] for c in ex.make_cases()) >= 10 ** 9  # a row no softmax key by key gets through

    def package(n_heads, head, query, key):
        return torch.softmax(alibi_bias(n_heads, query + 1)[head, query], -1)[key].item()

    def package_slopes(n_heads, head, query, key):
        r = math.exp(-alibi_slopes(n_heads)[head].item())
        return r ** (query - key) * (1 - r) / (1 - r ** (query + 1))

    def tensor_rule(n_heads, head, query, key):  # the right rule, in tensor arithmetic: no tensor op may run
        return float(torch.tensor(predicted_weight(n_heads, head, query, key)))

    for route in (package, package_slopes, ch06.weight_entry_reference, tensor_rule):
        refused("06-predict-bias", route, tmp_path, monkeypatch)
    named = {args: predicted_weight(*args) for args in ((8, 0, 3, 3), (8, 7, 5, 2), (12, 8, 4, 0))}
    table = lambda n_heads, head, query, key: named.get((n_heads, head, query, key), 0.5)  # noqa: E731
    for wrong in (table, weight_geometric_slopes, weight_unnormalised, weight_wrong_sign):
        with pytest.raises(checks.CheckFailed, match="prediction is not right") as info:
            checks.check("06-predict-bias", wrong)
        assert not any(f"{c.expected:.4g}" in str(info.value) for c in ex.make_cases()), str(info.value)
    assert salted_grader(ex, table, SALT, tmp_path, monkeypatch)[0] in ("failed", "error")
