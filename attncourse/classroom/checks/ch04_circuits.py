"""Chapter 04, exercise 7: a head is its two circuits (solutions/04_multi_head_attention.ipynb).

The lesson's headline algebra: head h of a layer computes softmax(X W^Q_h W^K_h^T C^T / sqrt(D)) C W^V_h W^O_h, so
only the two d x d products, the QK and the OV circuit (Elhage et al. 2021), are the function; the four factors are
not. The exercise has the learner rewrite a layer's weights so that every head's key and value maps have orthonormal
rows (a canonical form), without changing any head's circuits. The check judges the answer by structure: each head's
rows of the returned key and value weights are orthonormal, and each head's QK and OV circuits equal the original
layer's. Running attention is refused (the answer does not need it), and so is the course's module: reading the
circuits off the layer's behaviour, then factoring them, skips the algebra the exercise is about."""

from __future__ import annotations

import functools
import math

import torch

from attncourse.mha import MultiHeadAttention
from . import Case, exercise

_FORBID = ("torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.multi_head_attention_forward",
           "torch.nn.MultiheadAttention", "attncourse.mha.MultiHeadAttention")


def circuits(w_q, w_k, w_v, w_o, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's QK and OV circuit, (H, d, d) each, from nn.Linear (out, in) weights: head h owns rows
    h*D .. h*D+D-1 of w_q, w_k, w_v and the same columns of w_o; x @ qk[h] @ c.T / sqrt(D) are its logits and
    weights @ c @ ov[h] its write into the output."""
    d = w_q.shape[0]
    rows = [slice(h * (d // n_heads), (h + 1) * (d // n_heads)) for h in range(n_heads)]
    qk = torch.stack([w_q[r].T @ w_k[r] for r in rows])        # (H, d, D) @ (H, D, d) -> (H, d, d)
    ov = torch.stack([w_v[r].T @ w_o[:, r].T for r in rows])   # (H, d, D) @ (H, D, d) -> (H, d, d)
    return qk, ov


def _factor(m: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """m (d, d) of rank <= `rank` -> (a, b), (rank, d) each, with b's rows orthonormal and a.T @ b == m."""
    u, s, vh = torch.linalg.svd(m)
    return (u[:, :rank] * s[:rank]).T, vh[:rank]


def _orthonormal_by_module(w_q, w_k, w_v, w_o, n_heads):
    """The circuits read off the course's module (logits from two-key weights, writes from one-key contexts),
    then factored by SVD: a right answer that never looks at which rows belong to which head."""
    d = w_q.shape[0]
    dh = d // n_heads
    eye = torch.eye(d, dtype=w_q.dtype)

    def module(o):
        m = MultiHeadAttention(d, n_heads).to(w_q.dtype)
        with torch.no_grad():
            for proj, w in zip((m.q_proj, m.k_proj, m.v_proj, m.o_proj), (w_q, w_k, w_v, o)):
                proj.weight.copy_(w)
        return m

    with torch.no_grad():
        x = eye.repeat_interleave(d, 0)[:, None]                                # (d*d, 1, d): query e_i
        ctx = torch.stack([eye.repeat(d, 1), torch.zeros(d * d, d, dtype=w_q.dtype)], 1)   # keys e_j and 0
        _, wts = module(w_o)(x, ctx, return_weights=True)                      # (d*d, H, 1, 2)
        qk = ((wts[:, :, 0, 0].log() - wts[:, :, 0, 1].log()) * math.sqrt(dh)).T.reshape(n_heads, d, d)
        new = [torch.empty_like(w) for w in (w_q, w_k, w_v, w_o)]
        for h in range(n_heads):
            r = slice(h * dh, (h + 1) * dh)
            only_h = torch.zeros_like(w_o)
            only_h[:, r] = w_o[:, r]
            ov = module(only_h)(eye[:, None], eye[:, None])[:, 0]               # (d, d): e_j's write, head h
            new[0][r], new[1][r] = _factor(qk[h], dh)
            a, b = _factor(ov.T, dh)                                            # ov.T = a.T @ b
            new[2][r], new[3][:, r] = b, a.T
    return tuple(new)


def reference_orthonormal(w_q, w_k, w_v, w_o, n_heads: int) -> tuple[torch.Tensor, ...]:
    """The reference answer: per head, a QR factorisation of the key (value) rows moves R into the query (output)
    weights; the circuits are unchanged and the key and value rows orthonormal."""
    dh = w_q.shape[0] // n_heads
    out = [w.clone() for w in (w_q, w_k, w_v, w_o)]
    for h in range(n_heads):
        r = slice(h * dh, (h + 1) * dh)
        basis, tri = torch.linalg.qr(w_k[r].T)                  # (d, D), (D, D)
        out[1][r], out[0][r] = basis.T, tri @ w_q[r]
        basis, tri = torch.linalg.qr(w_v[r].T)
        out[2][r], out[3][:, r] = basis.T, w_o[:, r] @ tri.T
    return tuple(out)


def _circuits_rule(got, expected, *, n_heads: int = 1, tol: float = 1e-9) -> str | None:
    """`expected` is a right answer (the reference's): its circuits are the given layer's."""
    w_q, w_k, w_v, w_o = expected
    d = w_q.shape[0]
    if not (isinstance(got, (tuple, list)) and len(got) == 4 and all(isinstance(w, torch.Tensor) for w in got)):
        return f"expected a tuple of four tensors (w_q, w_k, w_v, w_o), got {str(got)[:120]}"
    for name, w in zip(("w_q", "w_k", "w_v", "w_o"), got):
        if tuple(w.shape) != (d, d) or w.dtype != w_q.dtype:
            return f"{name} should be ({d}, {d}) {w_q.dtype} like the input, got {tuple(w.shape)} {w.dtype}"
        if not torch.isfinite(w).all():
            return f"{name} holds inf or NaN"
    dh = d // n_heads
    eye = torch.eye(dh, dtype=w_q.dtype)
    for name, w in (("key", got[1]), ("value", got[2])):
        for h in range(n_heads):
            r = w[h * dh:(h + 1) * dh]                                              # (D, d): head h's rows
            if not torch.allclose(r @ r.T, eye, rtol=0, atol=tol):
                return (f"head {h}'s {name} weights (its {dh} rows of w_{name[0]}) are not orthonormal: "
                        f"their rows' dot products are not the identity")
    want, have = circuits(w_q, w_k, w_v, w_o, n_heads), circuits(*got, n_heads)
    for label, a, b in zip(("QK", "OV"), want, have):
        for h in range(n_heads):
            scale = float(a[h].abs().max())
            if not torch.allclose(b[h], a[h], rtol=0, atol=tol * scale):
                what = "where it looks" if label == "QK" else "what it writes"
                return (f"head {h}'s {label} circuit changed, so the layer is no longer the same function "
                        f"(the head changes {what}); with {n_heads} heads of width {dh}")
    return None


@exercise("04-head-circuits", "orthonormal_heads", points=2, category="implement", forbid=_FORBID, allow=(),
          ops=("attention", "softmax"), shortcuts=(_orthonormal_by_module,),
          prop_doc="the property is structural and judged as such: every head's rows of the returned key and value "
                   "weights are orthonormal, and every head's QK circuit W^Q_h W^K_h^T and OV circuit W^V_h W^O_h "
                   "equal the given layer's (1 to 8 heads, one head 100 times larger in its values and 100 times "
                   "smaller in its output); attention and the course's module are refused, so the circuits come "
                   "from the weights",
          hint="only the two products of a head are its function: whatever invertible D x D matrix you take out of "
               "one factor, put back into the other. Work out which rows and columns of the four (out, in) "
               "matrices belong to head h, and which orthonormalisation gives you that matrix")
def _head_circuits():
    """Rewrite a layer's weights so that every head's key and value maps are orthonormal, the layer unchanged."""
    gen = torch.Generator().manual_seed(47)
    cases = []
    for name, (d, h, dtype) in {"d = 16, 4 heads": (16, 4, torch.float64), "d = 12, 3 heads": (12, 3, torch.float64),
                                "one head, d = 8": (8, 1, torch.float64), "8 heads of width 1": (8, 8, torch.float64),
                                "float32, d = 24, 6 heads": (24, 6, torch.float32)}.items():
        ws = [torch.randn(d, d, generator=gen, dtype=torch.float64) / d ** 0.5 for _ in range(4)]
        if name.startswith("d = 12"):   # head 1's values 100 x larger, its output 100 x smaller: the same head
            ws[2][4:8] *= 100.0
            ws[3][:, 4:8] /= 100.0
            name += ", one head's values 100 times larger and its output 100 times smaller"
        ws = [w.to(dtype) for w in ws]
        tol = 1e-9 if dtype == torch.float64 else 2e-5
        cases.append(Case(name, (*ws, h), expected=reference_orthonormal(*ws, h),
                          compare=functools.partial(_circuits_rule, n_heads=h, tol=tol)))
    return cases
