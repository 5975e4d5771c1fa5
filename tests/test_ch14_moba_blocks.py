"""MoBA's kernel strategy (attncourse.moba_blocks): one key block at a time, the queries that chose it gathered, equal to
PyTorch's attention under the selection's token mask, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attncourse.learned_sparse import blocks_to_mask, moba_gate, selected_attention
from attncourse.moba_blocks import moba_by_key_blocks


def _dense(q, k, v, sel, block):
    g = q.shape[1] // k.shape[1]
    mask = blocks_to_mask(sel, block, q.shape[2])
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask)


@pytest.mark.parametrize("b, h, hkv, t, block, top_k", [(2, 4, 2, 45, 8, 3), (1, 1, 1, 64, 16, 1),
                                                        (1, 2, 1, 33, 5, 9), (1, 3, 3, 50, 7, 2)])
def test_equals_pytorch_under_the_mask(b, h, hkv, t, block, top_k):
    gen = torch.Generator().manual_seed(t)
    q = torch.randn(b, h, t, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, t, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hkv, t, 8, generator=gen, dtype=torch.float64)
    sel = moba_gate(q, k, block, top_k)
    out, lse = moba_by_key_blocks(q, k, v, sel, block)
    torch.testing.assert_close(out, _dense(q, k, v, sel, block))
    torch.testing.assert_close(lse, selected_attention(q, k, v, sel, block).lse)


def test_every_block_is_causal_attention_and_half_precision():
    q, k, v = torch.randn(3, 1, 2, 40, 8).unbind(0)
    every = torch.ones(1, 2, 40, 5, dtype=torch.bool)
    torch.testing.assert_close(moba_by_key_blocks(q, k, v, every, 8)[0], F.scaled_dot_product_attention(q, k, v, is_causal=True))
    sel = moba_gate(q, k, 8, 2)
    out16, _ = moba_by_key_blocks(q.half(), k.half(), v.half(), sel, 8)  # scores and softmax in float32
    assert out16.dtype == torch.float16
    torch.testing.assert_close(out16.float(), _dense(q, k, v, sel, 8), rtol=2e-3, atol=2e-3)


def test_gradients_equal_dense_masked_gradients():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 30, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sel = moba_gate(q.detach(), k.detach(), 6, 2)
    w = torch.randn(1, 2, 30, 8, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad((moba_by_key_blocks(q, k, v, sel, 6)[0] * w).sum(), (q, k, v))
    ref = torch.autograd.grad((_dense(q, k, v, sel, 6) * w).sum(), (q, k, v))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


def test_bad_input_rejected():
    q, k, v = torch.randn(3, 1, 2, 16, 8).unbind(0)
    sel = moba_gate(q, k, 4, 2)
    with pytest.raises(ValueError, match="query"):
        moba_by_key_blocks(q[0], k, v, sel, 4)
    with pytest.raises(ValueError, match="multiple"):
        moba_by_key_blocks(torch.randn(1, 3, 16, 8), k, v, torch.ones(1, 3, 16, 4, dtype=torch.bool), 4)
    with pytest.raises(TypeError, match="bool"):
        moba_by_key_blocks(q, k, v, sel.float(), 4)
    with pytest.raises(ValueError, match="nB"):
        moba_by_key_blocks(q, k, v, sel[..., :3], 4)
    with pytest.raises(TypeError, match="block_size"):
        moba_by_key_blocks(q, k, v, sel, 4.0)
