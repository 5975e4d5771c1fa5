"""Chapter 12's exercise 11 (solutions/12_attention_variants.ipynb): a gated attention layer (Qiu et al. 2025, G1:
an elementwise, head-specific, query-dependent sigmoid gate on each head's attention output, before the output
projection). Expected values come from the package's :class:`attncourse.sink_variants.GatedAttention` with the
case's weights loaded."""

from __future__ import annotations

import torch

from . import Case, exercise


def gated_reference(x, w_q, w_k, w_v, w_g, b_g, w_o, n_heads):
    """The package's GatedAttention (causal) with these weights: x @ w for every projection, the gate's bias b_g."""
    from attncourse.sink_variants import GatedAttention
    d = x.shape[-1]
    layer = GatedAttention(d, n_heads).to(x.dtype)
    with torch.no_grad():
        for linear, w in ((layer.q_proj, w_q), (layer.k_proj, w_k), (layer.v_proj, w_v), (layer.gate_proj, w_g),
                          (layer.o_proj, w_o)):
            linear.weight.copy_(w.T)  # nn.Linear computes x @ weight.T
        layer.gate_proj.bias.copy_(b_g)
        return layer(x, is_causal=True)


def _shortcut_package(x, w_q, w_k, w_v, w_g, b_g, w_o, n_heads):
    from attncourse.sink_variants import GatedAttention
    layer = GatedAttention(x.shape[-1], n_heads).to(x.dtype)
    with torch.no_grad():
        for linear, w in ((layer.q_proj, w_q), (layer.k_proj, w_k), (layer.v_proj, w_v), (layer.gate_proj, w_g),
                          (layer.o_proj, w_o)):
            linear.weight.copy_(w.T)
        layer.gate_proj.bias.copy_(b_g)
        return layer(x, is_causal=True)


def _shortcut_sdpa(x, w_q, w_k, w_v, w_g, b_g, w_o, n_heads):  # the gate by hand around PyTorch's fused kernel
    b, t, d = x.shape
    split = lambda y: y.view(b, t, n_heads, d // n_heads).transpose(1, 2)  # noqa: E731
    heads = torch.nn.functional.scaled_dot_product_attention(split(x @ w_q), split(x @ w_k), split(x @ w_v),
                                                             is_causal=True)
    merged = (heads * torch.sigmoid(split(x @ w_g + b_g))).transpose(1, 2).reshape(b, t, d)  # (B, T, d)
    return merged @ w_o


@exercise("12-gated-attention", "gated_attention", points=2, category="implement",
          forbid=("attncourse.sink_variants.GatedAttention", "attncourse.sink_variants.SinkStudyLM",
                  "attncourse.sdpa.scaled_dot_product_attention", "attncourse.scaled_dot_product_attention",
                  "torch.nn.functional.scaled_dot_product_attention", "torch.nn.MultiheadAttention"),
          allow=(), ops=("attention",),
          prop_doc="the gate's place is the output: the cases are built so that a gate on the values (Qiu et al.'s G2), "
                   "after the output projection, one scalar per head, or computed from the attention output instead "
                   "of the layer's input each give other outputs (the gate's bias runs from -4 to +4, head counts 1 to "
                   "4, causal), once fused attention and the package's gated layer are refused",
          shortcuts=(_shortcut_package, _shortcut_sdpa),
          hint="the gate is computed from the layer's input x, like the queries, split into heads like them, and "
               "multiplies each head's attention output feature by feature; where does that leave it relative to "
               "the output projection?")
def _gated_attention():
    """Gated attention (G1): sigmoid(x W_g + b_g), per head and feature, times each head's causal softmax output."""
    gen = torch.Generator().manual_seed(25)
    cases = []
    for (b, t, d, h), bias in (((2, 5, 8, 2), 0.0), ((1, 7, 12, 3), 2.0), ((2, 4, 16, 4), -4.0), ((1, 6, 8, 1), 4.0),
                               ((3, 9, 12, 2), "spread")):
        x = torch.randn(b, t, d, generator=gen, dtype=torch.float64)
        w_q, w_k, w_v, w_g, w_o = (torch.randn(d, d, generator=gen, dtype=torch.float64) / d ** 0.5 for _ in range(5))
        b_g = (torch.linspace(-4, 4, d, dtype=torch.float64) if bias == "spread"
               else torch.full((d,), float(bias), dtype=torch.float64))
        args = (x, w_q, w_k, w_v, w_g, b_g, w_o, h)
        label = "gate bias from -4 to +4 across features" if bias == "spread" else f"gate bias {bias:+g}"
        cases.append(Case(f"x {tuple(x.shape)}, {h} head(s), {label}", args, expected=gated_reference(*args),
                          rtol=1e-9, atol=1e-11))
    return cases
