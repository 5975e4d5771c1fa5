"""GPT-2's initialisation and weight tying (attncourse.gpt_init), checked against the rule of Radford et al. 2019."""

import math

import pytest
import torch
from torch import nn

from attncourse.gpt import GPT, GPTConfig, lm_loss
from attncourse.gpt_init import gpt2_init, residual_projections, tie_weights


def small_gpt(n_layers=4):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, block_size=16, d_model=64, n_heads=4, n_layers=n_layers))


def test_gpt2_init_follows_the_rule():
    model = gpt2_init(small_gpt(4))
    projections = residual_projections(model)
    assert len(projections) == 8                                          # N = 2L residual layers
    ids = {id(p) for p in projections}
    for p in projections:                                                 # std 0.02 / sqrt(2L)
        assert p.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)) and id(m) not in ids:
            assert m.weight.std().item() == pytest.approx(0.02, rel=0.1)  # everything else: std 0.02
        if isinstance(m, nn.Linear) and m.bias is not None:
            assert (m.bias == 0).all()
        if isinstance(m, nn.LayerNorm):
            assert (m.weight == 1).all() and (m.bias == 0).all()
    plain = gpt2_init(small_gpt(4), scale_residual=False)
    assert all(p.weight.std().item() == pytest.approx(0.02, rel=0.1) for p in residual_projections(plain))


def test_scaled_residuals_keep_the_stream_from_growing_with_depth():
    tokens = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))

    def growth(scale, depth):
        model = gpt2_init(small_gpt(depth), scale_residual=scale)
        with torch.no_grad():
            h = model.embed(tokens, torch.arange(16))
            start = h.pow(2).mean().sqrt()
            for block in model.blocks:
                h = block(h, is_causal=True)
        return (h.pow(2).mean().sqrt() / start).item()

    assert growth(False, 16) > 1.5 * growth(False, 2)                     # unscaled: grows with depth
    assert growth(True, 16) < 1.3 * growth(True, 2)                       # scaled by 1/sqrt(2L): about flat


def test_tie_weights_shares_one_matrix():
    model = small_gpt(2)
    before = sum(p.numel() for p in model.parameters())
    tie_weights(gpt2_init(model))
    assert model.head.weight is model.tok.weight
    assert sum(p.numel() for p in model.parameters()) == before - 50 * 64
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(2))
    lm_loss(model, tokens).backward()
    grad = model.tok.weight.grad.clone()
    model.zero_grad()                                                     # the gradient has both uses: untied copies
    untied = small_gpt(2)
    untied.load_state_dict({k: v for k, v in model.state_dict().items()})
    untied.head.weight = nn.Parameter(model.tok.weight.detach().clone())
    lm_loss(untied, tokens).backward()
    torch.testing.assert_close(grad, untied.tok.weight.grad + untied.head.weight.grad)


def test_bad_input():
    with pytest.raises(TypeError, match="model"):
        gpt2_init(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model"):
        tie_weights(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="std"):
        gpt2_init(small_gpt(1), std=0.0)
