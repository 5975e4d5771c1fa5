"""KV caches: the protocol with MultiHeadAttention, decode == full attention, bounded rolling caches, errors."""

import pytest
import torch
import torch.nn.functional as F

from attncourse import MultiHeadAttention, masks
from attncourse.kv_cache import KVCache, SinkWindowCache, caches_for
from attncourse.chunked import peak_tensor_bytes
from attncourse.gpt import GPTConfig


def decode_in_chunks(mha, x, cache, chunks, mask_mod=None):
    """Run x (B, T, d) through mha in chunks of the given sizes, with cache; concatenate the outputs."""
    outs, start = [], 0
    for size in chunks:
        piece = x[:, start:start + size]
        if mask_mod is None:
            outs.append(mha(piece, is_causal=True, kv_cache=cache))
        else:
            outs.append(mha(piece, attn_mask=cache.attn_mask(size, mask_mod), kv_cache=cache))
        start += size
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (6, 2), (4, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("chunks", [[1] * 9, [4, 1, 1, 3], [9]])
def test_cached_decode_equals_full_causal_attention(n_heads, n_kv_heads, chunks):
    torch.manual_seed(0)
    mha = MultiHeadAttention(24, n_heads, n_kv_heads).double()
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    cache = KVCache(2, n_kv_heads, 24 // n_heads, capacity=12, dtype=torch.float64)
    got = decode_in_chunks(mha, x, cache, chunks)
    torch.testing.assert_close(got, mha(x, is_causal=True))
    # ... and the full forward equals PyTorch's kernel on the same projections
    q, k, v = mha.project_qkv(x)
    g = n_heads // n_kv_heads
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)
    torch.testing.assert_close(mha(x, is_causal=True), mha.o_proj(ref.transpose(1, 2).reshape(2, 9, 24)))
    assert len(cache) == 9 and cache.seen == 9


def test_update_returns_everything_and_is_preallocated():
    cache = KVCache(1, 2, 4, capacity=5)
    buf = cache.k.data_ptr()
    k1, v1 = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    k, v = cache.update(k1, v1)
    assert k.shape == (1, 2, 3, 4) and torch.equal(k, k1) and torch.equal(v, v1)
    k2, v2 = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    k, v = cache.update(k2, v2)
    assert torch.equal(k, torch.cat([k1, k2], 2)) and torch.equal(v, torch.cat([v1, v2], 2))
    assert cache.k.data_ptr() == buf and k.data_ptr() == buf  # views of the preallocated buffer
    assert cache.nbytes == 2 * 1 * 2 * 5 * 4 * 4
    assert cache.key_positions(1).tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="full"):
        cache.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    cache.reset()
    assert len(cache) == 0 and cache.update(k1, v1)[0].shape == (1, 2, 3, 4)


