"""Checks for chapter 07, causal masks and the KV cache (solutions/07_causal_masks_kv_cache.ipynb)."""

from __future__ import annotations

import math

import torch

from attncourse.kv_cache import KVCache, SinkWindowCache
from attncourse.masks import attention_sink, causal_bottom_right, materialize, materialize_at, sliding_window
from attncourse.mha import MultiHeadAttention
from attncourse.positions import sinusoidal_positions
from . import Case, exercise

_MASK_FUNCTIONS = ("attncourse.masks.causal_bottom_right", "attncourse.masks.sliding_window",
                   "attncourse.masks.attention_sink", "attncourse.masks.materialize",
                   "attncourse.masks.materialize_at", "attncourse.mha.causal_mask_bottom_right")


# ----------------------------------------------------------------------------- 1. the mask of a cached chunk


def _reference_cache_mask(q_len: int, k_len: int, window: int | None) -> torch.Tensor:
    mod = causal_bottom_right(q_len, k_len)
    if window is not None:  # bottom-right aligned window: shift the queries to their absolute positions
        q_pos = torch.arange(q_len) + (k_len - q_len)  # (Tq,)
        return materialize_at(sliding_window(window), q_pos, torch.arange(k_len))  # (Tq, Tk)
    return materialize(mod, q_len, k_len)  # (Tq, Tk)


def _shortcut_cache_mask_tril(q_len, k_len, window=None):
    """Two triangles of ones: must be refused (torch.tril)."""
    ones = torch.ones(q_len, k_len, dtype=torch.bool)
    keep = ones.tril(diagonal=k_len - q_len)  # (Tq, Tk)
    return keep if window is None else keep & ~ones.tril(diagonal=k_len - q_len - window)


def _shortcut_cache_mask_masks(q_len, k_len, window=None):
    """The course's mask functions: must be refused."""
    q_pos = torch.arange(q_len) + (k_len - q_len)
    mod = attention_sink(0, window if window is not None else k_len)
    return materialize_at(mod, q_pos, torch.arange(k_len))


@exercise("07-cache-mask", "cache_mask", points=2, category="implement",
          forbid=_MASK_FUNCTIONS + ("torch.tril", "torch.triu", "torch.nn.attention.bias.causal_lower_right"),
          shortcuts=(_shortcut_cache_mask_tril, _shortcut_cache_mask_masks),
          hint="the new queries are the last ones of the keys' positions: first give each query its absolute "
               "position, then compare a column of query positions with a row of key positions (broadcasting), "
               "once for the future and once for the window's far edge")
def _cache_mask_cases():
    """The (Tq, Tk) mask of a chunk of new queries after a KV cache, with an optional sliding window."""
    cases = []
    for tq, tk, w in ((1, 1, None), (1, 7, None), (3, 8, None), (5, 5, None), (2, 13, None), (4, 6, 3),
                      (1, 9, 4), (6, 6, 2), (3, 10, 1), (2, 5, 50)):
        cases.append(Case(f"Tq={tq}, Tk={tk}, window={w}", (tq, tk, w), expected=_reference_cache_mask(tq, tk, w),
                          compare="equal"))
    return cases


# ----------------------------------------------------------------------------- 2. the cache update


def _cache_cases(gen: torch.Generator) -> list[Case]:
    cases = []
    for name, (b, h, cap, d, filled, t_new) in {"empty cache, prefill of 4": (2, 2, 8, 4, 0, 4),
                                                "3 cached, decode 1": (1, 3, 6, 2, 3, 1),
                                                "5 cached, append 3 to fill it": (2, 1, 8, 4, 5, 3),
                                                "empty cache, a single token": (1, 1, 1, 3, 0, 1)}.items():
        cache = KVCache(b, h, d, cap, dtype=torch.float64)
        old_k, old_v = (torch.randn(b, h, filled, d, generator=gen, dtype=torch.float64) for _ in range(2))
        if filled:
            cache.update(old_k, old_v)
        buf_k, buf_v = cache.k.clone(), cache.v.clone()  # (B, Hkv, capacity, D): what the learner receives
        k_new, v_new = (torch.randn(b, h, t_new, d, generator=gen, dtype=torch.float64) for _ in range(2))
        expected = tuple(t.clone() for t in cache.update(k_new, v_new))  # (B, Hkv, filled + T_new, D) each
        cases.append(Case(name, (buf_k, buf_v, filled, k_new, v_new), expected=expected, compare="equal"))
    return cases


