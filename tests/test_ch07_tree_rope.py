"""Chapter 07's tree verification with RoPE: one forward over a tree of drafts, each node rotated at cache length +
its depth and masked to its ancestors, equals decoding each branch alone through the cache; rotating the tree as a
chunk (consecutive positions) does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attncourse import KVCache, MultiHeadAttention, apply_rope, masks, merge_heads, repeat_kv
from attncourse import scaled_dot_product_attention


def verify_tree(layer, prompt_x, draft_x, positions, keep, n_kv=2):
    head_dim = layer.d_model // layer.n_heads
    cache = KVCache(1, n_kv, head_dim, capacity=prompt_x.shape[1] + draft_x.shape[1], dtype=prompt_x.dtype)
    layer(prompt_x, is_causal=True, kv_cache=cache)
    q, k, v = layer.project_qkv(draft_x)
    q, k = (apply_rope(t, positions, inv_freq=layer.inv_freq) for t in (q, k))
    keys, values = cache.update(k, v)
    mask = torch.cat([torch.ones(len(positions), prompt_x.shape[1], dtype=torch.bool), keep], dim=1)
    rep = layer.n_heads // n_kv
    out = scaled_dot_product_attention(q, repeat_kv(keys, rep), repeat_kv(values, rep), mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True))
    return layer.o_proj(merge_heads(out))


@pytest.mark.parametrize("parents", [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2], [-1, 0, 0, 0, 3, 3, 1]])
def test_tree_with_rope_equals_each_branch_decoded_alone(parents):
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, n_kv_heads=2, rope_base=10_000.0).double().eval()
    prompt_x = torch.randn(1, 7, 32, dtype=torch.float64)
    draft_x = torch.randn(1, len(parents), 32, dtype=torch.float64)
    keep, depth = masks.tree_mask(parents), masks.tree_depths(parents)
    leaves = [n for n in range(len(parents)) if n not in parents]
    with torch.no_grad():
        tree = verify_tree(layer, prompt_x, draft_x, 7 + depth, keep)
        chunk = verify_tree(layer, prompt_x, draft_x, 7 + torch.arange(len(parents)), keep)
        for leaf in leaves:
            path = [leaf]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            path = path[::-1]
            cache = KVCache(1, 2, 8, capacity=7 + len(path), dtype=torch.float64)
            layer(prompt_x, is_causal=True, kv_cache=cache)
            alone = torch.cat([layer(draft_x[:, [n]], kv_cache=cache) for n in path], dim=1)
            torch.testing.assert_close(tree[:, path], alone)
            # and so does one causal forward over the prompt followed by the branch
            full = layer(torch.cat([prompt_x, draft_x[:, path]], dim=1), is_causal=True)[:, 7:]
            torch.testing.assert_close(tree[:, path], full)
    if len(set(depth.tolist())) < len(parents):  # a real tree (not a chain): consecutive positions are wrong
        assert not torch.allclose(chunk, tree, atol=1e-6)
    else:
        torch.testing.assert_close(chunk, tree)  # a chain's depths are consecutive positions
