"""Chapter 07's exercise 5 (predict a cache's bytes, a sink cache's length and a window mask's pairs, as a rule of the
configuration, with a long-context case no simulation can finish), solutions/07_causal_masks_kv_cache.ipynb."""

from __future__ import annotations

import torch

from attncourse.kv_cache import KVCache, SinkWindowCache
from attncourse.masks import materialize, sliding_window
from . import Case, exercise, limits
from .ch07 import _MASK_FUNCTIONS


# ----------------------------------------------------------------------------- 5. predict


SIZES_QUESTION = ((3, 2, 64, 100, 2), (4, 8, 5), (6, 9, 1))  # the configuration the exercise prints


def predicted_sizes_reference(cache: tuple, sink_cache: tuple, mask: tuple) -> tuple[int, int, int]:
    """The checker's reference, measured with the package: (bytes of a preallocated KVCache, len of a
    SinkWindowCache after some one-token updates, True entries of a materialised sliding-window mask).

    cache = (batch_size, n_kv_heads, head_dim, capacity, bytes_per_element: 2 or 4),
    sink_cache = (window, n_sink, n_tokens), mask = (q_len, k_len, window). The cache is built on the meta device
    (no memory, any capacity); the stream stops once an update leaves the length unchanged (the buffer's slots are
    all taken, and every later update overwrites one); the mask is materialised (small sizes only: a long one is
    counted by `_long_mask_pairs`, and -1 stands here)."""
    b, h, d, capacity, nbytes = cache
    dtype = {2: torch.bfloat16, 4: torch.float32}[nbytes]
    ring = SinkWindowCache(1, 1, 1, window=sink_cache[0], n_sink=sink_cache[1])
    for _ in range(sink_cache[2]):
        before = len(ring)
        ring.update(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))
        if len(ring) == before:
            break
    pairs = int(materialize(sliding_window(mask[2]), mask[0], mask[1]).sum()) if mask[0] * mask[1] <= 2 ** 24 else -1
    return KVCache(b, h, d, capacity, dtype=dtype, device="meta").nbytes, len(ring), pairs


def _long_mask_pairs(base: tuple[int, int, int], offset: tuple[int, int, int], scale: int) -> int:
    """Allowed pairs of the sliding-window mask (q_len, k_len, window) = scale * base + offset, too long to
    materialise. Every boundary of the allowed region moves linearly with the scale, so once the scale is large
    enough that their order is fixed, the count is a polynomial of degree 2 in it: materialised at four small
    scales, the quadratic through three must hit the fourth, and is evaluated at `scale` (exact integers)."""
    def pairs(s):
        q, k, w = (s * x + o for x, o in zip(base, offset))
        return int(materialize(sliding_window(w), q, k).sum())
    s0 = 16
    y0, y1, y2, y3 = (pairs(s0 + i) for i in range(4))
    second = y2 - 2 * y1 + y0  # 2a: constant for a quadratic
    assert y3 - 2 * y2 + y1 == second, (base, offset)
    t = scale - s0  # Newton's forward differences from s0
    return y0 + t * (y1 - y0) + t * (t - 1) // 2 * second


limits.SECONDS["07-predict-sizes"] = 30  # each case; the long one cannot finish by simulation: say so, do not hang


@exercise("07-predict-sizes", "predicted_sizes", points=1, category="predict",
          parts=("KVCache bytes", "SinkWindowCache length", "allowed pairs"),
          forbid=("attncourse.kv_cache.KVCache", "attncourse.kv_cache.SinkWindowCache", "attncourse.gqa.kv_cache_bytes",
                  *_MASK_FUNCTIONS),
          allow=(), ops=("torch",),
          prop_doc="the prediction is three counts in plain integers, written as a function of the configuration so "
                   "that no package call (the caches themselves, the mask functions, the checker's reference) can "
                   "stand in for it, and no simulation either: one case streams about 2^40 tokens and masks about "
                   "2^31 queries and keys, where a stream through a list or a count row by row cannot finish; equal "
                   "counts on every configuration, the exercise's and drawn ones, are the skill",
          hint="a preallocated cache holds keys and values for its whole capacity, whatever is filled, at the size of "
               "its dtype; a sink is kept forever once it has arrived, and a window cache keeps only the keys the "
               "next query may still see, however long the stream; materialize puts query i at position i "
               "(top-left): group the allowed pairs by their distance i - j, ask how many pairs each distance has "
               "when there are more or fewer queries than keys, and add the groups up in closed form")
def _predict():
    """Predict, as a function of the configuration, a KVCache's bytes, a SinkWindowCache's length after some
    one-token updates, and the allowed pairs of a sliding-window mask."""
    gen = torch.Generator().manual_seed(75)  # two more configurations, drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    configs = [SIZES_QUESTION]
    for evicting in (True, False):  # one stream long enough to evict, one not (yet)
        cache = (pick(1, 4), 2 ** pick(0, 3), 16 * pick(1, 8), pick(1, 300), 2 * pick(1, 2))
        window, n_sink = pick(1, 8), pick(0, 4)
        n_tokens = n_sink + window + pick(0, 12) if evicting else pick(1, n_sink + window - 1 if n_sink + window > 1
                                                                          else 1)
        q_len, k_len = (pick(1, 10), pick(10, 20)) if evicting else (pick(8, 16), pick(1, 7))  # Tq < Tk, Tq > Tk
        configs.append((cache, (window, n_sink, n_tokens), (q_len, k_len, pick(1, 6))))
    cases = [Case(f"cache (B, Hkv, D, capacity, bytes)={c}, sink cache (window, n_sink, tokens)={s}, "
                  f"mask (Tq, Tk, window)={m}", (c, s, m), expected=predicted_sizes_reference(c, s, m),
                  compare="equal") for c, s, m in configs]
    # a long context: a cache of ~2^31 positions, a stream of ~2^40 tokens, ~2^31 queries and keys under a window of
    # ~2^30: a simulation token by token or row by row cannot finish; the counts need their closed form
    cache = (pick(1, 8), 2 ** pick(0, 3), 64 * pick(1, 4), 2 ** 31 + pick(1, 10 ** 6), 2 * pick(1, 2))
    sink = (pick(2, 64), pick(0, 8), 2 ** 40 + pick(0, 10 ** 9))
    q0, k0, w0 = pick(8, 40), pick(8, 40), pick(4, 40)
    while w0 == k0 or q0 in (w0, k0, k0 + w0):  # distinct boundaries: the count is one quadratic in the scale
        q0, k0, w0 = pick(8, 40), pick(8, 40), pick(4, 40)
    offset, scale = (pick(0, 7), pick(0, 7), pick(1, 7)), 2 ** 26 + pick(0, 10 ** 5)
    mask = tuple(scale * x + o for x, o in zip((q0, k0, w0), offset))
    expected = predicted_sizes_reference(cache, sink, (1, 1, 1))[:2] + (_long_mask_pairs((q0, k0, w0), offset, scale),)
    cases.append(Case(f"a long context: cache (B, Hkv, D, capacity, bytes)={cache}, sink cache (window, n_sink, "
                      f"tokens)={sink}, mask (Tq, Tk, window)={mask}", (cache, sink, mask), expected=expected,
                      compare="equal"))
    return cases
