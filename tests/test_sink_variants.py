"""The sink logit (gpt-oss), gated attention (Qiu et al. 2025) and the five-attention study model."""

import math

import pytest
import torch
import torch.nn.functional as F

from attncourse import MultiHeadAttention
from attncourse.sink_variants import (VARIANTS, GatedAttention, SinkLogitAttention, SinkStudyLM, first_token_weight,
                                      largest_activations, sink_softmax_attention, train_sink_variant)


def _extra_key_reference(q, k, v, sinks, mask):
    """PyTorch's kernel over one more key with value 0 whose score is the sink logit (an additive mask)."""
    b, h, t, d = q.shape
    zero_k, zero_v = q.new_zeros(b, h, 1, d), v.new_zeros(b, h, 1, v.shape[-1])
    bias = q.new_zeros(h, t, k.shape[-2] + 1)
    bias[..., :-1] = q.new_zeros(t, k.shape[-2]).masked_fill(~mask, -math.inf)
    bias[..., -1] = sinks[:, None]
    return F.scaled_dot_product_attention(q, torch.cat([k, zero_k], 2), torch.cat([v, zero_v], 2), attn_mask=bias)


@pytest.mark.parametrize("t_q,t_k,causal", [(5, 5, True), (3, 7, False), (1, 1, True), (6, 6, False)])
def test_sink_logit_equals_softmax_over_an_extra_zero_key(t_q, t_k, causal):
    g = torch.Generator().manual_seed(t_q * 10 + t_k)
    q = torch.randn(2, 3, t_q, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 3, t_k, 4, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = 3 * torch.randn(3, generator=g, dtype=torch.float64)
    mask = torch.ones(t_q, t_k, dtype=torch.bool).tril() if causal else torch.ones(t_q, t_k, dtype=torch.bool)
    out, w = sink_softmax_attention(q, k, v, sinks, is_causal=causal, return_weights=True)
    torch.testing.assert_close(out, _extra_key_reference(q, k, v, sinks, mask))
    assert bool((w.sum(-1) < 1).all())
    # a very negative sink logit is plain softmax attention
    torch.testing.assert_close(sink_softmax_attention(q, k, v, torch.full((3,), -1e4, dtype=torch.float64),
                                                      is_causal=causal),
                               F.scaled_dot_product_attention(q, k, v, is_causal=causal))


def test_sink_logit_gradients_and_half_precision():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    s = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: sink_softmax_attention(*a, is_causal=True), (q, k, v, s))
    half = sink_softmax_attention(q.detach().half(), k.detach().half(), v.detach().half(), s.detach().half(),
                                  is_causal=True)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.double(), sink_softmax_attention(q, k, v, s, is_causal=True).detach(),
                               rtol=1e-2, atol=1e-2)


def test_layers_against_multihead_attention():
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    plain = MultiHeadAttention(16, 4).double()
    sinked = SinkLogitAttention(16, 4).double()
    gated = GatedAttention(16, 4).double()
    for layer in (sinked, gated):
        layer.load_state_dict({**plain.state_dict(), **{n: t for n, t in layer.state_dict().items()
                                                       if n.startswith(("gate_proj", "sinks"))}})
    with torch.no_grad():
        sinked.sinks.fill_(-1e4)  # no sink: plain softmax
        gated.gate_proj.weight.zero_()
        gated.gate_proj.bias.fill_(40.0)  # every gate open
    for layer in (sinked, gated):
        torch.testing.assert_close(layer(x, is_causal=True), plain(x, is_causal=True))
    with torch.no_grad():
        gated.gate_proj.bias.fill_(0.0)  # every gate at one half: the heads' output halved before o_proj
    torch.testing.assert_close(gated(x, is_causal=True), 0.5 * plain(x, is_causal=True))
    assert gated.last_gate.shape == (2, 4, 7, 4)


@pytest.mark.parametrize("attention", VARIANTS)
def test_study_model_runs_every_variant(attention):
    torch.manual_seed(0)
    model = SinkStudyLM(11, 9, d_model=16, n_heads=2, n_layers=2, attention=attention)
    tokens = torch.randint(0, 11, (3, 9))
    logits, maps, states = model(tokens, return_internals=True)
    assert logits.shape == (3, 9, 11) and len(maps) == 2 and len(states) == 3
    assert maps[0].shape[-2:] == (9, 9) and torch.equal(model(tokens), logits)
    assert bool((maps[0].triu(1) == 0).all())  # causal: no weight above the diagonal
    logits.sum().backward()


def test_measures():
    w = torch.zeros(1, 2, 4, 4)
    w[:, 0, :, 0] = 1.0  # head 0 puts everything on key 0
    w[:, 1, :, 1] = 0.5
    torch.testing.assert_close(first_token_weight(w), torch.tensor([1.0, 0.0]))
    top, ratio = largest_activations([torch.tensor([[[1.0, -2.0, 3.0]]]), torch.tensor([[[-30.0, 2.0, 1.0]]])])
    assert top == 30.0 and ratio == 15.0
    with pytest.raises(ValueError, match="min_query"):
        first_token_weight(w, min_query=4)
    with pytest.raises(ValueError, match="non-empty"):
        largest_activations([])


def test_training_is_seeded_and_bad_input():
    a = train_sink_variant("gated", 0, steps=3, batch_size=4)
    assert a == train_sink_variant("gated", 0, steps=3, batch_size=4)
    assert len(a["first_token"]) == 2 and a["max_act"] > 0
    with pytest.raises(ValueError, match="attention must be one of"):
        SinkStudyLM(5, 5, attention="relu")
    with pytest.raises(ValueError, match="even n_heads"):
        SinkStudyLM(5, 5, n_heads=3, attention="differential")
    with pytest.raises(ValueError, match=r"sink_logits must be \(H,\)"):
        sink_softmax_attention(*torch.randn(3, 1, 2, 3, 4).unbind(0), torch.zeros(3))
