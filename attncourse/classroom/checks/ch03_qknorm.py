"""Chapter 03, exercise 6: the logits of QK-norm attention (solutions/03_scaled_dot_product_attention.ipynb).

The lesson's largest part is about logits that grow during training and what bounds them; this exercise has the
learner write the QK-norm logits and checks them against a reference written here (and, in tests, against the
course's ``sink_fixes.qk_norm_attention``) on inputs whose size grows a thousandfold, where the logits must not."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Case, exercise, forbidden

EPS = 1e-6
_FORBID = ("torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.rms_norm", "torch.rms_norm",
           "torch.nn.RMSNorm", "torch.nn.functional.normalize", "torch.nn.functional.layer_norm")
# Library normalisations refused by operator, under every spelling (torch.ops.aten.rms_norm, torch.native_layer_norm,
# a module's forward): RMS norm itself, and the mean-subtracting norms, which give the RMS norm of [q, -q].
_NORM_OPS = tuple(f"aten::{n}" for n in ("rms_norm", "_fused_rms_norm", "layer_norm", "native_layer_norm",
                                         "group_norm", "native_group_norm", "batch_norm", "native_batch_norm",
                                         "_native_batch_norm_legit", "_batch_norm_impl_index", "instance_norm"))


def reference_logits(q, k, g_q, g_k):
    """QK-norm's logits: each query and key RMS-normalised over its last axis (eps inside the root), times its gain,
    then the scaled dot product q_hat . k_hat / sqrt(d): (..., Tq, d), (..., Tk, d), (d,), (d,) -> (..., Tq, Tk)."""
    q_hat = g_q * q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + EPS)   # (..., Tq, d): unit RMS, then gains
    k_hat = g_k * k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + EPS)   # (..., Tk, d)
    return q_hat @ k_hat.transpose(-2, -1) * q.shape[-1] ** -0.5            # (..., Tq, Tk)


def logit_bound(d: int, g_q: torch.Tensor, g_k: torch.Tensor) -> float:
    """|logit| <= sqrt(d) max|g_q| max|g_k| (Cauchy-Schwarz on two vectors of RMS at most max|g|)."""
    return d ** 0.5 * float(g_q.abs().max()) * float(g_k.abs().max())


def _by_rms_norm(q, k, g_q, g_k):
    d = q.shape[-1]
    return F.rms_norm(q, (d,), g_q, EPS) @ F.rms_norm(k, (d,), g_k, EPS).transpose(-2, -1) * d ** -0.5


@exercise("03-qk-norm-logits", "qk_norm_logits", points=2, category="implement", forbid=_FORBID, allow=(),
          ops=("attention", "softmax", *_NORM_OPS), shortcuts=(_by_rms_norm,),
          prop_doc="output equality is the property: the logits equal a reference on queries and keys up to 1000 "
                   "times larger, where they must not grow, and so do their gradients with respect to q, k and "
                   "both gains (a normalisation outside autograd fails there); library norms are refused",
          hint="normalise each query and each key by its own root-mean-square over the last axis (the mean of the "
               "squares, plus eps, under the square root), multiply by the gains, then take the scaled dot product "
               "of every query with every key")
def _qk_norm_logits():
    """The logits of QK-norm attention, bounded whatever the size of the queries and keys."""
    gen = torch.Generator().manual_seed(36)
    cases = []
    q = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, 6, 8, generator=gen, dtype=torch.float64)
    g_q, g_k = (0.5 + torch.rand(8, generator=gen, dtype=torch.float64) for _ in range(2))
    for name, s in (("(2, 3, 5, 8) queries over 6 keys, gains in [0.5, 1.5]", 1.0),
                    ("the same queries and keys 30 times larger (as weights grow in training)", 30.0),
                    ("the same queries and keys 1000 times larger", 1000.0)):
        cases.append(Case(name, (q * s, k * s, g_q, g_k), expected=reference_logits(q * s, k * s, g_q, g_k),
                          rtol=1e-9, atol=1e-9))
    g_big = torch.randn(16, generator=gen, dtype=torch.float64) * 3                      # signs, large gains
    q2, k2 = (torch.randn(4, 7, 16, generator=gen, dtype=torch.float64) * 50 for _ in range(2))
    q2[1, 2] = 0.0                                                                        # a zero query: eps
    k2[3, 0, :8] = 0.0                                                                    # a key zero in half its axis
    cases.append(Case("(4, 7, 16), gains of both signs up to about 9, a zero query", (q2, k2, g_big, g_big.flip(0)),
                      expected=reference_logits(q2, k2, g_big, g_big.flip(0)), rtol=1e-9, atol=1e-9))
    q3, k3 = (torch.randn(3, 9, 32, generator=gen) * 4 for _ in range(2))                 # float32
    g3, h3 = torch.ones(32), torch.linspace(0.5, 2.0, 32)
    cases.append(Case("float32, (3, 9, 32), one set of gains at 1", (q3, k3, g3, h3),
                      expected=reference_logits(q3, k3, g3, h3), rtol=1e-5, atol=1e-5))
    # training differentiates the logits: gradients of q, k and both gains for one fixed upstream gradient
    leaves = [x.detach().clone().requires_grad_() for x in (q * 30, k * 30, g_q, g_k)]
    cases.append(Case("the backward pass: gradients of q, k, g_q and g_k (queries and keys 30 times larger)",
                      tuple(x.detach() for x in leaves), kwargs={forbidden.BACKWARD: True},
                      expected=forbidden.with_gradients(reference_logits(*leaves), leaves), rtol=1e-8, atol=1e-10))
    return cases
