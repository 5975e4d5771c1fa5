"""Chapter 01's exercise 5 (predict, then measure, which score variants let the decoder state change the weights),
solutions/01_additive_attention.ipynb."""

from __future__ import annotations

import torch

from . import Case, exercise
from .predictions import whole


# ----------------------------------------------------------------------------- 5. experiment: why the tanh

VARIANTS = ("tanh", "linear", "relu", "separate", "product")


def _weight_spread(weights: torch.Tensor) -> float:
    """weights (N, T), one distribution per query: per position the largest minus the smallest weight the N queries
    give it, averaged over the positions (0 when the weights ignore the query)."""
    return float((weights.amax(0) - weights.amin(0)).mean())


def variant_weights_reference(queries, keys, W_q, W_k, v):
    """The (N, T) attention weights of N queries over one sequence's T keys, for each score variant of VARIANTS."""
    q, k = queries @ W_q.T, keys @ W_k.T  # (N, A), (T, A)
    hidden = q[:, None] + k  # (N, 1, A) + (T, A) -> (N, T, A)
    scores = {
        "tanh": torch.tanh(hidden) @ v,  # v^T tanh(W_q s + W_k h_j)
        "linear": hidden @ v,  # v^T (W_q s + W_k h_j)
        "relu": torch.relu(hidden) @ v,  # v^T relu(W_q s + W_k h_j)
        "separate": (torch.tanh(q) @ v)[:, None] + torch.tanh(k) @ v,  # v^T tanh(W_q s) + v^T tanh(W_k h_j)
        "product": (q[:, None] * k) @ v,  # v^T (W_q s * W_k h_j), elementwise
    }
    return tuple(torch.softmax(scores[name], dim=-1) for name in VARIANTS)  # over the T positions


def _moves(alpha: float, beta: float) -> dict:
    """For each variant of VARIANTS with q = alpha W_q s and k_j = beta W_k h_j, whether the query changes the
    weights: measured on queries and keys drawn here (there is no table of answers to look up)."""
    gen = torch.Generator().manual_seed(99)
    queries, keys = torch.randn(40, 8, generator=gen, dtype=torch.float64), torch.randn(9, 8, generator=gen,
                                                                                         dtype=torch.float64)
    w_q, w_k = (torch.randn(6, 8, generator=gen, dtype=torch.float64) / 8**0.5 for _ in range(2))
    v = torch.randn(6, generator=gen, dtype=torch.float64)
    tables = variant_weights_reference(alpha * queries, beta * keys, w_q, w_k, v)
    return {name: _weight_spread(w) > 1e-9 for name, w in zip(VARIANTS, tables)}


@exercise("01-query-influence-predict", "query_moves_weights", points=1, category="predict", parts=VARIANTS,
          forbid=("attncourse.classroom.checks.ch01_influence.variant_weights_reference",
                  "attncourse.classroom.checks.ch01_influence._moves"),
          allow=(), ops=("torch", "numpy"),
          prop_doc="the prediction is a rule: five yes-or-no answers as a function of two scales (alpha on the "
                   "query's projection, beta on the keys'), written down before any weights are computed (the "
                   "function may run no tensor or NumPy operation), judged as a whole at alpha = beta = 1 and at "
                   "scales drawn from a seed, 0 on one side in two cases (the grader draws other scales, so a table "
                   "of the check cell's answers does not answer it); feedback never says which variant is wrong",
          hint="write each variant's score as a part that depends on the query alone plus a part that depends on "
               "position j alone, if you can: what does a softmax do with a number added to every score of a row? "
               "For the variants where no such split exists, ask whether the query can change which position scores "
               "highest; then ask what a scale of 0 on either side leaves of each score")
def _query_influence_predict():
    """Predict, before measuring, for which score variants the query can change the weights, as a function of a
    scale alpha on the query's projection and beta on the keys'."""
    gen = torch.Generator().manual_seed(15)  # the scales are drawn (a salted grader draws others)

    def scale() -> float:  # a size in [0.3, 2], either sign
        size = float(torch.empty(()).uniform_(0.3, 2.0, generator=gen))
        return -size if int(torch.randint(0, 2, (), generator=gen)) else size

    pairs = [(1.0, 1.0), (scale(), scale()), (0.0, scale()), (scale(), 0.0)]
    form = whole("a dict with True or False for each of " + ", ".join(repr(v) for v in VARIANTS), kind="flags")
    return [Case(f"for each variant, can the query change the weights (True or False), with alpha = {a:.4g} and "
                 f"beta = {b:.4g}?", (a, b), expected=_moves(a, b), compare=form) for a, b in pairs]


@exercise("01-query-influence", "variant_weights", points=2, category="experiment",
          prop_doc="output equality is the property: the five (N, T) weight tables, one per variant, for drawn "
                   "queries, keys and projections; no table is fixed by a theorem (the two whose spread is 0 still "
                   "depend on the keys), so none can be typed, and the spreads are measured from them afterwards",
          hint="build each variant's (N, T) table of scores from the two projections, computed once; a softmax over "
               "the positions turns each query's row into its weights. Return the five tables in the order asked")
def _query_influence():
    """Which score variants let the decoder state change the weights? Measured over seeds and sizes."""
    cases = []
    for seed, (n, t, d, a) in enumerate([(50, 7, 8, 6), (40, 12, 16, 10), (30, 5, 4, 3), (60, 9, 12, 8)]):
        gen = torch.Generator().manual_seed(100 + seed)
        queries = torch.randn(n, d, generator=gen, dtype=torch.float64)
        keys = torch.randn(t, d, generator=gen, dtype=torch.float64)
        w_q = torch.randn(a, d, generator=gen, dtype=torch.float64) / d**0.5
        w_k = torch.randn(a, d, generator=gen, dtype=torch.float64) / d**0.5
        v = torch.randn(a, generator=gen, dtype=torch.float64)
        args = (queries, keys, w_q, w_k, v)
        name = f"seed {100 + seed}: N={n} queries, T={t}, D={d}, A={a}; weights of {', '.join(VARIANTS)}"
        cases.append(Case(name, args, expected=variant_weights_reference(*args), rtol=1e-6, atol=1e-9))
    return cases