def test_bad_input_is_rejected():
    cache = KVCache(2, 2, 4, capacity=8)
    with pytest.raises(ValueError, match="k and v"):
        cache.update(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4))  # wrong Hkv
    with pytest.raises(ValueError, match="k and v"):
        cache.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 2, 4))  # k, v disagree
    with pytest.raises(TypeError, match="dtype"):
        cache.update(torch.randn(2, 2, 1, 4, dtype=torch.float64), torch.randn(2, 2, 1, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="k must be"):
        cache.update([1], torch.randn(2, 2, 1, 4))
    with pytest.raises(ValueError, match="capacity"):
        KVCache(1, 1, 4, capacity=0)
    with pytest.raises(ValueError, match="n_sink"):
        SinkWindowCache(1, 1, 4, window=4, n_sink=-2)
    with pytest.raises(ValueError, match="window"):
        SinkWindowCache(1, 1, 4, window=0)


@pytest.mark.parametrize("n_sink,window", [(0, 4), (2, 3), (1, 1), (3, 6)])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("chunks", [[1] * 20, [7, 1, 1, 5, 1, 5], [20]])
def test_rolling_cache_equals_masked_full_attention(n_sink, window, n_kv_heads, chunks):
    torch.manual_seed(1)
    mha = MultiHeadAttention(16, 4, n_kv_heads).double()
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    mask_mod = masks.attention_sink(n_sink, window)
    cache = SinkWindowCache(2, n_kv_heads, 4, window=window, n_sink=n_sink)
    got = decode_in_chunks(mha, x, cache, chunks, mask_mod)
    full = mha(x, attn_mask=masks.materialize(mask_mod, 20, 20))
    torch.testing.assert_close(got, full)
    assert len(cache) <= cache.max_size == n_sink + window - 1 and cache.capacity == n_sink + window


def test_rolling_cache_stays_bounded_and_keeps_the_right_positions():
    cache = SinkWindowCache(1, 1, 2, window=4, n_sink=2)
    sizes = []
    for t in range(30):
        k = torch.full((1, 1, 1, 2), float(t))  # the key's value is its position
        expected = cache.key_positions(1).tolist()  # positions of what update returns
        keys, _ = cache.update(k, k)
        assert keys[0, 0, :, 0].tolist() == [float(p) for p in expected]
        sizes.append(len(cache))
    assert max(sizes) == 5 and sizes[-1] == 5  # live keys; the buffer has 6 slots
    # ring order: token p >= 2 sits in slot 2 + (p - 2) % 4, so 26..29 fill slots 2..5 in order here
    assert cache.positions.tolist() == [0, 1, 26, 27, 28, 29]
    assert cache.k[0, 0, :, 0].tolist() == [0.0, 1.0, 26.0, 27.0, 28.0, 29.0]
    assert cache.nbytes == 2 * 6 * 2 * 4
    # the next token overwrites 26 (slot 2): the query sees the sinks and the last window, its own key included
    assert cache.key_positions(1).tolist() == [0, 1, 30, 27, 28, 29]
    assert cache.attn_mask(1, masks.attention_sink(2, 4)).all()
    cache.update(torch.full((1, 1, 1, 2), 30.0), torch.zeros(1, 1, 1, 2))
    assert cache.positions.tolist() == [0, 1, 30, 27, 28, 29]  # out of temporal order
    assert cache.slot_of(31) == 3 and cache.slot_of(1) == 1


def test_ring_buffer_writes_token_p_to_slot_p_mod_w():
    cache = SinkWindowCache(1, 1, 1, window=5)  # Mistral's rolling buffer: no sinks
    for t in range(13):
        cache.update(torch.full((1, 1, 1, 1), float(t)), torch.zeros(1, 1, 1, 1))
        assert cache.slot_positions[t % 5] == t
    assert cache.positions.tolist() == [10, 11, 12, 8, 9]
    assert cache.k[0, 0, :, 0].tolist() == [10.0, 11.0, 12.0, 8.0, 9.0]


def test_decode_step_allocates_no_cache_storage():
    cache = SinkWindowCache(2, 2, 8, window=16, n_sink=4)
    for _ in range(40):  # wrap the ring twice
        cache.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    buf_k, buf_v = cache.k.data_ptr(), cache.v.data_ptr()
    k_new, v_new = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    (keys, values), peak = peak_tensor_bytes(cache.update, k_new, v_new)
    one_token = k_new.numel() * k_new.element_size()
    assert peak < one_token, f"a decode step created {peak} bytes of tensors"  # no copy of the window
    assert cache.k.data_ptr() == buf_k and cache.v.data_ptr() == buf_v  # the same buffers
    assert keys.untyped_storage().data_ptr() == buf_k and values.untyped_storage().data_ptr() == buf_v  # views
    assert keys.shape == (2, 2, 20, 8)


def test_the_old_concatenating_cache_would_fail_the_allocation_test():
    """The test above can fail: a cache that concatenates and gathers creates a window's worth of bytes."""
    k_old, k_new = torch.randn(2, 2, 19, 8), torch.randn(2, 2, 1, 8)

    def cat_and_gather(k_new):
        k = torch.cat([k_old, k_new], dim=2)
        return k[:, :, torch.arange(20) >= 1]

    _, peak = peak_tensor_bytes(cat_and_gather, k_new)
    assert peak >= k_old.numel() * k_old.element_size()


def test_chunk_updates_match_one_token_updates():
    torch.manual_seed(0)
    ks = torch.randn(1, 2, 23, 3)
    a, b = SinkWindowCache(1, 2, 3, window=4, n_sink=2), SinkWindowCache(1, 2, 3, window=4, n_sink=2)
    for t in range(23):
        a.update(ks[:, :, t:t + 1], ks[:, :, t:t + 1])
    start = 0
    for size in (9, 1, 6, 7):
        b.update(ks[:, :, start:start + size], ks[:, :, start:start + size])
        start += size
    assert a.positions.tolist() == b.positions.tolist()
    torch.testing.assert_close(a.k, b.k)


def test_decode_step_sees_exactly_sinks_plus_window():
    cache = SinkWindowCache(1, 1, 2, window=3, n_sink=1)
    for t in range(10):
        keys, _ = cache.update(torch.full((1, 1, 1, 2), float(t)), torch.zeros(1, 1, 1, 2))
    assert sorted(keys[0, 0, :, 0].tolist()) == [0.0, 7.0, 8.0, 9.0]  # sink 0, then 7, 8 and the new 9 (slot order)
    assert keys[0, 0, :, 0].tolist() == [0.0, 7.0, 8.0, 9.0][:1] + [float(p) for p in cache.positions[1:].tolist()]


def test_caches_for_config():
    cfg = GPTConfig(vocab_size=5, d_model=16, n_heads=4, n_kv_heads=2, n_layers=3)
    caches = caches_for(cfg, 2, 10)
    assert len(caches) == 3 and all(isinstance(c, KVCache) for c in caches)
    assert caches[0].k.shape == (2, 2, 10, 4)
    assert KVCache.for_model(cfg, 2, 10)[0].capacity == 10
    cfg = GPTConfig(vocab_size=5, d_model=16, n_heads=4, n_layers=2, window=4, n_sink=1)
    caches = caches_for(cfg, 1, 100)
    assert all(isinstance(c, SinkWindowCache) and c.window == 4 and c.n_sink == 1 for c in caches)
