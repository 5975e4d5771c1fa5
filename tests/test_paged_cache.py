"""Paged KV cache: block tables, decode equal to contiguous caches and full attention, prefix sharing, waste."""

import pytest
import torch
import torch.nn.functional as F

from attncourse import KVCache, MultiHeadAttention, scaled_dot_product_attention
from attncourse.mha import repeat_kv
from attncourse.paged_cache import PagedKVCache, memory_waste, paged_attention


def kv(h, t, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h, t, d, generator=g, dtype=torch.float64), torch.randn(h, t, d, generator=g, dtype=torch.float64)


def test_append_gather_and_block_table_lookup():
    cache = PagedKVCache(8, 4, 2, 3, dtype=torch.float64)
    a, b = cache.add_sequence(), cache.add_sequence()
    ka, va = kv(2, 7, 3, 0)
    kb, vb = kv(2, 5, 3, 1)
    cache.append(a, ka[:, :3], va[:, :3])
    cache.append(b, kb, vb)  # interleaved: a's pages are not contiguous in the pool
    cache.append(a, ka[:, 3:], va[:, 3:])
    assert cache.block_tables == {a: [0, 3], b: [1, 2]} and cache.lengths == {a: 7, b: 5}
    for seq, (k, v) in ((a, (ka, va)), (b, (kb, vb))):
        got_k, got_v = cache.gather(seq)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
        for t in range(k.shape[1]):
            page, off = cache.slot(seq, t)
            assert torch.equal(cache.k_pages[page, :, off], k[:, t])
    assert cache.slot(a, 5) == (3, 1)
    cache.free(b)
    assert cache.pages_in_use == 2 and sorted(cache.free_pages) == [1, 2, 4, 5, 6, 7]


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (3, 1)])
def test_batched_paged_decode_equals_per_sequence_full_attention(n_heads, n_kv_heads):
    torch.manual_seed(0)
    d, page = 5, 3
    lengths = [1, 7, 4, 11]  # different lengths, one pool
    cache = PagedKVCache(12, page, n_kv_heads, d, dtype=torch.float64)
    ids, full = [], []
    for i, n in enumerate(lengths):
        s = cache.add_sequence()
        k, v = kv(n_kv_heads, n, d, 10 + i)
        for t in range(n):  # token by token, as decoding writes them
            cache.append(s, k[:, t:t + 1], v[:, t:t + 1])
        ids.append(s)
        full.append((k, v))
    for tq in (1, 2):
        ok = [i for i, n in enumerate(lengths) if n >= tq]
        q = torch.randn(len(ok), n_heads, tq, d, dtype=torch.float64)
        got = paged_attention(q, cache, [ids[i] for i in ok])
        for row, i in enumerate(ok):
            k, v = (repeat_kv(x[None], n_heads // n_kv_heads) for x in full[i])  # (1, H, L, D)
            n = lengths[i]
            keep = torch.ones(tq, n, dtype=torch.bool).tril(diagonal=n - tq)  # queries are the last tq tokens
            ref = F.scaled_dot_product_attention(q[row:row + 1], k, v, attn_mask=keep)
            torch.testing.assert_close(got[row:row + 1], ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunks", [[1] * 10, [4, 1, 5], [10]])
def test_mha_decoding_through_paged_sequences_equals_contiguous_cache(chunks):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, 2).double()
    x = torch.randn(3, 10, 16, dtype=torch.float64)
    pool = PagedKVCache(20, 4, 2, 4, dtype=torch.float64)
    for b in range(3):  # three sequences in one pool, each through its own view
        view, contiguous, start = pool.sequence(pool.add_sequence()), KVCache(1, 2, 4, 10, dtype=torch.float64), 0
        for size in chunks:
            piece = x[b:b + 1, start:start + size]
            got = mha(piece, is_causal=True, kv_cache=view)
            torch.testing.assert_close(got, mha(piece, is_causal=True, kv_cache=contiguous))
            start += size
        assert len(view) == 10
        torch.testing.assert_close(got, mha(x[b:b + 1], is_causal=True)[:, -chunks[-1]:])


def test_prefix_sharing_and_copy_on_write():
    cache = PagedKVCache(10, 4, 1, 2, dtype=torch.float64)
    parent = cache.add_sequence()
    k, v = kv(1, 6, 2, 3)  # a 6-token prompt: one full page and half of another
    cache.append(parent, k, v)
    child = cache.fork(parent)
    assert cache.block_tables[child] == cache.block_tables[parent] == [0, 1]
    assert cache.pages_in_use == 2 and cache.refcount[:2] == [2, 2]
    k1, v1 = kv(1, 3, 2, 4)
    k2, v2 = kv(1, 3, 2, 5)
    cache.append(child, k1, v1)  # writes into the shared half page: it is copied first
    cache.append(parent, k2, v2)
    assert cache.block_tables[child][0] == cache.block_tables[parent][0] == 0  # the full page stays shared
    assert cache.block_tables[child][1] != cache.block_tables[parent][1]
    torch.testing.assert_close(cache.gather(child)[0], torch.cat([k, k1], dim=1))
    torch.testing.assert_close(cache.gather(parent)[1], torch.cat([v, v2], dim=1))
    q = torch.randn(2, 1, 1, 2, dtype=torch.float64)
    got = paged_attention(q, cache, [parent, child])
    for row, (kk, vv) in enumerate(((torch.cat([k, k2], 1), torch.cat([v, v2], 1)), (torch.cat([k, k1], 1), torch.cat([v, v1], 1)))):
        torch.testing.assert_close(got[row], scaled_dot_product_attention(q[row], kk, vv))
    cache.free(parent)
    assert cache.refcount[0] == 1  # still the child's
    cache.free(child)
    assert cache.pages_in_use == 0


def test_memory_waste_accounting():
    w = memory_waste([1, 16, 17, 0], max_len=32, page_size=16)
    assert (w.used, w.contiguous, w.paged) == (34, 128, 64)
    assert abs(w.contiguous_waste - (1 - 34 / 128)) < 1e-12 and abs(w.paged_waste - (1 - 34 / 64)) < 1e-12
    cache = PagedKVCache(3, 2, 2, 4)
    assert cache.page_nbytes == 2 * 2 * 2 * 4 * 4


def test_pool_exhaustion_and_bad_input():
    cache = PagedKVCache(2, 2, 1, 2)
    s = cache.add_sequence()
    with pytest.raises(ValueError, match="pool is full"):
        cache.append(s, torch.zeros(1, 5, 2), torch.zeros(1, 5, 2))
    assert cache.lengths[s] == 0 and cache.pages_in_use == 0  # a failed append changes nothing
    cache.append(s, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
    with pytest.raises(ValueError, match=r"Hkv=1, T_new, D=2.*\(2, 1, 2\)"):
        cache.append(s, torch.zeros(2, 1, 2), torch.zeros(2, 1, 2))
    with pytest.raises(ValueError, match="not a live sequence"):
        cache.gather(99)
    with pytest.raises(TypeError, match="seq_id"):
        cache.fork("0")
    with pytest.raises(ValueError, match="outside sequence"):
        cache.slot(s, 7)
    with pytest.raises(ValueError, match=r"query must be \(B=1"):
        paged_attention(torch.zeros(1, 1, 1, 3), cache, [s])  # head dim 3, the pool holds 2
    with pytest.raises(ValueError, match="at least Tq=2"):
        paged_attention(torch.zeros(1, 1, 2, 2), cache, [s])
    with pytest.raises(ValueError, match="n_pages"):
        PagedKVCache(0, 2, 1, 2)
    with pytest.raises(ValueError, match="lengths"):
        memory_waste([3, 40], max_len=32, page_size=4)
    with pytest.raises(TypeError, match="seq_ids"):
        paged_attention(torch.zeros(1, 1, 1, 2), cache, s)


# ----------------------------------------------------------------------------- in place, ALiBi, prefix caching


def _filled_cache(lengths, h_kv=2, d=8, page=4, seed=0):
    from attncourse.paged_cache import PagedKVCache

    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(64, page, h_kv, d, dtype=torch.float64)
    ids = [cache.add_sequence() for _ in lengths]
    full = {s: torch.randn(2, h_kv, n, d, generator=g, dtype=torch.float64) for s, n in zip(ids, lengths)}
    for t in range(max(lengths)):  # round-robin: pages interleave
        for s, n in zip(ids, lengths):
            if t < n:
                cache.append(s, full[s][0][:, t:t + 1], full[s][1][:, t:t + 1])
    return cache, ids, full


@pytest.mark.parametrize("pages_per_step", [1, 2, 5])
@pytest.mark.parametrize("t_q", [1, 3])
def test_paged_attention_with_alibi_equals_dense(pages_per_step, t_q):
    from attncourse.positions import alibi_slopes

    cache, ids, full = _filled_cache([5, 13, 3, 9])
    q = torch.randn(4, 6, t_q, 8, dtype=torch.float64)
    slopes = alibi_slopes(6).double()
    got = paged_attention(q, cache, ids, alibi_slopes=slopes, pages_per_step=pages_per_step)
    for row, s in enumerate(ids):
        k, v = (x.repeat_interleave(3, dim=0) for x in full[s])  # (H, L, D)
        n = k.shape[1]
        q_pos, k_pos = torch.arange(n - t_q, n)[:, None], torch.arange(n)[None, :]
        bias = (-slopes[:, None, None] * (q_pos - k_pos)).masked_fill(k_pos > q_pos, float("-inf"))
        torch.testing.assert_close(got[row], F.scaled_dot_product_attention(q[row], k, v, attn_mask=bias))


def test_paged_attention_makes_no_dense_copy():
    from attncourse.chunked import peak_tensor_bytes

    cache, ids, _ = _filled_cache([200, 120], h_kv=2, d=16, page=8)
    q = torch.randn(2, 4, 1, 16, dtype=torch.float64)
    _, in_place = peak_tensor_bytes(paged_attention, q, cache, ids)
    one_sequence = 2 * 200 * 16 * 8  # (Hkv, L, D) float64 keys of the longest sequence
    assert in_place < one_sequence  # less than a copy of one sequence's keys


def test_prefix_cache_reuses_full_blocks_only():
    from attncourse.paged_cache import PagedKVCache
    from attncourse.prefix_cache import PrefixCache, block_hashes

    cache = PagedKVCache(32, 4, 1, 2, dtype=torch.float64)
    prefix = PrefixCache(cache)
    calls = []

    def kv_of(tokens):
        def compute(start, stop):
            calls.append((start, stop))
            t = torch.tensor(tokens[start:stop], dtype=torch.float64)[None, :, None].expand(1, -1, 2)  # (1, n, 2)
            return t.clone(), -t

        return compute

    system = list(range(100, 110))  # 10 tokens: two full pages of 4 and two tokens
    first, reused = prefix.add_prompt(system + [1, 2], kv_of(system + [1, 2]))
    assert reused == 0 and calls[-1] == (0, 12)
    second, reused = prefix.add_prompt(system + [7, 8, 9], kv_of(system + [7, 8, 9]))
    assert reused == 8 and calls[-1] == (8, 13)  # the two full pages of the system prompt are reused
    assert cache.block_tables[second][:2] == cache.block_tables[first][:2]
    for s, tokens in ((first, system + [1, 2]), (second, system + [7, 8, 9])):
        assert cache.gather(s)[0][0, :, 0].tolist() == [float(t) for t in tokens]
    assert block_hashes([1, 2, 3, 4, 5], 4) != block_hashes([9, 2, 3, 4, 5], 4)
    assert block_hashes([5, 6, 7, 8], 4) != block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1:]  # chained: the prefix counts
    _, reused = prefix.add_prompt(system[:8], kv_of(system[:8]))  # the whole prompt cached: its last token recomputed
    assert reused == 4
    cache.free(first)
    cache.free(second)
    assert prefix.evict() > 0
