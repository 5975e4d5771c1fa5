"""Chapter 03's exercise 6 (QK-norm logits) can fail: a library normalisation, the check's own reference, a missing
normalisation, an L2 norm without the sqrt(d), a detached RMS (wrong gradients) are refused, and so is every library
norm under each of its spellings (ATen's rms_norm, native_layer_norm on [q, -q], group and batch norm); the reference equals the
course's qk_norm_attention; a learner's answer passes in the check cell and the grader. Also: exercise 3's refusal
names the rule, not NumPy alone (forbidden.WORDS["rule"])."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attncourse import sink_fixes
from attncourse.classroom import checks
from attncourse.classroom.checks import ch03_qknorm
from test_ch04_checks import graded

ID = "03-qk-norm-logits"


def qk_norm_logits(q, k, g_q, g_k):
    q_hat = g_q * q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
    k_hat = g_k * k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)
    return q_hat @ k_hat.transpose(-2, -1) / math.sqrt(q.shape[-1])


def by_rms_norm(q, k, g_q, g_k):
    d = q.shape[-1]
    return F.rms_norm(q, (d,), g_q, 1e-6) @ F.rms_norm(k, (d,), g_k, 1e-6).mT / math.sqrt(d)


def by_module(q, k, g_q, g_k):
    n = torch.nn.RMSNorm(q.shape[-1], eps=1e-6).to(q.dtype)
    with torch.no_grad():
        n.weight.copy_(g_q)
    return n(q) @ (g_k * k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)).mT / math.sqrt(q.shape[-1])


def by_reference(q, k, g_q, g_k):
    return ch03_qknorm.reference_logits(q, k, g_q, g_k)


def no_norm(q, k, g_q, g_k):  # the plain logits with gains: grow with the weights
    return (g_q * q) @ (g_k * k).mT / math.sqrt(q.shape[-1])


def l2_without_sqrt_d(q, k, g_q, g_k):  # unit L2 norm instead of unit RMS: logits sqrt(d)^2 too small
    return (g_q * q / q.norm(dim=-1, keepdim=True)) @ (g_k * k / k.norm(dim=-1, keepdim=True)).mT / math.sqrt(
        q.shape[-1])


def detached_rms(q, k, g_q, g_k):  # right values, wrong gradients
    r_q = torch.sqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6).detach()
    r_k = torch.sqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6).detach()
    return (g_q * q / r_q) @ (g_k * k / r_k).mT / math.sqrt(q.shape[-1])


def test_qk_norm_logits(tmp_path, monkeypatch):
    checks.check(ID, qk_norm_logits)
    assert graded(ID, qk_norm_logits, tmp_path, monkeypatch) == "passed"
    for route in (by_rms_norm, by_module, by_reference):
        with pytest.raises(checks.CheckFailed, match="called"):
            checks.check(ID, route)
    for wrong in (no_norm, l2_without_sqrt_d, detached_rms):
        with pytest.raises(checks.CheckFailed, match="differ"):
            checks.check(ID, wrong)


def test_reference_is_the_course_qk_norm_and_bounded():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64) * 100 for _ in range(3))
    g, h = (torch.rand(8, generator=gen, dtype=torch.float64) + 0.5 for _ in range(2))
    logits = ch03_qknorm.reference_logits(q, k, g, h)
    torch.testing.assert_close(torch.softmax(logits, -1) @ v, sink_fixes.qk_norm_attention(q, k, v, g, h))
    assert logits.abs().max() <= ch03_qknorm.logit_bound(8, g, h)


def test_predict_shapes_refusal_names_the_rule():
    def by_numpy(q_shape, k_shape, v_shape, mask_shape):
        import numpy as np
        lead = np.broadcast_shapes(tuple(q_shape[:-2]), tuple(k_shape[:-2]))
        s = (*lead, q_shape[-2], k_shape[-2])
        w = np.broadcast_shapes(s, tuple(mask_shape))
        return s, w, (*w[:-1], v_shape[-1])

    def by_meta(q_shape, k_shape, v_shape, mask_shape):
        q, k, v, m = (torch.empty(s, device="meta") for s in (q_shape, k_shape, v_shape, mask_shape))
        s = q @ k.mT
        return tuple(s.shape), tuple((s + m).shape), tuple(((s + m) @ v).shape)

    for route in (by_numpy, by_meta):
        with pytest.raises(checks.CheckFailed) as info:
            checks.check("03-predict-shapes", route)
        assert "a rule in plain Python" in str(info.value) and "NumPy alone" not in str(info.value)


def _rms_by(norm):
    """QK-norm logits with `norm(x, d)` -> x / rms(x) over the last axis (a library route)."""
    def route(q, k, g_q, g_k):
        d = q.shape[-1]
        return (g_q * norm(q, d)) @ (g_k * norm(k, d)).mT / math.sqrt(d)
    return route


def _mirror(x):  # [x, -x] has mean 0 and the RMS of x: a mean-subtracting norm of it is x's RMS norm
    return torch.cat([x, -x], -1)


NORM_ROUTES = {
    "aten.rms_norm": lambda x, d: torch.ops.aten.rms_norm(x, [d], None, 1e-6),
    "aten._fused_rms_norm": lambda x, d: torch.ops.aten._fused_rms_norm(x, [d], None, 1e-6)[0],
    "torch.rms_norm": lambda x, d: torch.rms_norm(x, [d], None, 1e-6),
    "F.rms_norm": lambda x, d: F.rms_norm(x, (d,), eps=1e-6),
    "nn.RMSNorm": lambda x, d: torch.nn.RMSNorm(d, eps=1e-6, elementwise_affine=False)(x),
    "torch.native_layer_norm": lambda x, d: torch.native_layer_norm(_mirror(x), [2 * d], None, None, 1e-6)[0][..., :d],
    "aten.native_layer_norm": lambda x, d: torch.ops.aten.native_layer_norm(_mirror(x), [2 * d], None, None,
                                                                             1e-6)[0][..., :d],
    "torch.layer_norm": lambda x, d: torch.layer_norm(_mirror(x), [2 * d], eps=1e-6)[..., :d],
    "nn.LayerNorm": lambda x, d: torch.nn.LayerNorm(2 * d, eps=1e-6, elementwise_affine=False).to(x.dtype)(
        _mirror(x))[..., :d],
    "group_norm": lambda x, d: torch.group_norm(_mirror(x).reshape(-1, 1, 2 * d), 1, eps=1e-6).reshape(
        *x.shape[:-1], 2 * d)[..., :d],
    "batch_norm": lambda x, d: torch.batch_norm(_mirror(x).reshape(-1, 2 * d).mT, None, None, None, None, True, 0.,
                                                1e-6, False).mT.reshape(*x.shape[:-1], 2 * d)[..., :d],
}


@pytest.mark.parametrize("name", sorted(NORM_ROUTES))
def test_library_norms_refused_under_every_spelling(name):
    route = _rms_by(NORM_ROUTES[name])
    q = torch.randn(2, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(route(q, q, torch.ones(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)),
                               qk_norm_logits(q, q, *(torch.ones(8, dtype=torch.float64),) * 2), rtol=1e-5,
                               atol=1e-5)  # the route is right: only the guard stops it
    with pytest.raises(checks.CheckFailed, match="called"):
        checks.check(ID, route)


def test_aten_rms_norm_refused_by_the_grader(tmp_path, monkeypatch):
    assert graded(ID, _rms_by(NORM_ROUTES["aten.rms_norm"]), tmp_path, monkeypatch) != "passed"