def _shortcut_update_kvcache(buf_k, buf_v, length, k_new, v_new):
    """The package's KVCache around the learner's buffers: must be refused."""
    b, h, capacity, d = buf_k.shape
    cache = KVCache(b, h, d, capacity, dtype=buf_k.dtype)
    cache.k, cache.v, cache.seen = buf_k, buf_v, length
    return cache.update(k_new, v_new)


def _shortcut_update_cat(buf_k, buf_v, length, k_new, v_new):
    """New tensors by concatenation (the values are right, the buffers untouched): must be refused."""
    return torch.cat([buf_k[:, :, :length], k_new], dim=2), torch.cat([buf_v[:, :, :length], v_new], dim=2)


@exercise("07-cache-update", "cache_update", points=2, category="implement",
          forbid=("attncourse.kv_cache.KVCache", "attncourse.kv_cache.SinkWindowCache", "torch.cat", "torch.concat",
                  "torch.concatenate", "torch.stack", "torch.hstack", "torch.dstack"),
          shortcuts=(_shortcut_update_kvcache, _shortcut_update_cat),
          hint="the buffers already have room: write the new entries into the slice of the sequence axis that "
               "starts where the filled part ends, then hand back views of the filled part of each buffer "
               "(slicing makes views, not copies)")
def _update():
    """Append new keys and values to preallocated buffers and return everything cached so far."""
    return _cache_cases(torch.Generator().manual_seed(70))


# ----------------------------------------------------------------------------- 3. find the bug


def _decode_reference(state: dict, x: torch.Tensor) -> torch.Tensor:
    mha = MultiHeadAttention(16, 4)
    mha.load_state_dict(state)
    pe = sinusoidal_positions(x.shape[1], 16)  # (T, d)
    with torch.no_grad():
        return mha(x + pe, is_causal=True)  # (B, T, d): the full forward the decode must reproduce


@exercise("07-decode-bug", "decode_fixed", points=2, category="bug",
          bug_words=("offset", "position zero", "same position for every", "always at position"),
          hint="print what the full forward adds to the token at time t and what the loop adds to it; "
               "they agree at t of zero only")
def _decode_bug():
    """Fix a token-by-token decode loop that disagrees with the full forward."""
    gen = torch.Generator().manual_seed(71)
    cases = []
    for b, t in ((1, 6), (2, 9), (3, 1)):
        with torch.random.fork_rng():  # fresh weights without touching the notebook's global RNG
            torch.manual_seed(int(torch.randint(0, 10_000, (1,), generator=gen)))
            state = {k: v.clone() for k, v in MultiHeadAttention(16, 4).state_dict().items()}
        x = torch.randn(b, t, 16, generator=gen)
        cases.append(Case(f"B={b}, T={t}", (state, x), expected=_decode_reference(state, x), rtol=1e-4, atol=1e-5))
    return cases


# ----------------------------------------------------------------------------- 4. sink + window eviction


def _visible_to_next(pos: torch.Tensor, n_sink: int, window: int) -> torch.Tensor:
    """(S,) bool: may the next query (at position max(pos) + 1) attend to each key position in `pos`?"""
    nxt = (pos.max() + 1).view(1)  # (1,) the next query's absolute position
    return materialize_at(attention_sink(n_sink, window), nxt, pos)[0]  # (S,)


@exercise("07-sink-eviction", "sink_window_keep", points=2, category="implement",
          forbid=_MASK_FUNCTIONS + ("attncourse.kv_cache.SinkWindowCache",),
          shortcuts=(_visible_to_next,),
          hint="the next query sits one past the newest key; a key stays if that query can still see it, either "
               "as one of the first n_sink tokens or because it is still inside that query's window")
