"""Luong et al.'s decoder with the attentional layer and input feeding, against a hand-unrolled loop."""

import pytest
import torch

from attncourse.luong import LuongSeq2Seq
from attncourse.seq2seq import PAD, Seq2SeqConfig, reverse_batch

SMALL = dict(min_len=2, max_len=6, embed_size=8, encoder_size=6, decoder_size=12, attention_size=5)


def gru(x, h, cell):
    """nn.GRUCell written out (PyTorch's gate order r, z, n)."""
    gi, gh = x @ cell.weight_ih.T + cell.bias_ih, h @ cell.weight_hh.T + cell.bias_hh
    (ir, iz, i_n), (hr, hz, hn) = gi.chunk(3, -1), gh.chunk(3, -1)
    r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
    return (1 - z) * torch.tanh(i_n + r * hn) + z * h


def reference(model, batch):
    """Luong eqs. 5-6 and section 3.3, one step at a time, general score s^T W h."""
    annotations, s = model.encode(batch.src, batch.lengths)
    feed, logits = torch.zeros_like(s), []
    prev = torch.full_like(batch.src[:, 0], 1)  # SOS
    for t in range(batch.tgt.shape[1]):
        y = model.embed(prev)
        s = gru(torch.cat([y, feed], -1) if model.input_feeding else y, s, model.decoder)
        scores = torch.einsum("bd,dk,bsk->bs", s, model.attention.W.weight, annotations)
        a = torch.softmax(scores.masked_fill(batch.src == PAD, float("-inf")), -1)
        c = torch.einsum("bs,bsk->bk", a, annotations)
        feed = torch.tanh(torch.cat([c, s], -1) @ model.combine.weight.T)
        logits.append(feed @ model.out.weight.T + model.out.bias)
        prev = batch.tgt[:, t]
    return torch.stack(logits, 1)


@pytest.mark.parametrize("input_feeding", [True, False])
def test_matches_the_hand_unrolled_loop_forward_and_backward(input_feeding):
    torch.manual_seed(0)
    model = LuongSeq2Seq(Seq2SeqConfig(**SMALL), "general", input_feeding=input_feeding)
    batch = reverse_batch(5, 2, 6, generator=torch.Generator().manual_seed(1))  # mixed lengths: padding
    ours, weights = model(batch.src, batch.lengths, batch.tgt)
    ref = reference(model, batch)
    torch.testing.assert_close(ours, ref)
    assert weights.shape == (*batch.tgt.shape, batch.src.shape[1])
    assert (weights[(batch.src == PAD)[:, None, :].expand_as(weights)] == 0).all()  # padding gets no weight
    g_ours = torch.autograd.grad(ours.square().sum(), list(model.parameters()), allow_unused=True)
    g_ref = torch.autograd.grad(ref.square().sum(), list(model.parameters()), allow_unused=True)
    for a, b in zip(g_ours, g_ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)


def test_input_feeding_carries_the_previous_attention_into_the_next_step():
    torch.manual_seed(0)
    config = Seq2SeqConfig(**SMALL)
    batch = reverse_batch(3, 4, 4, generator=torch.Generator().manual_seed(2))
    for feeding, depends in ((True, True), (False, False)):
        model = LuongSeq2Seq(config, "general", input_feeding=feeding)
        annotations, s = model.encode(batch.src, batch.lengths)
        feed = torch.zeros_like(s, requires_grad=True)  # h~_0: only input feeding reads it
        logits, _, _, _ = model.step(batch.tgt[:, 0], s, feed, annotations, batch.src != PAD)
        grad = torch.autograd.grad(logits.sum(), feed, allow_unused=True)[0]
        assert (grad is not None and grad.abs().sum() > 0) == depends


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="score must be"):
        LuongSeq2Seq(Seq2SeqConfig(**SMALL), "additive")
    with pytest.raises(TypeError, match="input_feeding must be a bool"):
        LuongSeq2Seq(Seq2SeqConfig(**SMALL), "general", input_feeding=1)
