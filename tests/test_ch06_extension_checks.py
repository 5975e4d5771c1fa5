"""Chapter 06's context-extension exercises (9: YaRN's frequencies, 10: the passkey by parts) can fail: the course's
rope_inv_freq and scalings, the checks' references and copies of them (edited too) are refused by the check cell
and by the grader; the paper's ramp, the ramp without rounding and Llama 3.1's rule are wrong; a typed share or a
rule of (kept, distance) is not a measurement; right answers pass."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from attncourse.classroom import checks
from attncourse.classroom.checks import ch06_extension as ext
from attncourse import positions
from attncourse.positions import rope_inv_freq
from test_ch04_checks import graded, refused

# ----------------------------------------------------------------------------- 9. YaRN's frequencies


def yarn_inv_freq(head_dim, base, factor, original_max, beta_fast=32.0, beta_slow=1.0):
    theta = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    def pair_with(turns):
        return head_dim * math.log(original_max / (2 * math.pi * turns)) / (2 * math.log(base))

    lo, hi = max(math.floor(pair_with(beta_fast)), 0), min(math.ceil(pair_with(beta_slow)), head_dim - 1)
    hi = hi + 0.001 if hi == lo else hi
    gamma = ((torch.arange(head_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    return (1 - gamma) * theta + gamma * theta / factor


def yarn_paper_ramp(head_dim, base, factor, original_max, beta_fast=32.0, beta_slow=1.0):  # ramp in turns
    theta = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    keep = ((original_max * theta / (2 * math.pi) - beta_slow) / (beta_fast - beta_slow)).clamp(0, 1)
    return keep * theta + (1 - keep) * theta / factor


def yarn_unrounded(head_dim, base, factor, original_max, beta_fast=32.0, beta_slow=1.0):  # truncate=False
    theta = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    pair = lambda t: head_dim * math.log(original_max / (2 * math.pi * t)) / (2 * math.log(base))  # noqa: E731
    lo, hi = max(pair(beta_fast), 0), min(pair(beta_slow), head_dim - 1)
    gamma = ((torch.arange(head_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    return (1 - gamma) * theta + gamma * theta / factor


def yarn_as_llama3(head_dim, base, factor, original_max, beta_fast=32.0, beta_slow=1.0):  # the other by-parts rule
    theta = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    a = ((original_max * theta / (2 * math.pi) - 1) / (4 - 1)).clamp(0, 1)
    return (1 - a) * theta / factor + a * theta


def yarn_by_course(head_dim, base, factor, original_max, beta_fast=32.0, beta_slow=1.0):
    return rope_inv_freq(head_dim, base, scaling={"type": "yarn", "factor": factor, "original_max_position": original_max,
                                                  "beta_fast": beta_fast, "beta_slow": beta_slow})


def _edited_copy(fn, name):
    """`fn`'s source run afresh under a new name, its docstring dropped: still a copy of the course's code."""
    source = inspect.getsource(fn).replace(f"def {fn.__name__}(", f"def {name}(")
    source = source.replace('"""Hugging Face transformers\' ``_compute_yarn_parameters``', '"""x')
    namespace = {"torch": torch, "math": math}
    exec(compile(source, "<cell>", "exec"), namespace)
    return namespace[name]


def test_yarn_right_answer_passes(tmp_path, monkeypatch):
    checks.check("06-yarn-frequencies", yarn_inv_freq)
    assert graded("06-yarn-frequencies", yarn_inv_freq, tmp_path, monkeypatch) == "passed"


@pytest.mark.parametrize("route", [yarn_by_course, ext._yarn_by_course, ext._yarn_by_scalings, ext.yarn_reference,
                                   ext._hf_yarn_inv_freq])
def test_yarn_course_routes_refused(route, tmp_path, monkeypatch):
    refused("06-yarn-frequencies", route, tmp_path, monkeypatch)


def test_yarn_copies_refused(tmp_path, monkeypatch):
    refused("06-yarn-frequencies", _edited_copy(ext._hf_yarn_inv_freq, "my_yarn"), tmp_path, monkeypatch)


def _ramp_copy(keep_checks):
    """positions.yarn_ramp transcribed (review 13: a copy of rope_inv_freq's YaRN branch passed), locals renamed,
    its input checks kept or deleted, called by an answer of the exercise's signature."""
    source = inspect.getsource(positions.yarn_ramp)
    body = source[source.index("    def dim_for"):]
    if keep_checks:
        body = source[source.index("    _validate"):]
    source = "def ramp(d, b, n, bf=32.0, bs=1.0):\n" + body
    for old, new in (("head_dim", "d"), ("original_max", "n"), ("beta_fast", "bf"), ("beta_slow", "bs"),
                     ("base", "b"), ("dim_for", "where"), ("n_turns", "t"), ("low", "lo"), ("high", "hi")):
        source = source.replace(old, new)
    namespace = {"torch": torch, "math": math, "_validate": positions._validate,
                 "_check_positive_numbers": positions._check_positive_numbers}
    exec(compile(source, "<cell>", "exec"), namespace)
    ramp = namespace["ramp"]

    def yarn_from_ramp(head_dim, base, factor, original_max, beta_fast=32.0, beta_slow=1.0):
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        g = ramp(head_dim, base, original_max, beta_fast, beta_slow)
        return inv * (1 - g) + inv / factor * g
    return yarn_from_ramp


@pytest.mark.parametrize("keep_checks", [True, False])
def test_yarn_ramp_copies_refused(keep_checks, tmp_path, monkeypatch):
    msg = refused("06-yarn-frequencies", _ramp_copy(keep_checks), tmp_path, monkeypatch)
    assert "yarn_ramp" in msg or "_validate" in msg


