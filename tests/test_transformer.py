"""TransformerBlock against nn.TransformerEncoderLayer (pre- and post-norm, masks, gradients), FeedForward,
the classifier, and bad input."""

import pytest
import torch
from torch import nn

from attncourse.transformer import (DecoderBlock, EncoderDecoder, FeedForward, TransformerBlock, TransformerClassifier,
                                    to_torch_decoder_layer, to_torch_encoder_layer, to_torch_transformer)

TOL = dict(rtol=1e-10, atol=1e-10)


def make_block(d=16, h=4, d_ff=24, seed=0, **kw):
    torch.manual_seed(seed)
    block = TransformerBlock(d, h, d_ff, **kw).double()
    with torch.no_grad():  # non-trivial LayerNorm parameters, so copying them is tested too
        for norm in (block.norm1, block.norm2):
            norm.weight.add_(0.1 * torch.randn_like(norm.weight))
            norm.bias.add_(0.1 * torch.randn_like(norm.bias))
    return block.eval()


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("t", [1, 7])
def test_matches_torch_encoder_layer(norm_first, activation, t):
    block = make_block(norm_first=norm_first, activation=activation)
    ref = to_torch_encoder_layer(block)
    x = torch.randn(3, t, 16, dtype=torch.float64)
    torch.testing.assert_close(block(x), ref(x), **TOL)


@pytest.mark.parametrize("norm_first", [False, True])
def test_masks_match_torch(norm_first):
    block = make_block(norm_first=norm_first)
    ref = to_torch_encoder_layer(block)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    # PyTorch's boolean src_mask is True where attention is *not* allowed
    torch.testing.assert_close(block(x, is_causal=True), ref(x, src_mask=~causal), **TOL)
    lengths = torch.tensor([6, 4])
    pad = torch.arange(6) >= lengths[:, None]  # (B, T) True at padding
    ours = block(x, attn_mask=~pad[:, None, None, :])
    torch.testing.assert_close(ours, ref(x, src_key_padding_mask=pad), **TOL)


def test_gradients_match_torch():
    block = make_block(norm_first=True)
    ref = to_torch_encoder_layer(block).train()  # dropout is 0, so train mode is the same function
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    gx, = torch.autograd.grad(block(x).pow(2).sum(), x)
    gx_ref, = torch.autograd.grad(ref(x).pow(2).sum(), x)
    torch.testing.assert_close(gx, gx_ref, **TOL)
    g_ff = torch.autograd.grad(block(x).sum(), block.ff.linear1.weight)[0]
    g_ff_ref = torch.autograd.grad(ref(x).sum(), ref.linear1.weight)[0]
    torch.testing.assert_close(g_ff, g_ff_ref, **TOL)


def test_residual_and_weights():
    block = make_block(norm_first=True)
    with torch.no_grad():  # zero both branches' output projections: a pre-norm block becomes the identity
        block.attn.o_proj.weight.zero_(); block.attn.o_proj.bias.zero_()
        block.ff.linear2.weight.zero_(); block.ff.linear2.bias.zero_()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    out, w = block(x, return_weights=True)
    torch.testing.assert_close(out, x, rtol=0, atol=0)
    assert w.shape == (2, 4, 5, 5)


def test_feedforward_is_position_wise():
    torch.manual_seed(0)
    ff = FeedForward(8, 32).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(ff(x)[:, 3], ff(x[:, 3]), **TOL)
    assert sum(p.numel() for p in ff.parameters()) == 8 * 32 + 32 + 32 * 8 + 8


def test_block_parameter_count():
    block = TransformerBlock(64, 4)  # d_ff defaults to 4 d
    d = 64
    expected = (4 * d * d + 4 * d) + (8 * d * d + 4 * d + d) + 2 * 2 * d
    assert sum(p.numel() for p in block.parameters()) == expected
    ref = to_torch_encoder_layer(block)
    assert sum(p.numel() for p in ref.parameters()) == expected


