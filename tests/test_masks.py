"""The masks module: each mask function, composition, materialize, and agreement with PyTorch."""

import pytest
import torch
import torch.nn.functional as F

from attncourse import masks, scaled_dot_product_attention


def test_causal_is_top_left_like_pytorch():
    m = masks.materialize(masks.causal, 4, 6)
    assert torch.equal(m, torch.ones(4, 6, dtype=torch.bool).tril())
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, m),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_causal_bottom_right():
    m = masks.materialize(masks.causal_bottom_right(2, 5), 2, 5)
    assert m.tolist() == [[True, True, True, True, False], [True] * 5]
    # square: both alignments agree
    assert torch.equal(masks.materialize(masks.causal_bottom_right(5, 5), 5, 5),
                       masks.materialize(masks.causal, 5, 5))


def test_sliding_window():
    m = masks.materialize(masks.sliding_window(3), 6, 6)
    assert m.sum(-1).tolist() == [1, 2, 3, 3, 3, 3]
    assert not m[5, 2] and m[5, 3]
    assert torch.equal(masks.materialize(masks.sliding_window(100), 6, 6), masks.materialize(masks.causal, 6, 6))


def test_padding_and_composition():
    pad = masks.padding([3, 5])
    m = masks.materialize(pad, 4, 5, batch=2)
    assert m.shape == (2, 1, 4, 5)
    assert m[0, 0].sum(-1).tolist() == [3, 3, 3, 3] and m[1, 0].all()
    both = masks.materialize(masks.and_masks(masks.causal, pad), 5, 5, batch=2, heads=3)
    assert both.shape == (2, 3, 5, 5)
    assert torch.equal(both[0, 2], torch.ones(5, 5, dtype=torch.bool).tril() & (torch.arange(5) < 3))
    either = masks.materialize(masks.or_masks(masks.sliding_window(1), masks.padding([1])), 3, 3, batch=1)
    assert either[0, 0].tolist() == [[True, False, False], [True, True, False], [True, False, True]]


def test_to_additive():
    keep = torch.tensor([[True, False], [False, False]])
    add = masks.to_additive(keep)
    assert add.tolist() == [[0.0, float("-inf")], [float("-inf"), float("-inf")]]
    q = torch.randn(1, 2, 4)
    kv = torch.randn(1, 2, 4)
    torch.testing.assert_close(scaled_dot_product_attention(q, kv, kv, add),
                               scaled_dot_product_attention(q, kv, kv, keep))


@pytest.mark.parametrize("call, exc, words", [
    (lambda: masks.sliding_window(0), ValueError, "window must be positive"),
    (lambda: masks.sliding_window(2.5), TypeError, "window must be an int"),
    (lambda: masks.causal_bottom_right(0, 3), ValueError, "q_len"),
    (lambda: masks.padding(torch.ones(2, 2, dtype=torch.long)), ValueError, r"lengths must be a 1-D integer tensor, got shape \(2, 2\)"),
    (lambda: masks.materialize(masks.causal, 0, 3), ValueError, "q_len must be positive"),
    (lambda: masks.materialize("causal", 2, 3), TypeError, "mask_mod must be callable"),
    (lambda: masks.and_masks(), ValueError, "at least one"),
    (lambda: masks.to_additive(torch.ones(2)), TypeError, "bool"),
])
def test_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


def test_tree_mask_is_ancestry_and_a_chain_is_causal():
    parents = [-1, 0, 0, 1, 1, 2, -1, 6]
    keep = masks.tree_mask(parents)
    for i in range(len(parents)):
        ancestors, j = {i}, parents[i]
        while j >= 0:
            ancestors.add(j)
            j = parents[j]
        assert keep[i].nonzero().flatten().tolist() == sorted(ancestors)
    assert masks.tree_depths(parents).tolist() == [0, 1, 1, 2, 2, 2, 0, 1]
    chain = masks.tree_mask([-1, 0, 1, 2, 3])
    assert torch.equal(chain, masks.materialize(masks.causal, 5, 5))
    with pytest.raises(ValueError, match="parents\\[2\\]"):
        masks.tree_mask([-1, 0, 2])
    with pytest.raises(TypeError, match="parents"):
        masks.tree_mask("abc")


def test_tree_attention_equals_each_branch_decoded_alone():
    from attncourse import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, block_size=32, d_model=32, n_heads=4, n_layers=2, position="learned")).eval()
    prompt, draft = torch.randint(0, 20, (1, 9)), torch.randint(0, 20, (1, 6))
    parents = [-1, 0, 0, 1, 1, 2]
    with torch.no_grad():
        caches = model.new_caches(1, 15)
        model(prompt, caches)
        mask = torch.cat([torch.ones(6, 9, dtype=torch.bool), masks.tree_mask(parents)], dim=1)  # (6, 9 + 6)
        x = model.embed(draft, 9 + masks.tree_depths(parents))
        for block, cache in zip(model.blocks, caches):
            x = block(x, attn_mask=mask, kv_cache=cache)
        tree_logits = model.head(model.norm(x))  # (1, 6, V)
        for path in ([0, 1, 3], [0, 1, 4], [0, 2, 5]):
            alone = model(torch.cat([prompt, draft[:, path]], dim=1))[:, 9:]  # (1, 3, V)
            torch.testing.assert_close(tree_logits[:, path], alone, rtol=1e-5, atol=1e-5)
        # and the test can fail: a causal mask over the 6 drafts mixes the branches
        x = model.embed(draft, 9 + masks.tree_depths(parents))
        caches = model.new_caches(1, 15)
        model(prompt, caches)
        for block, cache in zip(model.blocks, caches):
            x = block(x, attn_mask=torch.ones(6, 15, dtype=torch.bool).tril(9), kv_cache=cache)
        assert not torch.allclose(model.head(model.norm(x))[:, [0, 2, 5]],
                                  model(torch.cat([prompt, draft[:, [0, 2, 5]]], dim=1))[:, 9:], atol=1e-4)
