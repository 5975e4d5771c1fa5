"""Checks for chapter 11, long context in practice (solutions/11_long_context.ipynb)."""

from __future__ import annotations

import torch

from attncourse.masks import materialize, or_masks
from attncourse.online_softmax import AttentionState, finalize_attention_state, merge_attention_states
from attncourse.paged_cache import PagedKVCache
from attncourse.ring import ring_bytes_per_rank
from attncourse.sparse import global_tokens, local
from . import Case, exercise

# The configuration of exercise 4: a 128k-token prompt over 8 ranks, a LLaMA-3-8B-like layer in bfloat16.
RING_CONFIG = dict(batch=1, n_kv_heads=8, seq_len=131072, head_dim=128, world_size=8, bytes_per_element=2)


def _bigbird_reference(seq_len: int, window: int, n_global: int, table: torch.Tensor, block_size: int) -> torch.Tensor:
    band_and_global = materialize(or_masks(local(window), global_tokens(n_global)), seq_len, seq_len)  # (T, T)
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    return band_and_global | table[i // block_size, j // block_size]  # (T, T)


@exercise("11-bigbird-mask", "bigbird_mask", points=2,
          hint="three (T, T) boolean masks joined with |: the band |i - j| <= window // 2, the global rows and columns "
               "(i < n_global or j < n_global), and the random blocks table[i // block_size, j // block_size]; "
               "build i as a column (T, 1) and j as a row (1, T) so they broadcast")
def _bigbird():
    """BigBird's mask from its three parts, given the random block table."""
    gen = torch.Generator().manual_seed(11)
    cases = []
    for name, (t, w, g, bs, r) in {
        "T=16, window 4, 1 global, blocks of 4, 1 random block each": (16, 4, 1, 4, 1),
        "T=13 (not a multiple of the block), window 3, 2 global, blocks of 3": (13, 3, 2, 3, 2),
        "T=10, no global token, blocks of 1 (token-level random keys)": (10, 2, 0, 1, 3),
    }.items():
        n_blocks = -(-t // bs)
        table = torch.zeros(n_blocks, n_blocks, dtype=torch.bool)
        for qb in range(n_blocks):
            table[qb, torch.randperm(n_blocks, generator=gen)[:r]] = True
        cases.append(Case(name, (t, w, g, table, bs), expected=_bigbird_reference(t, w, g, table, bs), compare="equal"))
    return cases


def _paged_reference(pages: torch.Tensor, block_table: list[int], length: int) -> torch.Tensor:
    cache = PagedKVCache(pages.shape[0], pages.shape[2], pages.shape[1], pages.shape[3], dtype=pages.dtype)
    cache.k_pages = pages
    seq = cache.add_sequence()
    cache.block_tables[seq], cache.lengths[seq] = list(block_table), length
    return cache.gather(seq)[0]


@exercise("11-block-table", "read_sequence", points=2,
          hint="token t sits in page block_table[t // page_size] at offset t % page_size; either loop over t, or take "
               "pages[block_table] (n, Hkv, P, D), move the page axis next to the offsets (Hkv, n, P, D), flatten "
               "them to (Hkv, n*P, D) and keep the first `length` tokens")
def _block_table():
    """Read one sequence's keys (Hkv, L, D) out of a page pool through its block table."""
    gen = torch.Generator().manual_seed(12)
    pages = torch.randn(9, 2, 4, 3, generator=gen, dtype=torch.float64)  # (n_pages, Hkv, P, D)
    cases = []
    for name, table, length in (("pages out of order: [5, 0, 7], 10 tokens (last page partly filled)", [5, 0, 7], 10),
                                ("one page, 1 token", [3], 1),
                                ("full pages: [8, 2], 8 tokens", [8, 2], 8),
                                ("a page listed by two sequences is just read: [1, 1], 6 tokens", [1, 1], 6)):
        cases.append(Case(name, (pages, table, length), expected=_paged_reference(pages, table, length), compare="equal"))
    return cases


def _merge_reference(out_a, lse_a, out_b, lse_b):
    a = AttentionState(lse_a, torch.ones_like(lse_a), out_a)  # a normalised output is acc / l with l = 1 at m = lse
    b = AttentionState(lse_b, torch.ones_like(lse_b), out_b)
    return finalize_attention_state(merge_attention_states(a, b))


@exercise("11-merge-ranks", "merge_partials", points=2,
          forbid=("attncourse.merge_attention_states", "attncourse.online_softmax.merge_attention_states"),
          hint="lse = logaddexp(lse_a, lse_b); each side's weight is exp(lse_side - lse) (its share of the total "
               "softmax mass), so out = w_a * out_a + w_b * out_b; where both lse are -inf (no key on either rank) "
               "return zeros and -inf, not NaN")
def _merge_ranks():
    """Merge two ranks' normalised partial outputs and log-sum-exps into the result over both key blocks."""
    gen = torch.Generator().manual_seed(13)
    cases = []

    def add(name, out_a, lse_a, out_b, lse_b):
        cases.append(Case(name, (out_a, lse_a, out_b, lse_b), expected=tuple(_merge_reference(out_a, lse_a, out_b, lse_b))))

    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    add("(2, 5) query rows, head dim 4", r(2, 5, 4), r(2, 5), r(2, 5, 4), r(2, 5))
    add("very different masses (lse 30 vs -30)", r(3, 4), torch.full((3,), 30.0, dtype=torch.float64),
        r(3, 4), torch.full((3,), -30.0, dtype=torch.float64))
    lse_b = r(4)
    lse_b[1:3] = float("-inf")  # rank b had no visible key for rows 1 and 2 (a causal skip)
    add("rank b empty for some rows (lse -inf, output 0)", r(4, 3), r(4), torch.zeros(4, 3, dtype=torch.float64), lse_b)
    empty = torch.full((2,), float("-inf"), dtype=torch.float64)
    add("both empty: zeros and -inf, not NaN", torch.zeros(2, 3, dtype=torch.float64), empty,
        torch.zeros(2, 3, dtype=torch.float64), empty)
    return cases


@exercise("11-ring-bytes", "ring_prediction", kind="value", points=1,
          hint="one step sends one key block and one value block of T / W positions: 2 * B * Hkv * (T / W) * D * "
               "bytes_per_element; a rank sends W - 1 such steps (the last block it receives is never sent on)")
def _ring_bytes():
    """Predict (bytes one ring step sends, bytes one rank sends in total) for RING_CONFIG."""
    total = ring_bytes_per_rank(**RING_CONFIG)
    return [Case("(bytes per step, bytes per rank) for B=1, Hkv=8, T=131072, D=128, W=8, bfloat16",
                 expected=(total // (RING_CONFIG["world_size"] - 1), total), compare="equal")]
