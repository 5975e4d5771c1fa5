"""Exercise 05-mla-absorbed-decode: right spellings of the absorbed step pass; the course's module (absorbed path
included) is refused by the check cell and the grader; an expanded cache, a broadcast over the heads and a loop over
the heads are refused by the property, each for its own reason. The reference is the expanded module."""

from __future__ import annotations

import math

import pytest
import torch

from attncourse.classroom import checks
from attncourse.classroom.checks import ch05_mla
from test_ch04_checks import graded, refused
from test_exercise_standard import as_learner

ID = "05-mla-absorbed-decode"


def absorbed_einsum(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):
    dn, dr = q_nope.shape[-1], q_rope.shape[-1]
    q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
    s = torch.einsum("bhr,bsr->bhs", q_lat, c_kv) + torch.einsum("bhe,bse->bhs", q_rope, k_rope)
    w = torch.softmax(s / math.sqrt(dn + dr), -1)
    return torch.einsum("bhr,hdr->bhd", torch.einsum("bhs,bsr->bhr", w, c_kv), w_uv)


def absorbed_one_key(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):  # [latent, RoPE key] as MQA's one key (one cat)
    dn, dr = q_nope.shape[-1], q_rope.shape[-1]
    q = torch.cat([torch.einsum("bhd,hdr->bhr", q_nope, w_uk), q_rope], -1)  # (B, H, r + dr)
    w = torch.softmax(q @ torch.cat([c_kv, k_rope], -1).transpose(1, 2) / math.sqrt(dn + dr), -1)
    return torch.einsum("bhr,hdr->bhd", w @ c_kv, w_uv)


def absorbed_batch_loop(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):  # one sequence at a time: still one read
    dn, dr = q_nope.shape[-1], q_rope.shape[-1]
    outs = []
    for b in range(q_nope.shape[0]):
        q_lat = torch.bmm(q_nope[b][:, None], w_uk)[:, 0]  # (H, r)
        w = torch.softmax((q_lat @ c_kv[b].T + q_rope[b] @ k_rope[b].T) / math.sqrt(dn + dr), -1)
        outs.append(torch.bmm((w @ c_kv[b])[:, None], w_uv.transpose(1, 2))[:, 0])
    return torch.stack(outs)


def test_reference_is_the_expanded_module_and_equals_the_absorbed_one():
    gen = torch.Generator().manual_seed(0)
    mla = ch05_mla._module(gen, 8, 16, 6, 12)
    x = torch.randn(2, 20, 96, generator=gen, dtype=torch.float64)
    args, expected = ch05_mla.decode_step_reference(mla, x)
    with torch.no_grad():
        full = mla(x, is_causal=True, absorbed=True)[:, -1].view(2, 8, 12)  # no cache, absorbed, last token
    torch.testing.assert_close(expected, full, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(absorbed_einsum(*args), expected, rtol=1e-5, atol=1e-7)


def test_right_spellings_pass(tmp_path, monkeypatch):
    for answer in (absorbed_einsum, absorbed_one_key, absorbed_batch_loop):
        checks.check(ID, answer)
    assert graded(ID, absorbed_einsum, tmp_path, monkeypatch) == "passed"


def test_course_module_refused(tmp_path, monkeypatch):
    msg = refused(ID, as_learner(ch05_mla._shortcut_module), tmp_path, monkeypatch)
    assert "MultiHeadLatentAttention" in msg


@pytest.mark.parametrize("breaker, reason", [(ch05_mla._breaker_expanded, "times the cache"),
                                             (ch05_mla._breaker_broadcast, "times the cache"),
                                             (ch05_mla._breaker_head_loop, "once per head")])
def test_property_refuses(breaker, reason):
    with pytest.raises(checks.CheckFailed) as info:
        checks.check(ID, as_learner(breaker))
    assert "right result" in str(info.value) and reason in str(info.value), str(info.value)


def test_property_counts_the_expansion_alone():
    """The multiply-add rule on its own refuses keys expanded from the cache, even where no tensor is large."""
    ex = checks.get(ID)
    case = ex.make_cases()[0]
    b, h, dn, dr, s, r = ch05_mla._sizes(case)
    small = [("aten::bmm", False, False, [(None, 0, (b * h, 1, r), (r, r, 1)), (None, 0, (b * h, r, dn * s // 8), (1, 1, 1))])]
    run = checks.Run(case, None, {"ops": small * 8})
    assert "multiply-adds" in ch05_mla._cache_read_once([run])