def test_classifier_shapes_and_learning():
    torch.manual_seed(0)
    model = TransformerClassifier(vocab_size=10, n_classes=2, d_model=16, n_heads=2, n_layers=1)
    tokens = torch.randint(0, 10, (32, 8))
    labels = (tokens == 3).any(dim=1).long()  # a set-membership task: attention + pooling can do it
    assert model(tokens).shape == (32, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(40):
        loss = nn.functional.cross_entropy(model(tokens), labels)
        first = loss.item() if first is None else first
        opt.zero_grad(); loss.backward(); opt.step()
    assert loss.item() < 0.5 * first


def test_bad_input():
    with pytest.raises(ValueError, match="activation"):
        FeedForward(8, 16, "tanh")
    with pytest.raises(ValueError, match="d_ff"):
        FeedForward(8, 0)
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        to_torch_encoder_layer(TransformerBlock(16, 4, n_kv_heads=2))
    with pytest.raises(TypeError, match="block"):
        to_torch_encoder_layer(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="d_model=10"):
        TransformerBlock(10, 4)
    block = TransformerBlock(16, 4)
    with pytest.raises(ValueError, match=r"x must be .*\(5, 16\)"):
        block(torch.randn(5, 16))
    model = TransformerClassifier(10, 2, d_model=16, n_heads=2, n_layers=1, max_len=8)
    with pytest.raises(ValueError, match=r"tokens .*\(2, 9\)"):
        model(torch.zeros(2, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(2, 4))


# ----------------------------------------------------------------------------- the decoder and the encoder-decoder


def jitter_norms(module, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-trivial LayerNorm parameters, so copying them is tested too
        for m in module.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.add_(0.1 * torch.randn(m.weight.shape, generator=gen, dtype=m.weight.dtype))
                m.bias.add_(0.1 * torch.randn(m.bias.shape, generator=gen, dtype=m.bias.dtype))
    return module.eval()


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("t, s", [(1, 1), (5, 7), (7, 3)])
def test_decoder_block_matches_torch_decoder_layer(norm_first, t, s):
    torch.manual_seed(0)
    block = jitter_norms(DecoderBlock(16, 4, 24, norm_first=norm_first).double())
    ref = to_torch_decoder_layer(block)
    x, memory = torch.randn(3, t, 16, dtype=torch.float64), torch.randn(3, s, 16, dtype=torch.float64)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    pad = torch.arange(s) >= torch.tensor([s, max(1, s - 2), 1])[:, None]  # (B, S) True at padding
    ours, w = block(x, memory, memory_mask=~pad[:, None, None, :], return_weights=True)
    theirs = ref(x, memory, tgt_mask=~causal, memory_key_padding_mask=pad)
    torch.testing.assert_close(ours, theirs, **TOL)
    assert w.shape == (3, 4, t, s) and (w[pad[:, None, None, :].expand_as(w)] == 0).all()
    torch.testing.assert_close(block(x, memory, is_causal=False), ref(x, memory), **TOL)


def reversal_like(b=3, s=6, vocab=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(2, vocab, (b, s), generator=gen)
    src[1, 4:] = 0  # padding (pad_id 0)
    src[2, 2:] = 0
    tgt_in = torch.randint(1, vocab, (b, s - 1), generator=gen)
    return src, tgt_in


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_decoder_matches_nn_transformer(norm_first):
    torch.manual_seed(0)
    model = jitter_norms(EncoderDecoder(12, 12, d_model=16, n_heads=2, n_layers=2, d_ff=20, max_len=8,
                                        norm_first=norm_first).double())
    ref = to_torch_transformer(model)
    src, tgt_in = reversal_like()
    s, t = src.shape[1], tgt_in.shape[1]
    src_e = model.src_embed(src) + model.src_pos.weight[:s]
    tgt_e = model.tgt_embed(tgt_in) + model.tgt_pos.weight[:t]
    pad = src == 0
    with torch.no_grad():
        theirs = model.head(ref(src_e, tgt_e, tgt_mask=~torch.ones(t, t, dtype=torch.bool).tril(),
                                src_key_padding_mask=pad, memory_key_padding_mask=pad))
        torch.testing.assert_close(model(src, tgt_in), theirs, **TOL)
    assert sum(p.numel() for p in ref.parameters()) == sum(
        p.numel() for name, p in model.named_parameters() if not name.startswith(("src_", "tgt_", "head")))


def test_encoder_decoder_gradients_match_nn_transformer():
    torch.manual_seed(0)
    model = EncoderDecoder(12, 12, d_model=16, n_heads=2, n_layers=1, max_len=8, norm_first=True).double()
    ref = to_torch_transformer(model).train()  # dropout 0: train mode is the same function
    src, tgt_in = reversal_like()
    s, t = src.shape[1], tgt_in.shape[1]
    src_e = (model.src_embed(src) + model.src_pos.weight[:s]).detach().requires_grad_()
    pad = src == 0
    tgt_e = model.tgt_embed(tgt_in) + model.tgt_pos.weight[:t]
    theirs = ref(src_e, tgt_e, tgt_mask=~torch.ones(t, t, dtype=torch.bool).tril(), src_key_padding_mask=pad,
                 memory_key_padding_mask=pad)
    g_ref, = torch.autograd.grad(theirs.pow(2).sum(), src_e)
    src_e2 = src_e.detach().requires_grad_()
    x, keep = src_e2, model.key_padding(src)
    for block in model.encoder:
        x = block(x, attn_mask=keep)
    memory = model.encoder_norm(x)
    y = tgt_e
    for block in model.decoder:
        y = block(y, memory, memory_mask=keep)
    g, = torch.autograd.grad(model.decoder_norm(y).pow(2).sum(), src_e2)
    torch.testing.assert_close(g, g_ref, **TOL)
    assert (g[pad] == 0).all()  # nothing flows into padding: no query attends to it


def test_padding_does_not_change_the_output_and_greedy_matches_teacher_forcing():
    torch.manual_seed(0)
    model = EncoderDecoder(12, 12, d_model=16, n_heads=2, n_layers=2, max_len=10).double().eval()
    src = torch.randint(2, 12, (2, 5))
    padded = torch.cat([src, torch.zeros(2, 3, dtype=torch.long)], dim=1)  # (2, 8): three padding tokens
    tgt_in = torch.randint(1, 12, (2, 4))
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt_in), model(padded, tgt_in), **TOL)
        tokens, weights = model.greedy(padded, steps=4, start_id=1)
        teacher = model(padded, torch.cat([torch.ones(2, 1, dtype=torch.long), tokens[:, :-1]], dim=1))
    assert torch.equal(teacher.argmax(-1), tokens)
    assert len(weights) == 2 and weights[0].shape == (2, 2, 4, 8) and (weights[0][..., 5:] == 0).all()


def test_encoder_decoder_bad_input():
    model = EncoderDecoder(12, 12, d_model=16, n_heads=2, n_layers=1, max_len=8)
    with pytest.raises(ValueError, match=r"src .*\(2, 9\)"):
        model(torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="tgt_in"):
        model(torch.ones(2, 4, dtype=torch.long), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="n_layers"):
        EncoderDecoder(12, 12, n_layers=0)
    with pytest.raises(TypeError, match="model"):
        to_torch_transformer(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="block"):
        to_torch_decoder_layer(TransformerBlock(16, 4))


def test_block_without_biases_matches_torch_encoder_layer():
    """bias=False drops every bias (projections, FFN, LayerNorms), as nn.TransformerEncoderLayer(bias=False) does."""
    torch.manual_seed(0)
    block = TransformerBlock(16, 4, 24, bias=False, norm_first=True).double().eval()
    assert not [n for n, _ in block.named_parameters() if n.endswith("bias")]
    ref = to_torch_encoder_layer(block)
    assert sum(p.numel() for p in ref.parameters()) == sum(p.numel() for p in block.parameters())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(block(x), ref(x), **TOL)
    with pytest.raises(TypeError, match="bias"):
        TransformerBlock(16, 4, bias=1)
