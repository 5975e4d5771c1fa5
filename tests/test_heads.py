"""The attention-only transformer, repeated-segment data and the head scores (previous-token, induction,
sink), and attention_maps on the tiny GPT."""

import pytest
import torch

from attncourse import (GPT, AttnOnlyConfig, AttnOnlyTransformer, GPTConfig, attention_maps, induction_scores,
                        previous_token_scores, repeated_segment_tokens, repeated_tokens, sink_scores)
from attncourse.heads import token_losses


def test_repeated_tokens_layout():
    x = repeated_tokens(3, 5, 7, generator=torch.Generator().manual_seed(0))
    assert x.shape == (3, 10) and x.dtype == torch.int64 and x.max() < 7
    assert torch.equal(x[:, :5], x[:, 5:])


@pytest.mark.parametrize("seq_len, min_len, max_len", [(24, 4, None), (13, 1, 6), (8, 4, 4)])
def test_repeated_segment_tokens_repeat_at_varying_distance(seq_len, min_len, max_len):
    x, lens = repeated_segment_tokens(50, seq_len, 11, min_len=min_len, max_len=max_len,
                                      generator=torch.Generator().manual_seed(1))
    assert x.shape == (50, seq_len) and lens.shape == (50,)
    assert lens.min() >= min_len and lens.max() <= (max_len or seq_len // 2)
    for row, n in zip(x, lens.tolist()):
        assert torch.equal(row[seq_len - n:], row[seq_len - 2 * n:seq_len - n])
    if max_len != min_len:
        assert len(set(lens.tolist())) > 1  # the distance between the copies varies


def test_repeated_segment_tokens_bad_input():
    with pytest.raises(ValueError, match="min_len"):
        repeated_segment_tokens(2, 10, 5, min_len=6)
    with pytest.raises(TypeError, match="batch_size"):
        repeated_segment_tokens(2.0, 10, 5)


def planted_maps(t, seg_len=None, seed=0):
    """Random causal softmax maps (2, 3, T, T): head 1 a previous-token head, head 2 an induction head."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(2, 3, t, t, generator=g, dtype=torch.float64)
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    w = torch.softmax(s, -1)
    prev = torch.zeros(t, t, dtype=torch.float64)
    prev[0, 0] = 1
    prev[torch.arange(1, t), torch.arange(t - 1)] = 1
    w[:, 1] = prev
    if seg_len:
        ind = w[0, 2].clone()
        ind[seg_len:] = 0
        ind[torch.arange(seg_len, t), torch.arange(1, t - seg_len + 1)] = 1
        w[:, 2] = ind
    return w


def test_previous_token_scores():
    w = planted_maps(9)
    s = previous_token_scores(w)
    assert s.shape == (2, 3)
    torch.testing.assert_close(s[:, 1], torch.ones(2, dtype=torch.float64))
    ref = torch.stack([w[..., i, i - 1] for i in range(1, 9)], -1).mean(-1)
    torch.testing.assert_close(s, ref)


@pytest.mark.parametrize("seg_len", [1, 5, 7])
def test_induction_scores_by_loop(seg_len):
    w = planted_maps(2 * seg_len, seg_len)
    s = induction_scores(w, seg_len)
    ref = torch.stack([w[..., t, t - seg_len + 1] for t in range(seg_len, 2 * seg_len)], -1).mean(-1)
    torch.testing.assert_close(s, ref)
    torch.testing.assert_close(s[:, 2], torch.ones(2, dtype=torch.float64))
    assert (s[:, 0] < 0.9).all()


def test_sink_scores():
    w = planted_maps(8)
    torch.testing.assert_close(sink_scores(w), w[..., 0].mean(-1))
    torch.testing.assert_close(sink_scores(w, n_sink=2, min_query=3), w[..., 3:, :2].sum(-1).mean(-1))


def test_scores_bad_input():
    with pytest.raises(ValueError, match=r"\(\.\.\., 10, 10\)"):
        induction_scores(torch.rand(2, 8, 8), 5)
    with pytest.raises(ValueError, match="T, T"):
        previous_token_scores(torch.rand(2, 8, 7))
    with pytest.raises(TypeError, match="weights"):
        sink_scores([[1.0]])
    with pytest.raises(ValueError, match="min_query"):
        sink_scores(torch.rand(4, 4), min_query=4)


@pytest.mark.parametrize("attention", ["softmax", "sigmoid", "differential"])
def test_attn_only_transformer_shapes_maps_and_gradients(attention):
    torch.manual_seed(0)
    m = AttnOnlyTransformer(AttnOnlyConfig(11, block_size=16, d_model=16, n_heads=2, attention=attention))
    x = torch.randint(0, 11, (3, 13))
    logits, maps = m(x, return_weights=True)
    assert logits.shape == (3, 13, 11) and len(maps) == 2 and maps[0].shape == (3, 2, 13, 13)
    assert torch.equal(maps[1].triu(1), torch.zeros_like(maps[1]))  # causal
    if attention == "softmax":
        torch.testing.assert_close(maps[0].sum(-1), torch.ones(3, 2, 13))
    assert [w.shape for w in attention_maps(m, x)] == [w.shape for w in maps]
    loss = token_losses(m, x)
    assert loss.shape == (3, 12)
    loss.mean().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_attn_only_transformer_is_causal():
    torch.manual_seed(0)
    m = AttnOnlyTransformer(AttnOnlyConfig(7, block_size=10, d_model=8, n_heads=2, norm=False))
    x = torch.randint(0, 7, (2, 10))
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % 7
    torch.testing.assert_close(m(x)[:, :6], m(y)[:, :6])


def test_attn_only_transformer_bad_input():
    with pytest.raises(ValueError, match="attention"):
        AttnOnlyConfig(5, attention="linear")
    m = AttnOnlyTransformer(AttnOnlyConfig(5, block_size=4, d_model=8, n_heads=2))
    with pytest.raises(ValueError, match=r"block_size=4.*\(2, 6\)"):
        m(torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(TypeError, match="config"):
        AttnOnlyTransformer(GPTConfig(5))


def test_attention_maps_of_gpt_are_its_softmax_weights():
    torch.manual_seed(0)
    g = GPT(GPTConfig(9, block_size=12, d_model=16, n_heads=2, n_layers=3))
    x = torch.randint(0, 9, (2, 12))
    maps = attention_maps(g, x)
    assert len(maps) == 3 and maps[0].shape == (2, 2, 12, 12)
    torch.testing.assert_close(maps[2].sum(-1), torch.ones(2, 2, 12))
    assert torch.equal(maps[1].triu(1), torch.zeros_like(maps[1]))
    with pytest.raises(ValueError, match="no attention weights"):
        attention_maps(torch.nn.Linear(3, 3), torch.randn(2, 3))


# ----------------------------------------------------------------------------- ablation and the OV circuit


def test_planted_circuit_ablation_and_copying():
    from attncourse.heads import ablate_heads, ablation_effects, copying_scores, planted_induction_model, \
        repeated_half_loss

    for seed in range(3):
        model = planted_induction_model(32, 8, generator=torch.Generator().manual_seed(seed))
        tokens = repeated_tokens(64, 8, 32, generator=torch.Generator().manual_seed(100 + seed))
        with torch.no_grad():
            base = repeated_half_loss(model, tokens)
            _, maps = model(tokens, return_weights=True)
        assert base < 1.0 and induction_scores(maps[1], 8).mean(0)[0] > 0.8
        assert previous_token_scores(maps[0]).mean(0)[0] > 0.9
        effects = ablation_effects(model, tokens)  # (2, 2)
        assert effects[0, 0] > 1.5 and effects[1, 0] > 1.5  # both circuit heads are needed
        assert effects[:, 1].abs().max() < 0.2  # the random heads are not
        with torch.no_grad(), ablate_heads(model, [(0, 0), (1, 0)]):
            both = repeated_half_loss(model, tokens)
        assert both > base + 1.5
        with torch.no_grad():
            torch.testing.assert_close(repeated_half_loss(model, tokens), base)  # the hooks are gone
        copying = copying_scores(model)
        assert copying[1, 0] == 1.0 and copying[1, 1] < 0.5  # the induction head's OV copies every token


def test_ablation_zeroes_exactly_one_head_slice():
    from attncourse.heads import ATTENTIONS, ablate_heads

    torch.manual_seed(0)
    for attention in ATTENTIONS:
        model = AttnOnlyTransformer(AttnOnlyConfig(11, block_size=8, d_model=16, n_heads=2, attention=attention))
        tokens = torch.randint(0, 11, (2, 8))
        seen = []
        with torch.no_grad(), ablate_heads(model, [(1, 1)]):  # pre-hooks run in order: this one sees the result
            handle = model.attns[1].o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
            model(tokens)
        handle.remove()
        assert torch.equal(seen[0][..., 8:], torch.zeros_like(seen[0][..., 8:])) and seen[0][..., :8].abs().sum() > 0
    with pytest.raises(ValueError, match="layer, head"):
        with ablate_heads(model, [(2, 0)]):
            pass