@pytest.mark.parametrize("wrong", [yarn_paper_ramp, yarn_unrounded, yarn_as_llama3])
def test_yarn_misconceptions_fail(wrong):
    with pytest.raises(checks.CheckFailed) as info:
        checks.check("06-yarn-frequencies", wrong)
    assert "called" not in str(info.value)


def test_yarn_reference_is_hugging_face():  # the two references agree on every configuration
    for cfg in ext.YARN_CONFIGS:
        torch.testing.assert_close(ext.yarn_reference(*cfg), ext._hf_yarn_inv_freq(*cfg))


# ----------------------------------------------------------------------------- 10. the passkey, by parts


def by_parts_accuracy(seed, kept, distance, window_seed):
    from attncourse.char_lm import char_lm, shakespeare_chars
    from attncourse.ctx_extension import PASSKEY_WEIGHTS, PLAY_TEXT, key_logits, passkey_windows
    _, held, vocab = shakespeare_chars(PLAY_TEXT)
    model = char_lm(len(vocab) + 11, 0)
    model.load_state_dict({k: v.float() for k, v in torch.load(PASSKEY_WEIGHTS, weights_only=True)["state"][seed].items()})
    model.eval()
    freqs = rope_inv_freq(16).clone()
    freqs[kept:] /= 4
    for block in model.blocks:
        block.attn.inv_freq = freqs
    windows = passkey_windows(held, 16, 256, len(vocab), torch.Generator().manual_seed(window_seed), distance)
    with torch.no_grad():
        return (key_logits(model, windows).argmax(-1) == windows[:, -4:]).float().mean().item()


def by_parts_rule(seed, kept, distance, window_seed):  # read off the lesson and the table: no measurement
    return 1.0 if 1 <= kept <= 3 else 0.45


def by_parts_measure(seed, kept, distance, window_seed):  # the lesson's measure (not allowed) in place of the count
    from attncourse import ctx_extension as cx
    from attncourse.char_lm import char_lm, shakespeare_chars
    _, held, vocab = shakespeare_chars(cx.PLAY_TEXT)
    model = char_lm(len(vocab) + 11, 0)
    model.load_state_dict({k: v.float() for k, v in torch.load(cx.PASSKEY_WEIGHTS, weights_only=True)["state"][seed].items()})
    freqs = rope_inv_freq(16).clone()
    freqs[kept:] /= 4
    for block in model.eval().blocks:
        block.attn.inv_freq = freqs
    sets = {distance: cx.passkey_windows(held, 16, 256, len(vocab), torch.Generator().manual_seed(window_seed), distance),
            "text": torch.zeros(1, 257, dtype=torch.long)}
    return cx.measure(model, sets)["key_acc"][0]


def test_passkey_by_parts(tmp_path, monkeypatch):
    checks.check("06-passkey-by-parts", by_parts_accuracy)
    refused("06-passkey-by-parts", ext.by_parts_accuracy_reference, tmp_path, monkeypatch)
    for typed in (by_parts_rule,):
        with pytest.raises(checks.CheckFailed) as info:
            checks.check("06-passkey-by-parts", typed)
        assert "called" not in str(info.value) and "off by" in str(info.value)


def test_passkey_measure_refused():
    with pytest.raises(checks.CheckFailed, match="called"):
        checks.check("06-passkey-by-parts", by_parts_measure)


# ----------------------------------------------------------------------------- ABF in the passkey harness


def test_set_base_is_abf():
    from attncourse import ctx_extension as cx
    from attncourse.char_lm import char_lm
    model = char_lm(72, 0)
    model.set_rope_scaling({"type": "yarn", "factor": 4, "original_max_position": 64})
    cx.set_base(model, cx.ABF_BASE)
    for block in model.blocks:  # the base raised, the rescaling and YaRN's logit factor gone
        torch.testing.assert_close(block.attn.inv_freq, rope_inv_freq(16, cx.ABF_BASE))
        assert block.attn.rope_factor == 1.0 and block.attn.rope_scaling is None
    with pytest.raises(ValueError, match="base"):
        cx.set_base(model, 0.5)


def test_an_exec_copy_of_rope_inv_freq_without_its_checks_or_future_import_is_refused():
    """The course's rope_inv_freq, its validation lines deleted, exec'd where `from __future__ import annotations`
    is off (its nested def's annotations then compile to other bytecode), under a new name: still its copy."""
    lines, keep, skip = inspect.getsource(rope_inv_freq).splitlines(), [], False
    for line in lines:
        text = line.strip()
        if skip:
            skip = False
            continue
        if text.startswith("_validate.") or "check_rope_scaling" in text:
            continue
        if text.startswith(("if head_dim % 2", "if isinstance(base, bool)")):
            skip = True
            continue
        keep.append(line)
    namespace = {"torch": torch, "math": math}
    source = "\n".join(keep).replace("def rope_inv_freq", "def my_freqs")
    exec(compile(source, "<cell>", "exec", dont_inherit=True), namespace)  # not this file's __future__ import

    def yarn_inv_freq(head_dim, base, factor, original_max, beta_fast=32.0, beta_slow=1.0):
        return namespace["my_freqs"](head_dim, base, scaling={"type": "yarn", "factor": factor,
                                                              "original_max_position": original_max,
                                                              "beta_fast": beta_fast, "beta_slow": beta_slow})
    with pytest.raises(checks.CheckFailed, match="copy of attncourse.positions.rope_inv_freq"):
        checks.check("06-yarn-frequencies", yarn_inv_freq)
