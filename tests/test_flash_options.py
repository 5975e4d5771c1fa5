"""FlashAttention's options (window, softcap, ALiBi, dropout, varlen) in the tiled loop, forward and backward,
against the dense computation differentiated by autograd, and against PyTorch where PyTorch has the option."""

import pytest
import torch
import torch.nn.functional as F

from attncourse.flash_options import dense_reference, dropout_keep, flash_attention_options, varlen_attention

CASES = [dict(), dict(window=(3, 2)), dict(window=(5, None)), dict(is_causal=True), dict(window=(4, 0)),
         dict(softcap=2.0), dict(alibi_slopes=torch.tensor([0.5, 0.125, 1 / 32], dtype=torch.float64)),
         dict(dropout_p=0.3, seed=7), dict(window=(2, 2), softcap=1.5, is_causal=False, dropout_p=0.2, seed=3,
                                           alibi_slopes=torch.tensor([0.25, 0.5, 1.0], dtype=torch.float64))]


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("t_q,t_k", [(19, 19), (7, 23), (23, 7)])
def test_forward_and_gradients_match_the_dense_reference(opts, t_q, t_k):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, t_q, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, t_k, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out, lse = flash_attention_options(q, k, v, block_q=4, block_k=5, **opts)
    ref = dense_reference(q, k, v, **opts)
    torch.testing.assert_close(out, ref)
    d_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), d_out), torch.autograd.grad(ref, (q, k, v), d_out)):
        torch.testing.assert_close(a, b)


def test_against_pytorch_where_it_has_the_option():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    keep = (torch.arange(16)[:, None] - torch.arange(16)[None, :]).abs() <= 3  # two-sided window (3, 3)
    torch.testing.assert_close(flash_attention_options(q, k, v, window=(3, 3), block_q=4, block_k=4)[0],
                               F.scaled_dot_product_attention(q, k, v, attn_mask=keep))
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    bias = -slopes[:, None, None] * (torch.arange(16)[:, None] - torch.arange(16)[None, :]).abs()
    torch.testing.assert_close(flash_attention_options(q, k, v, alibi_slopes=slopes, block_q=4, block_k=4)[0],
                               F.scaled_dot_product_attention(q, k, v, attn_mask=bias))


def test_dropout_mask_is_regenerated_not_stored_and_has_rate_p():
    rows = torch.arange(4)
    full = dropout_keep(5, rows, torch.arange(64), torch.arange(64), 0.25)
    tile = dropout_keep(5, rows, torch.arange(16, 32), torch.arange(40, 64), 0.25)
    assert torch.equal(full[:, 16:32, 40:64], tile)  # any tile, recomputed exactly
    assert abs(1 - full.float().mean() - 0.25) < 0.02
    assert not torch.equal(full, dropout_keep(6, rows, torch.arange(64), torch.arange(64), 0.25))  # the seed matters
    q = torch.randn(1, 1, 12, 4, dtype=torch.float64)
    a = flash_attention_options(q, q, q, dropout_p=0.5, seed=1, block_q=4, block_k=4)[0]
    b = flash_attention_options(q, q, q, dropout_p=0.5, seed=2, block_q=4, block_k=4)[0]
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("is_causal,window", [(False, (None, None)), (True, (None, None)), (False, (2, 1))])
def test_varlen_equals_each_sequence_alone(is_causal, window):
    g = torch.Generator().manual_seed(2)
    lengths = [5, 1, 9, 4]
    cu = torch.tensor([0, 5, 6, 15, 19])
    q, k, v = (torch.randn(19, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = varlen_attention(q, k, v, cu, is_causal=is_causal, window=window, block_q=4, block_k=3)
    d_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    pieces, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        pieces.append(dense_reference(*(x[sl].transpose(0, 1)[None] for x in (q, k, v)), window=window,
                                      is_causal=is_causal)[0].transpose(0, 1))
        start += n
    ref = torch.cat(pieces)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, torch.autograd.grad(ref, (q, k, v), d_out)):
        torch.testing.assert_close(a, b)


def test_bad_input():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="window"):
        flash_attention_options(q, q, q, window=(-1, 2))
    with pytest.raises(ValueError, match="softcap"):
        flash_attention_options(q, q, q, softcap=0.0)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_attention_options(q, q, q, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attention_options(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        varlen_attention(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), torch.tensor([0, 3]))
