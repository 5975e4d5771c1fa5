"""Chunked prefill equals one-shot prefill; the peak-memory counter is exact and shrinks with the chunk."""

import pytest
import torch
import torch.nn.functional as F

from attncourse import KVCache, MultiHeadAttention
from attncourse.chunked import chunked_causal_attention, chunked_prefill, peak_tensor_bytes
from attncourse.paged_cache import PagedKVCache


@pytest.mark.parametrize("chunk", [1, 3, 7, 13, 50])
def test_chunked_prefill_equals_one_shot(chunk):
    torch.manual_seed(0)
    mha = MultiHeadAttention(12, 3, 1).double()
    x = torch.randn(2, 13, 12, dtype=torch.float64)
    cache = KVCache(2, 1, 4, 16, dtype=torch.float64)
    torch.testing.assert_close(chunked_prefill(mha, x, chunk, cache), mha(x, is_causal=True))
    assert len(cache) == 13
    # the cache now holds the prompt: decoding one more token equals the full forward
    y = torch.randn(2, 1, 12, dtype=torch.float64)
    torch.testing.assert_close(mha(y, is_causal=True, kv_cache=cache), mha(torch.cat([x, y], 1), is_causal=True)[:, -1:])


def test_chunked_prefill_into_a_paged_sequence():
    torch.manual_seed(1)
    mha = MultiHeadAttention(8, 2).double()
    x = torch.randn(1, 11, 8, dtype=torch.float64)
    pool = PagedKVCache(4, 4, 2, 4, dtype=torch.float64)
    view = pool.sequence(pool.add_sequence())
    torch.testing.assert_close(chunked_prefill(mha, x, 4, view), mha(x, is_causal=True))
    assert pool.block_tables[0] == [0, 1, 2]


@pytest.mark.parametrize("chunk", [1, 4, 17, 64])
def test_chunked_causal_attention_equals_pytorch_with_gradients(chunk):
    torch.manual_seed(2)
    q, k, v = torch.randn(3, 2, 2, 17, 5, dtype=torch.float64, requires_grad=True).unbind(0)
    got = chunked_causal_attention(q, k, v, chunk)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, ref)
    g = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g))


def test_peak_tensor_bytes_counts_live_storages():
    def f(x):
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # 4000 more while a is alive
        del a
        return b + 1  # a freed: peak stays 8000
    result, peak = peak_tensor_bytes(f, torch.zeros(3))
    assert peak == 8000 and torch.equal(result, torch.full((1000,), 3.0))
    x = torch.zeros(100)
    assert peak_tensor_bytes(lambda: x[10:].view(10, 9).add_(1))[1] == 0  # views and in-place: nothing new


def test_peak_memory_shrinks_with_the_chunk():
    q, k, v = torch.randn(3, 1, 2, 128, 8).unbind(0)
    peaks = [peak_tensor_bytes(chunked_causal_attention, q, k, v, c)[1] for c in (128, 32, 8)]
    assert peaks[0] > 3 * peaks[1] > 9 * peaks[2] / 4
    assert peaks[0] >= 2 * 128 * 128 * 4  # at least the (B, H, T, T) float32 scores


def test_bad_input():
    mha = MultiHeadAttention(8, 2)
    with pytest.raises(TypeError, match="layer"):
        chunked_prefill(torch.nn.Linear(8, 8), torch.randn(1, 4, 8), 2, KVCache(1, 2, 4, 4))
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_prefill(mha, torch.randn(1, 4, 8), 0, KVCache(1, 2, 4, 4))
    with pytest.raises(TypeError, match="kv_cache"):
        chunked_prefill(mha, torch.randn(1, 4, 8), 2, None)
    with pytest.raises(ValueError, match=r"same length.*\(1, 4, 2\).*\(1, 5, 2\)"):
        chunked_causal_attention(torch.randn(1, 4, 2), torch.randn(1, 5, 2), torch.randn(1, 5, 2), 2)
    with pytest.raises(TypeError, match="fn"):
        peak_tensor_bytes(3)
