"""Chapter 13, exercise 2's second part: for which inputs the given chunkwise gated delta rule is wrong.

The fix of exercise 2 is a small edit, and a blind search over small edits of the given code (each compared with the
recurrence on one input) can find it without the diagnosis. This part asks for the diagnosis itself, as a rule: given
the log-decays, the initial state and the chunk size of a batch of heads (queries, keys, values and betas drawn at
random), which heads does the given code get wrong? The rule runs no chunked or recurrent code: no matrix product or
triangular solve (the operators are refused), so it cannot be the two functions run side by side.

The expected answer is computed here from the recurrence and the given code itself (:data:`.ch13_breakers.BUGGY_GDN`),
head by head, not from a formula.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attncourse import linear_attention as la
from . import Case, exercise

_PRODUCTS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::mv", "aten::dot",
             "aten::vdot", "aten::matmul", "aten::einsum", "aten::linalg_solve_triangular", "aten::triangular_solve",
             "aten::linalg_solve", "aten::linalg_inv", "aten::tensordot", "aten::outer", "aten::ger",
             "aten::linalg_vecdot", "aten::chain_matmul", "aten::linalg_multi_dot")

# Per head, how its log-decays and initial state are drawn: (decay in the first chunk, decay in the later chunks,
# a nonzero initial state).
FAMILIES = ((False, False, True), (False, False, False), (True, True, False), (True, False, False),
            (True, False, True), (False, True, False), (False, True, True), (True, True, True))


def _given_code():
    """The notebook's `gated_delta_chunked`, compiled from its source as the exercise gives it."""
    from .ch13_breakers import BUGGY_GDN

    namespace = {"torch": torch, "math": math}
    exec(compile(BUGGY_GDN, "<given gated_delta_chunked>", "exec"), namespace)
    return namespace["gated_delta_chunked"]


def _wrong_heads(q, k, v, g, beta, s0, chunk) -> torch.Tensor:
    """(B, H) bool: heads whose output or boundary states from the given code differ from the recurrence's."""
    o, states = _given_code()(q, k, v, g, beta, s0, chunk)
    ref, final = la.recurrent(q, k, v, g, beta, scale=1.0, initial_state=s0)
    off_o = (o - ref).abs().amax((-2, -1))  # (B, H)
    off_s = (states[:, :, -1] - final).abs().amax((-2, -1))
    return (off_o > 1e-9) | (off_s > 1e-9)


def _draw(gen: torch.Generator):
    """One batch: 2 sequences x 8 heads, each head one of :data:`FAMILIES` in a drawn order; T and the chunk size
    drawn so that there are 2 to 4 chunks, the last one often shorter."""
    chunk = int(torch.randint(4, 9, (1,), generator=gen))
    T = chunk * int(torch.randint(2, 4, (1,), generator=gen)) + int(torch.randint(0, chunk, (1,), generator=gen))
    B, H, Dk, Dv = 2, len(FAMILIES), 4, 3
    q, v = torch.randn(B, H, T, Dk, generator=gen, dtype=torch.float64), torch.randn(B, H, T, Dv, generator=gen,
                                                                                       dtype=torch.float64)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=torch.float64), dim=-1)
    beta = 0.1 + 0.9 * torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, H, T, generator=gen, dtype=torch.float64) + 2)  # (B, H, T) < 0
    s0 = 0.5 * torch.randn(B, H, Dk, Dv, generator=gen, dtype=torch.float64)
    for b in range(B):
        order = torch.randperm(H, generator=gen).tolist()
        for h, fam in zip(range(H), order):
            first, later, start = FAMILIES[fam]
            if not first:
                g[b, h, :chunk] = 0.0
            if not later:
                g[b, h, chunk:] = 0.0
            elif bool(torch.rand((), generator=gen) < 0.5):  # a decay in one later chunk only
                keep = int(torch.randint(1, -(-T // chunk), (1,), generator=gen))
                mask = torch.ones(T, dtype=torch.bool)
                mask[keep * chunk:(keep + 1) * chunk] = False
                mask[:chunk] = False
                g[b, h, mask] = 0.0
            if not start:
                s0[b, h] = 0.0
    return q, k, v, g, beta, s0, chunk


@exercise("13-find-the-bug-1-inputs", "wrong_heads", points=1, category="predict",
          allow=(), ops=_PRODUCTS,
          prop_doc="the diagnosis as a rule on the decays, the initial state and the chunk size: no matrix product "
                   "or triangular solve runs, so the rule cannot be the given code and the recurrence compared; "
                   "one batch of 16 heads judged whole, drawn anew by the grader",
          title="For which inputs is the chunkwise gated delta rule of exercise 2 wrong?",
          hint="write what the given code subtracts for the earlier chunks' state in one chunk, and what the "
               "recurrence subtracts, and take their difference: it is a product. A product is zero when one of its "
               "factors is. Which inputs make a factor zero in the first chunk, and which in a later one (what is the "
               "state there when the keys, values and betas are random)?")
def _inputs_rule():
    """Which heads of a batch (log-decays, initial state, chunk size) the given chunkwise rule gets wrong."""
    gen = torch.Generator().manual_seed(137)
    q, k, v, g, beta, s0, chunk = _draw(gen)
    return [Case(f"a batch of 2 x {len(FAMILIES)} heads, T = {g.shape[-1]}, chunks of {chunk}", (g, s0, chunk),
                 expected=_wrong_heads(q, k, v, g, beta, s0, chunk))]
