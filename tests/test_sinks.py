"""Streaming through sink + window caches: the one-forward evaluation equals token-by-token decoding, the
re-indexed cache reports positions inside the cache, and the helpers reject bad input."""

import pytest
import torch

from attncourse import GPT, GPTConfig
from attncourse.kv_cache import SinkWindowCache
from attncourse.sinks import (first_token_attention, in_cache_positions, next_token_nll, recompute_logits,
                              sink_losses, stream_decode_logits, streaming_logits, with_bos)


def tiny(position, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=20, block_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                         position=position)).eval()


@pytest.mark.parametrize("position", ["alibi", "none"])
@pytest.mark.parametrize("reindex", [True, False])
@pytest.mark.parametrize("window,n_sink", [(5, 2), (4, 0), (6, 1), (1, 3), (40, 4)])
def test_one_forward_equals_token_by_token_streaming(position, reindex, window, n_sink):
    model = tiny(position)
    tokens = torch.randint(0, 20, (2, 23), generator=torch.Generator().manual_seed(1))
    fast = streaming_logits(model, tokens, window, n_sink, reindex=reindex)
    slow = stream_decode_logits(model, tokens, window, n_sink, reindex=reindex)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window,n_sink", [(5, 2), (4, 0), (6, 1), (1, 3), (40, 4)])
def test_rope_cache_of_unrotated_keys_equals_the_one_forward(window, n_sink):
    """StreamingLLM's RoPE cache: keys stored before rotation, rotated by their rank inside the cache."""
    model = tiny("rope")
    tokens = torch.randint(0, 20, (2, 23), generator=torch.Generator().manual_seed(1))
    fast = streaming_logits(model, tokens, window, n_sink)
    slow = stream_decode_logits(model, tokens, window, n_sink)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    if window < 23:  # and it is not the cache of rotated keys: distances to the sinks differ
        assert not torch.allclose(fast, stream_decode_logits(model, tokens, window, n_sink, reindex=False),
                                  atol=1e-4) or n_sink == 0


def test_without_eviction_streaming_is_the_full_forward():
    model = tiny("alibi")
    tokens = torch.randint(0, 20, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(streaming_logits(model, tokens, 12, 0), model(tokens), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(streaming_logits(model, tokens, 3, 12), model(tokens), rtol=1e-5, atol=1e-6)


def test_reindexing_changes_alibi_but_not_a_position_free_model():
    tokens = torch.randint(0, 20, (1, 30), generator=torch.Generator().manual_seed(2))
    alibi, nope = tiny("alibi"), tiny("none")
    assert not torch.allclose(streaming_logits(alibi, tokens, 6, 2), streaming_logits(alibi, tokens, 6, 2, reindex=False))
    torch.testing.assert_close(streaming_logits(nope, tokens, 6, 2), streaming_logits(nope, tokens, 6, 2, reindex=False))


def test_in_cache_positions_by_hand():
    visible, key_pos, query_pos = in_cache_positions(6, window=2, n_sink=1)
    assert visible[5].tolist() == [True, False, False, False, True, True]
    assert key_pos[5][visible[5]].tolist() == [0, 1, 2] and int(query_pos[5]) == 2
    assert query_pos.tolist() == [0, 1, 2, 2, 2, 2]


def test_reindexed_cache_reports_positions_inside_the_cache():
    cache = SinkWindowCache(1, 1, 2, window=3, n_sink=1, reindex=True)
    for _ in range(10):
        cache.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    assert cache.positions.tolist() == [0, 7, 8, 9]  # absolute, slot order: 7 is overwritten next
    # the next token (10) lands in 7's slot: slot order [0, 10, 8, 9], ranks inside the cache [0, 3, 1, 2]
    assert cache.query_positions(1).tolist() == [3] and cache.key_positions(1).tolist() == [0, 3, 1, 2]
    assert cache.seen == 10
    with pytest.raises(TypeError, match="reindex"):
        SinkWindowCache(1, 1, 2, window=3, reindex=1)


def test_recompute_and_losses_align():
    model = tiny("alibi")
    stream = torch.randint(0, 19, (40,), generator=torch.Generator().manual_seed(3))
    rec = recompute_logits(model, stream[None, :-1], 7, bos=19)  # row r predicts stream[r + 7]
    with torch.no_grad():
        direct = model(with_bos(stream[None, 10:17], 19))[:, -1]  # predicts stream[17]
    torch.testing.assert_close(rec[:, 10], direct)
    losses = sink_losses(model, stream, cache=8, n_sink=1, bos=19, start=10)
    assert set(losses) == {"full cache", "window", "sinks + window", "sinks, absolute positions", "recompute window"}
    assert all(0 < v < 10 for v in losses.values())
    seq = with_bos(stream[None], 19)
    assert next_token_nll(model(seq).detach(), seq).shape == (1, 40)
    share = first_token_attention(model, seq[:, :20])
    assert share.shape == (2, 4) and bool(((share >= 0) & (share <= 1)).all())


def test_bad_input():
    model = tiny("learned")
    with pytest.raises(ValueError, match="position"):
        streaming_logits(model, torch.zeros(1, 5, dtype=torch.long), 3, 1)
    with pytest.raises(ValueError, match="tokens"):
        with_bos(torch.zeros(5, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="window"):
        streaming_logits(tiny("alibi"), torch.zeros(1, 5, dtype=torch.long), 0, 1)
