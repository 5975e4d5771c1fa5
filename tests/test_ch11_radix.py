"""attncourse.radix_cache (SGLang's RadixAttention cache) against a brute-force reference: the longest cached prefix
of a prompt is the longest common prefix with any cached sequence, its slots are the ones stored with those tokens,
slots are conserved, and eviction frees unreferenced leaves least recently used first."""

from __future__ import annotations

import random

import pytest

from attncourse.radix_cache import RadixCache, shared_prefix_workload


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_match_and_insert_equal_a_brute_force_over_the_cached_sequences():
    rng = random.Random(0)
    cache = RadixCache(100_000)
    slot_of = {}  # token prefix -> the slot stored with its last token (the first insertion wins)
    stored = []
    for _ in range(300):
        if stored and rng.random() < 0.6:  # share a prefix with an earlier sequence, then diverge
            base = rng.choice(stored)
            seq = base[:rng.randint(0, len(base))] + tuple(rng.randrange(4) for _ in range(rng.randint(0, 6)))
        else:
            seq = tuple(rng.randrange(4) for _ in range(rng.randint(1, 12)))
        query = seq[:rng.randint(0, len(seq))] + tuple(rng.randrange(4) for _ in range(rng.randint(0, 3)))
        slots, node = cache.match_prefix(list(query))
        best = max((lcp(query, s) for s in stored), default=0)
        assert len(slots) == best
        assert slots == [slot_of[query[:i + 1]] for i in range(best)]
        new = cache.alloc(len(seq))
        already = cache.insert(seq, new)
        assert already == max((lcp(seq, s) for s in stored), default=0)
        cache.free(new[:already])
        for i in range(already, len(seq)):
            slot_of[seq[:i + 1]] = new[i]
        stored.append(seq)
    assert cache.cached_tokens() == len(slot_of)  # every distinct prefix token stored once
    assert len(cache.free_slots) + cache.cached_tokens() == cache.capacity


def test_eviction_is_lru_over_unreferenced_leaves_and_spares_locked_paths():
    cache = RadixCache(12)
    for seq in ((1, 2, 3), (1, 2, 4), (5, 6), (7, 8)):
        slots = cache.alloc(len(seq))
        cache.free(slots[:cache.insert(seq, slots)])
    assert cache.cached_tokens() == 8  # [1 2] shared, then 3 | 4; 5 6; 7 8
    cache.match_prefix([1, 2, 3])  # touch (1 2 3): now the most recent
    _, held = cache.match_prefix([5, 6])
    cache.lock(held)  # a running request holds (5 6)
    assert cache.evict(1) == 1  # the least recently used unreferenced leaf: 4 (inserted before 7 8, never touched)
    assert len(cache.match_prefix([1, 2, 4])[0]) == 2
    assert cache.evict(1) == 2  # next: (7 8)
    assert cache.match_prefix([7, 8])[0] == []
    assert cache.evict(100) == 3  # 3, then [1 2] once childless; never the locked (5 6)
    assert len(cache.match_prefix([5, 6])[0]) == 2 and cache.cached_tokens() == 2
    cache.unlock(held)
    assert cache.evict(1) == 2 and cache.cached_tokens() == 0
    assert len(cache.free_slots) == 12
    with pytest.raises(ValueError):
        cache.unlock(held)


def test_fifo_and_drop_all_differ_from_lru_where_a_leaf_is_read_again():
    def run(policy):
        cache = RadixCache(6, policy)
        for seq in ((1, 2), (3, 4), (5, 6)):
            slots = cache.alloc(2)
            cache.insert(seq, slots)
        cache.match_prefix([1, 2])  # read again, not extended
        freed = cache.evict(2)
        return freed, [len(cache.match_prefix(list(s))[0]) for s in ((1, 2), (3, 4), (5, 6))]

    assert run("lru") == (2, [2, 0, 2])
    assert run("fifo") == (2, [0, 2, 2])
    assert run("drop_all") == (6, [0, 0, 0])


def test_serve_conserves_slots_and_lru_beats_dropping_everything():
    for seed in range(3):
        workload = shared_prefix_workload(seed, 150)
        rates = {}
        for policy in ("lru", "drop_all"):
            cache = RadixCache(4000, policy)
            hits = 0
            for prompt, output in workload:
                hits += cache.serve(prompt, output=output)
                assert len(cache.free_slots) + cache.cached_tokens() == cache.capacity
                assert len(set(cache.free_slots)) == len(cache.free_slots)
            rates[policy] = hits / sum(len(p) for p, _ in workload)
        assert rates["lru"] > rates["drop_all"] > 0


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        RadixCache(0)
    with pytest.raises(ValueError):
        RadixCache(8, "random")
    cache = RadixCache(8)
    with pytest.raises(TypeError):
        cache.match_prefix("abc")
    with pytest.raises(ValueError):
        cache.insert([1, 2], [0])
    with pytest.raises(MemoryError):
        cache.alloc(9)
    with pytest.raises(ValueError):
        cache.serve([])
