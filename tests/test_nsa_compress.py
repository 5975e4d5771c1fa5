"""NSA's learned block compression: overlapping blocks through an MLP, against the mean pool and dense references."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attncourse.learned_sparse import compressed_attention, mean_pool_blocks
from attncourse.nsa_compress import BlockCompressor, block_starts, compressed_attention_learned


def _averaging(dim, block_len):
    c = BlockCompressor(dim, block_len, block_len, hidden=dim, act=nn.Identity()).double()
    with torch.no_grad():
        c.mlp[0].weight.copy_(torch.cat([torch.eye(dim, dtype=torch.float64)] * block_len, 1) / block_len)
        c.mlp[0].bias.zero_()
        c.mlp[2].weight.copy_(torch.eye(dim, dtype=torch.float64))
        c.mlp[2].bias.zero_()
    return c


def test_averaging_weights_give_the_mean_pool_and_chapter_14s_branch():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 3, 32, 8, generator=gen, dtype=torch.float64).unbind(0)
    comp = _averaging(8, 4)
    torch.testing.assert_close(comp(k), mean_pool_blocks(k, 4))
    out, probs = compressed_attention_learned(q, comp(k), comp(v), 4, 4)
    ref_out, ref_probs = compressed_attention(q, k, v, 4)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(probs, ref_probs)


def test_overlapping_blocks_against_a_loop_and_sdpa():
    gen = torch.Generator().manual_seed(1)
    T, L, S = 29, 8, 4
    comp = BlockCompressor(6, L, S, hidden=16).double()
    with torch.no_grad():
        comp.pos.normal_(generator=gen)
    x = torch.randn(2, 2, T, 6, generator=gen, dtype=torch.float64)
    starts = block_starts(T, L, S)
    assert starts.tolist() == [0, 4, 8, 12, 16, 20]  # complete blocks only: the last ends at token 27
    loop = torch.stack([comp.mlp((x[:, :, s:s + L] + comp.pos).flatten(-2)) for s in starts.tolist()], -2)
    torch.testing.assert_close(comp(x), loop)
    q = torch.randn(2, 2, T, 6, generator=gen, dtype=torch.float64)
    kc, vc = comp(x), comp(x.flip(-1))
    out, probs = compressed_attention_learned(q, kc, vc, L, S)
    done = (starts + L - 1)[None, :] <= torch.arange(T)[:, None]  # (T, nC)
    rows = done.any(-1)
    ref = F.scaled_dot_product_attention(q[:, :, rows], kc, vc, attn_mask=done[rows])
    torch.testing.assert_close(out[:, :, rows], ref)
    assert torch.all(out[:, :, ~rows] == 0) and torch.all(probs[:, :, ~rows] == 0)


def test_gradients_reach_the_mlp_and_the_position_embedding():
    comp = BlockCompressor(4, 4, 2)
    q, k = torch.randn(1, 1, 16, 4), torch.randn(1, 1, 16, 4)
    out, _ = compressed_attention_learned(q, comp(k), comp(k), 4, 2)
    out.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in comp.parameters())


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="stride"):
        BlockCompressor(4, 4, 5)
    with pytest.raises(ValueError, match="nC"):
        compressed_attention_learned(torch.randn(1, 1, 16, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), 4, 2)


def test_selection_importance_sums_the_overlapping_blocks():
    from attncourse.nsa_compress import selection_importance
    probs = torch.rand(2, 1, 5, 7, dtype=torch.float64)  # (B, H, T, nC): blocks of 8 at stride 4 over T = 32
    starts = block_starts(32, 8, 4).tolist()
    imp = selection_importance(probs, 8, 8, 4)
    for j in range(8):  # selection block j: tokens [4j, 4j + 4)
        over = [i for i, s in enumerate(starts) if s < 4 * j + 4 and s + 8 > 4 * j]
        torch.testing.assert_close(imp[..., j], probs[..., over].sum(-1))


def test_mean_compression_reproduces_chapter_14s_nsa_run():
    from attncourse.nsa_compress import train_learned_nsa
    from attncourse.sparse_recall import RecallConfig, train_recall
    cfg = RecallConfig(seq_len=16, block_size=4, budget=8, steps=5, batch=8, lr=1e-2)
    ours, ref = train_learned_nsa(0, cfg, compress="mean", eval_batch=32), train_recall("nsa", 0, cfg, eval_batch=32)
    for key in ("accuracy", "recall", "keys_read", "entries_read"):
        assert ours[key] == pytest.approx(ref[key])
    with pytest.raises(ValueError, match="compress"):
        train_learned_nsa(0, cfg, compress="max")
