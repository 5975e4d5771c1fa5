"""Checks for chapter 07, causal masks and the KV cache (solutions/07_causal_masks_kv_cache.ipynb)."""

from __future__ import annotations

import torch

from attncourse.kv_cache import KVCache, SinkWindowCache
from attncourse.masks import attention_sink, causal_bottom_right, materialize, materialize_at, sliding_window
from attncourse.mha import MultiHeadAttention
from attncourse.positions import sinusoidal_positions
from . import Case, exercise


@exercise("07-bottom-right-mask", "cache_causal_mask", points=1,
          forbid=("attncourse.masks.causal_bottom_right", "attncourse.mha.causal_mask_bottom_right"),
          hint="the Tq queries are the last Tq of the Tk positions: query i sits at i + Tk - Tq and sees "
               "every key j <= i + Tk - Tq (torch.tril with a diagonal offset does it in one line)")
def _mask():
    """A boolean (Tq, Tk) causal mask aligned bottom-right, for queries that follow a KV cache."""
    return [Case(f"Tq={tq}, Tk={tk}", (tq, tk), expected=materialize(causal_bottom_right(tq, tk), tq, tk),
                 compare="equal") for tq, tk in ((1, 1), (1, 7), (3, 8), (5, 5), (4, 6), (2, 13))]


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


@exercise("07-cache-update", "cache_update", points=2,
          hint="write k_new into buf_k[:, :, length:length + T_new] (same for v), then return the views "
               "buf_k[:, :, :length + T_new] and buf_v[:, :, :length + T_new]")
def _update():
    """Append new keys and values to preallocated buffers and return everything cached so far."""
    return _cache_cases(torch.Generator().manual_seed(70))


def _decode_reference(state: dict, x: torch.Tensor) -> torch.Tensor:
    mha = MultiHeadAttention(16, 4)
    mha.load_state_dict(state)
    pe = sinusoidal_positions(x.shape[1], 16)  # (T, d)
    with torch.no_grad():
        return mha(x + pe, is_causal=True)  # (B, T, d): the full forward the decode must reproduce


@exercise("07-position-offset-bug", "decode_fixed", points=2,
          hint="the token decoded at step t sits at absolute position t (the number of tokens already in "
               "the cache), not 0: add pe[t], exactly as the full forward adds pe[0 .. T-1]")
def _offset():
    """Fix a token-by-token decode loop that gives every new token the position vector of position 0."""
    gen = torch.Generator().manual_seed(71)
    cases = []
    for b, t in ((1, 6), (2, 9), (3, 1)):
        with torch.random.fork_rng():  # fresh weights without touching the notebook's global RNG
            torch.manual_seed(int(torch.randint(0, 10_000, (1,), generator=gen)))
            state = {k: v.clone() for k, v in MultiHeadAttention(16, 4).state_dict().items()}
        x = torch.randn(b, t, 16, generator=gen)
        cases.append(Case(f"B={b}, T={t}", (state, x), expected=_decode_reference(state, x), rtol=1e-4, atol=1e-5))
    return cases


def _visible_to_next(pos: torch.Tensor, n_sink: int, window: int) -> torch.Tensor:
    """(S,) bool: may the next query (at position max(pos) + 1) attend to each key position in `pos`?"""
    nxt = (pos.max() + 1).view(1)  # (1,) the next query's absolute position
    return materialize_at(attention_sink(n_sink, window), nxt, pos)[0]  # (S,)


@exercise("07-sink-eviction", "sink_window_keep", points=2,
          hint="the next query sits at newest + 1 and sees keys newest + 2 - window .. newest + 1, plus "
               "positions 0 .. n_sink - 1: keep p < n_sink or p > newest + 1 - window")
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


def _predictions() -> tuple[int, int, int]:
    nbytes = KVCache(2, 2, 16, 128, dtype=torch.float32).nbytes  # one layer, preallocated for 128 positions
    cache = SinkWindowCache(1, 1, 2, window=8, n_sink=4)
    for _ in range(1000):
        cache.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    allowed = int(materialize(sliding_window(3), 10, 10).sum())
    return nbytes, len(cache), allowed


@exercise("07-predict-sizes", "predicted_sizes", kind="value", points=1,
          hint="K and V: 2 x B x Hkv x capacity x D x 4 bytes; a sink + window cache keeps n_sink + window - 1 "
               "keys between steps; a window of 3 over 10 queries allows 1 + 2 + 3 + ... pairs, capped at 3 per row")
def _predict():
    """Predict a cache's bytes, a bounded cache's length, and a window mask's number of allowed pairs."""
    return [Case("(KVCache bytes, SinkWindowCache length after 1000 tokens, allowed pairs)",
                 expected=_predictions(), compare="equal")]