def _evict():
    """Which cached positions a sink + window cache must keep after an update (bool (S,) mask)."""
    cases = []
    for positions, n_sink, window in (([0, 1, 2, 3, 4, 5], 0, 3), ([0, 1, 2, 3, 4, 5, 6, 7, 8], 2, 4),
                                      ([0, 1, 5, 6, 7, 8], 2, 4), ([0, 3, 4, 5], 1, 1), ([0, 1, 2], 4, 2),
                                      ([0, 1, 2, 3, 96, 97, 98, 99, 100], 4, 5)):
        pos = torch.tensor(positions)
        # a key is kept iff the next query (hence every later one) may still attend to it
        cases.append(Case(f"positions {positions}, n_sink={n_sink}, window={window}", (pos, n_sink, window),
                          expected=_visible_to_next(pos, n_sink, window), compare="equal"))
    return cases


# ----------------------------------------------------------------------------- 5. predict


def _predictions() -> tuple[int, int, int]:
    nbytes = KVCache(2, 2, 16, 128, dtype=torch.float32).nbytes  # one layer, preallocated for 128 positions
    cache = SinkWindowCache(1, 1, 2, window=8, n_sink=4)
    for _ in range(1000):
        cache.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    allowed = int(materialize(sliding_window(3), 10, 10).sum())
    return nbytes, len(cache), allowed


@exercise("07-predict-sizes", "predicted_sizes", kind="value", points=1, category="predict",
          parts=("KVCache bytes", "SinkWindowCache length after 1,000 tokens", "allowed pairs"),
          hint="a preallocated cache holds keys and values for its whole capacity, four bytes each; between steps "
               "a bounded cache keeps only what the next query needs besides the key it brings itself; count the "
               "window's pairs row by row, the first rows are short")
def _predict():
    """Predict a cache's bytes, a bounded cache's length, and a window mask's number of allowed pairs."""
    return [Case("(KVCache bytes, SinkWindowCache length after 1000 tokens, allowed pairs)",
                 expected=_predictions(), compare="equal")]


# ----------------------------------------------------------------------------- 6. experiment


def window_dropped_mass(seed: int, seq_len: int, window: int, slope: float, head_dim: int = 16) -> float:
    """Reference: the mean over queries of the full-causal attention weight (ALiBi slope `slope`) that a
    sliding window of `window` keys would drop, for random queries and keys drawn from `seed` (float64)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, head_dim, generator=gen, dtype=torch.float64)  # (T, D)
    k = torch.randn(seq_len, head_dim, generator=gen, dtype=torch.float64)  # (T, D)
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]  # (T, 1), (1, T)
    scores = q @ k.T / math.sqrt(head_dim) + slope * (j - i)  # (T, T): ALiBi bias slope * (j - i)
    weights = torch.softmax(scores.masked_fill(j > i, float("-inf")), dim=-1)  # (T, T) full causal
    return float(weights.masked_fill(i - j < window, 0.0).sum(-1).mean())


def _dropped_mass_cases():
    cases = []
    for seed in (0, 1, 2):
        for t, w, m in ((64, 8, 0.0), (64, 8, 0.25), (64, 16, 1 / 64), (40, 4, 1 / 16)):
            cases.append(Case(f"seed={seed}, T={t}, window={w}, slope={m:g}", (seed, t, w, m),
                              expected=window_dropped_mass(seed, t, w, m), rtol=1e-6, atol=1e-9))
    return cases


@exercise("07-window-dropped-mass", "dropped_mass", points=2, category="experiment",
          hint="draw the queries and then the keys from one generator seeded as described, in float64; build the "
               "full causal weights with the ALiBi bias, then add up, per query, the weight on keys the window "
               "leaves out, and average over the queries")
def _dropped_mass():
    """Measure how much full-causal attention a sliding window throws away, per ALiBi slope, over seeds."""
    return _dropped_mass_cases()
