"""Checks for chapter 04, multi-head attention and the Transformer block (solutions/04_multi_head_attention.ipynb)."""

from __future__ import annotations

import torch

from attncourse.mha import MultiHeadAttention, merge_heads
from . import Case, exercise

_FORBID = ("torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.multi_head_attention_forward")


def _weights(gen: torch.Generator, d: int, h: int, h_kv: int | None = None) -> tuple[torch.Tensor, ...]:
    kv = d if h_kv is None else h_kv * (d // h)
    return tuple(torch.randn(out, d, generator=gen, dtype=torch.float64) / d ** 0.5 for out in (d, kv, kv, d))


def reference_mha(x, w_q, w_k, w_v, w_o, n_heads, n_kv_heads=None, **kw):
    """Run the package's MultiHeadAttention with the given (out, in) projection matrices, no bias."""
    m = MultiHeadAttention(x.shape[-1], n_heads, n_kv_heads).to(x.dtype)
    with torch.no_grad():
        for proj, w in zip((m.q_proj, m.k_proj, m.v_proj, m.o_proj), (w_q, w_k, w_v, w_o)):
            proj.weight.copy_(w)
        return m(x, **kw)


@exercise("04-mha-forward", "mha_forward", points=3, forbid=_FORBID,
          hint="project with x @ w.T, split the last dim into (n_heads, head_dim) and move heads before time, "
               "attend per head, move time back before heads, merge, then apply w_o")
def _mha_forward():
    """Multi-head self-attention from four projection matrices: split, attend, merge, project."""
    gen = torch.Generator().manual_seed(40)
    cases = []
    for name, (b, t, d, h) in {"(2, 5, 16) with 4 heads": (2, 5, 16, 4), "(1, 7, 12) with 3 heads": (1, 7, 12, 3),
                               "one token, 8 heads of width 1": (3, 1, 8, 8), "one head": (2, 6, 8, 1)}.items():
        x = torch.randn(b, t, d, generator=gen, dtype=torch.float64)
        w = _weights(gen, d, h)
        cases.append(Case(name, (x, *w, h), expected=reference_mha(x, *w, h), rtol=1e-7, atol=1e-9))
    return cases


@exercise("04-merge-heads-bug", "merge_heads_fixed", points=2,
          hint="a (B, H, T, D) tensor must become (B, T, H, D) before its last two dims are flattened")
def _merge_bug():
    """Find and fix the bug in a head-merging function that reshapes without transposing."""
    gen = torch.Generator().manual_seed(41)
    cases = []
    for shape in ((2, 4, 5, 3), (1, 3, 7, 2), (2, 1, 4, 6), (1, 8, 1, 4)):
        x = torch.randn(*shape, generator=gen)
        cases.append(Case(f"input {shape}", (x,), expected=merge_heads(x), compare="equal"))
    return cases


@exercise("04-attention-weights", "self_attention_weights", points=2, forbid=_FORBID,
          hint="scores = q @ k.transpose(-2, -1) / sqrt(head_dim) per head, then softmax over the last axis")
def _attention_weights():
    """Per-head self-attention weights (B, H, T, T) from x and the query/key projections."""
    gen = torch.Generator().manual_seed(42)
    cases = []
    for name, (b, t, d, h) in {"the sentence's shape (1, 6, 16), 2 heads": (1, 6, 16, 2),
                               "(2, 9, 12), 4 heads": (2, 9, 12, 4), "(1, 3, 8), 1 head": (1, 3, 8, 1)}.items():
        x = torch.randn(b, t, d, generator=gen, dtype=torch.float64)
        w_q, w_k, w_v, w_o = _weights(gen, d, h)
        m = MultiHeadAttention(d, h).double()
        with torch.no_grad():
            m.q_proj.weight.copy_(w_q)
            m.k_proj.weight.copy_(w_k)
            expected = m(x, return_weights=True)[1]
        cases.append(Case(name, (x, w_q, w_k, h), expected=expected, rtol=1e-7, atol=1e-9))
    return cases


@exercise("04-predict-permutation", "predicted_permutation", kind="value", points=1,
          hint="self-attention without positions treats the input as a set: permute the inputs and the outputs "
               "are permuted the same way; a causal mask ties each output to a position")
def _predict_permutation():
    """Predict which output row each permuted token gets, and whether that survives a causal mask."""
    return [Case("(rows of out that y[:, i] equals, still true with is_causal=True?)",
                 expected=((3, 0, 4, 1, 2), False), compare="equal")]


def _classifier_ok(got) -> str | None:
    keys = {"transformer_acc", "lstm_acc", "transformer_params", "lstm_params"}
    if not isinstance(got, dict) or set(got) != keys:
        return f"expected a dict with keys {sorted(keys)}, got {got!r}"[:300]
    for k in ("transformer_acc", "lstm_acc"):
        if not isinstance(got[k], float) or not 0.75 <= got[k] <= 1.0:
            return f"{k} should be a test accuracy (float) of at least 0.75 on this task (chance is 0.5), got {got[k]!r}"
    for k in ("transformer_params", "lstm_params"):
        if isinstance(got[k], bool) or not isinstance(got[k], int) or got[k] < 1000:
            return f"{k} should be the model's parameter count (an int), got {got[k]!r}"
    ratio = got["lstm_params"] / got["transformer_params"]
    if not 0.5 <= ratio <= 2.0:
        return f"the LSTM should have a similar size (0.5x to 2x the Transformer's parameters), got ratio {ratio:.2f}"
    return None


@exercise("04-encoder-vs-lstm", "classifier_results", kind="value", points=2,
          hint="train both on the same data for the same number of epochs; count parameters with "
               "sum(p.numel() for p in model.parameters())")
def _encoder_vs_lstm():
    """Transformer encoder classifier vs an LSTM of similar size on 'is the mean above 50?'."""
    return [Case("test accuracies and parameter counts", compare=_classifier_ok)]
