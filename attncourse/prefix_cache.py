r"""Automatic prefix caching (vLLM): reuse the pages of any earlier request whose prompt starts the same way.

Copy-on-write (:meth:`PagedKVCache.fork`) shares pages between sequences the engine *knows* are related: the
samples of one request (``n > 1``), the beams of a beam search. Prefix caching finds sharing between
*unrelated* requests (the same system prompt, the earlier turns of a chat) by content:

* a **full** page of the prompt gets the hash of (the hash of the page before it, the token ids it holds), so
  a hash names the whole prefix up to the end of that page, not just the page's own tokens;
* a table maps hash -> page; a new prompt walks its pages from the start and reuses every page whose hash is
  in the table (reference count + 1, no copy, no recompute), stopping at the first miss;
* only full pages are registered (a partly filled page still changes), and at least the prompt's last token
  is always computed (the model needs its logits).

This class keeps one reference of its own on every registered page, so a cached prefix outlives the requests
that wrote it until :meth:`PrefixCache.evict` drops it (vLLM keeps such pages on an LRU free list instead and
evicts them only when the pool runs out).
"""

from __future__ import annotations

from typing import Callable

import torch

from . import _validate
from .paged_cache import PagedKVCache

__all__ = ["block_hashes", "PrefixCache"]


def block_hashes(token_ids: list[int], page_size: int) -> list[int]:
    """The chained hash of each full page of `token_ids` (a partly filled last page has none)."""
    if not isinstance(token_ids, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int)
                                                      for t in token_ids):
        raise TypeError(f"token_ids must be a list of ints, got {type(token_ids).__name__}")
    _validate.positive_int("page_size", page_size)
    hashes, parent = [], None
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = hash((parent, tuple(token_ids[start:start + page_size])))
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Content-addressed reuse of full pages of a :class:`PagedKVCache` across requests."""

    def __init__(self, cache: PagedKVCache):
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        self.cache = cache
        self.pages: dict[int, int] = {}  # block hash -> page holding that block's keys and values
        self.hits = self.misses = 0  # pages reused, pages computed (full pages only)

    def add_prompt(self, token_ids: list[int], compute_kv: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[int, int]:
        """Start a sequence for the prompt `token_ids`; returns ``(seq_id, tokens reused)``.

        Cached full pages are linked into the new block table; ``compute_kv(start, stop)`` is called once for
        the rest and must return k, v (Hkv, stop - start, D) of those prompt positions (what a prefill of the
        uncached suffix, attending to the cached prefix, would write). New full pages are registered.
        """
        if not callable(compute_kv):
            raise TypeError(f"compute_kv must be callable, got {type(compute_kv).__name__}")
        size = self.cache.page_size
        hashes = block_hashes(token_ids, size)
        if not token_ids:
            raise ValueError("token_ids must hold at least one token")
        seq = self.cache.add_sequence()
        table = self.cache.block_tables[seq]
        usable = (len(token_ids) - 1) // size  # always compute the last token
        for h in hashes[:usable]:
            page = self.pages.get(h)
            if page is None:
                break
            table.append(page)
            self.cache.refcount[page] += 1
            self.hits += 1
        reused = len(table) * size
        self.cache.lengths[seq] = reused
        k, v = compute_kv(reused, len(token_ids))
        self.cache.append(seq, k, v)
        for index in range(reused // size, len(hashes)):  # the full pages this prompt computed
            if hashes[index] not in self.pages:
                self.pages[hashes[index]] = table[index]
                self.cache.refcount[table[index]] += 1  # the cache's own reference
            self.misses += 1
        return seq, reused

    def evict(self) -> int:
        """Drop every cached page this class alone still holds; returns how many went back to the pool."""
        freed = 0
        for h, page in list(self.pages.items()):
            if self.cache.refcount[page] == 1:
                self.cache._release(page)
                del self.pages[h]
                freed += 1
        return freed
