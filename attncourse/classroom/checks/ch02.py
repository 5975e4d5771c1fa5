"""Checks for chapter 02, Luong attention (solutions/02_luong_attention.ipynb)."""

from __future__ import annotations

import torch

from attncourse.rnn_attention import AdditiveAttention, LuongAttention, score_parameter_count
from attncourse.sdpa import scaled_dot_product_attention
from . import Case, exercise


def _qk(gen: torch.Generator, b: int, t: int, dq: int, dk: int):
    q = torch.randn(b, dq, generator=gen, dtype=torch.float64)
    k = torch.randn(b, t, dk, generator=gen, dtype=torch.float64)
    return q, k


@exercise("02-general-score", "general_scores", points=2,
          hint="s^T W h_j for every j: compute W h_j for all keys, (B, T, Dk) @ (Dk, Dq) -> (B, T, Dq), "
               "or W^T s once, then a batched dot product with the query over the last axis")
def _general():
    """Luong's general score s^T W h_j, with W of shape (Dq, Dk)."""
    gen = torch.Generator().manual_seed(21)
    cases = []
    for name, (b, t, dq, dk) in {
        "B=2, T=5, Dq=Dk=4": (2, 5, 4, 4),
        "query and key sizes differ (Dq=3, Dk=7)": (3, 6, 3, 7),
        "a single source position (T=1)": (2, 1, 5, 2),
    }.items():
        q, k = _qk(gen, b, t, dq, dk)
        ref = LuongAttention(dq, dk, "general").double()
        w = torch.randn(dq, dk, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            ref.W.weight.copy_(w)
            cases.append(Case(name, (q, k, w), expected=ref.score(q, k), rtol=1e-8, atol=1e-10))
    return cases


SIZES = dict(query_size=64, key_size=48, hidden_size=32)


@exercise("02-parameter-counts", "parameter_counts", kind="value", points=1,
          hint="dot has no weights; general is one Dq x Dk matrix; concat is W (A x (Dq + Dk)) plus v "
               "(A); additive is W_q (A x Dq), W_k (A x Dk) and v (A). No biases. Is dot even possible here?")
def _counts():
    """Parameters of each score for Dq=64, Dk=48, A=32 (None for a score that cannot be built)."""
    dq, dk, a = SIZES["query_size"], SIZES["key_size"], SIZES["hidden_size"]
    counted = {
        "dot": None,  # Dq != Dk: LuongAttention refuses to build it
        "general": sum(p.numel() for p in LuongAttention(dq, dk, "general").parameters()),
        "concat": sum(p.numel() for p in LuongAttention(dq, dk, "concat", hidden_size=a).parameters()),
        "additive": sum(p.numel() for p in AdditiveAttention(dq, dk, a).parameters()),
    }
    assert counted["general"] == score_parameter_count("general", dq, dk)
    assert counted["concat"] == counted["additive"] == score_parameter_count("additive", dq, dk, a)
    return [Case("parameter counts by score", expected=counted, compare="equal")]


@exercise("02-query-key-swap", "luong_dot_attention", points=2,
          forbid=("torch.nn.functional.scaled_dot_product_attention",),
          hint="the decoder state asks: it is the query, a sequence of ONE query, (B, D) -> (B, 1, D); the "
               "annotations are the keys and the values, (B, T, D) and (B, T, Dv); give the mask a query axis, "
               "(B, T) -> (B, 1, T), pass scale=1.0 (Luong's dot is not scaled) and squeeze the query axis "
               "from the output, (B, 1, Dv) -> (B, Dv)")
def _query_key_swap():
    """Luong's dot attention by one call of attncourse.scaled_dot_product_attention, with the roles the right
    way round (note 004 swaps them: the annotations become queries over a single key, every weight is 1)."""
    gen = torch.Generator().manual_seed(22)
    cases = []
    for name, (b, t, d, dv, lengths) in {
        "B=2, T=5, D=8, no padding": (2, 5, 8, 8, [5, 5]),
        "padding, lengths [6, 2, 4], Dv=3": (3, 6, 8, 3, [6, 2, 4]),
        "large d (64): the unscaled scores are large": (2, 7, 64, 4, [7, 5]),
    }.items():
        q, k = _qk(gen, b, t, d, d)
        v = torch.randn(b, t, dv, generator=gen, dtype=torch.float64)
        mask = torch.arange(t) < torch.tensor(lengths)[:, None]  # (B, T)
        context, _ = LuongAttention(d, d, "dot")(q, k, v, mask=mask)
        oracle = scaled_dot_product_attention(q[:, None], k, v, mask[:, None], scale=1.0).squeeze(1)
        torch.testing.assert_close(context, oracle)
        cases.append(Case(name, (q, k, v, mask), expected=context, rtol=1e-8, atol=1e-10))
    return cases


@exercise("02-concat-is-additive", "split_concat_weights", points=1,
          hint="W [s; h] = W[:, :Dq] s + W[:, Dq:] h: split W's columns at query_size; v of shape (1, A) "
               "becomes the vector v[0]")
def _concat_split():
    """Turn concat weights (W (A, Dq + Dk), v (1, A)) into additive ones (W_q, W_k, v)."""
    gen = torch.Generator().manual_seed(23)
    cases = []
    for name, (dq, dk, a) in {"Dq=4, Dk=6, A=5": (4, 6, 5), "Dq=Dk=3, A=2": (3, 3, 2)}.items():
        w = torch.randn(a, dq + dk, generator=gen, dtype=torch.float64)
        v = torch.randn(1, a, generator=gen, dtype=torch.float64)
        cases.append(Case(name, (w, v, dq), expected=(w[:, :dq], w[:, dq:], v[0]), compare="equal"))
    return cases
