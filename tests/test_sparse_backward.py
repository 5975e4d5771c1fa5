"""attncourse.sparse_backward: the key-block backward of selected attention against autograd and PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attncourse.learned_sparse import blocks_to_mask, moba_gate, nsa_select, compressed_attention, selected_attention, \
    selected_work
from attncourse.sparse_backward import selected_backward


@pytest.mark.parametrize("hkv, per_head", [(2, True), (1, False)])
def test_equals_autograd_through_pytorch_attention(hkv, per_head):
    gen = torch.Generator().manual_seed(0)
    b, h, t, d, blk = 2, 4, 29, 8, 4  # a short last block
    q = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, hkv, t, d, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sel = (moba_gate(q.detach(), k.detach(), blk, 3) if per_head
           else nsa_select(compressed_attention(q.detach(), k.detach(), v.detach(), blk)[1], hkv, 2, blk))
    fwd = selected_attention(q, k, v, sel, blk)
    go = torch.randn(fwd.out.shape, generator=gen, dtype=torch.float64)
    mask = blocks_to_mask(sel, blk, t)
    mask = mask if mask.shape[1] == h else mask.repeat_interleave(h // hkv, 1)
    ref_out = F.scaled_dot_product_attention(q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1),
                                             attn_mask=mask)
    torch.testing.assert_close(fwd.out, ref_out)
    ref = torch.autograd.grad((ref_out * go).sum(), (q, k, v))
    got = selected_backward(q.detach(), k.detach(), v.detach(), sel, blk, fwd.out.detach(), fwd.lse.detach(), go)
    for a, r in zip(got[:3], ref):
        torch.testing.assert_close(a, r)
    expected = int(mask.sum())  # every selected (query, key) score, causal: the forward's count
    assert got.pairs == expected == (selected_work(sel, blk, t)["keys"] * (h // sel.shape[1]))
    assert int(got.per_block.sum()) == int(sel.expand(b, h, t, sel.shape[-1]).sum() if per_head else
                                           sel.repeat_interleave(h // hkv, 1).sum())


def test_bad_input():
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 1, 8, 4)
    sel = torch.ones(1, 2, 8, 2, dtype=torch.bool)
    out, lse = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="selected"):
        selected_backward(q, k, k, sel.int().bool()[:, :, :, :1], 4, out, lse, out)
    with pytest.raises(ValueError, match="lse"):
        selected_backward(q, k, k, sel, 4, out, lse[..., :3], out)
