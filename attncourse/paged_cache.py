r"""A paged KV cache (PagedAttention, Kwon et al. 2023): fixed-size pages in one pool, a block table
per sequence, prefix sharing with reference counts and copy-on-write.

A contiguous cache reserves ``max_len`` slots for every sequence up front; most sequences stop early
and the rest is wasted. Here keys and values live in a pool of pages of ``page_size`` token slots,

    k_pages, v_pages: (n_pages, Hkv, page_size, D)

and sequence s owns the pages listed in its block table: token t of s sits in page
``table[s][t // page_size]`` at offset ``t % page_size`` (:meth:`PagedKVCache.slot`). A sequence
wastes at most one partly filled page. :meth:`PagedKVCache.fork` lets a second sequence point at the
same pages (a shared prompt); a page with more than one owner is copied before it is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _validate
from .sdpa import compute_dtype as _compute_dtype

_NEG_INF = float("-inf")

__all__ = ["PagedKVCache", "PagedSequence", "paged_attention", "paged_varlen_attention", "MemoryWaste", "memory_waste"]


class PagedKVCache:
    """A pool of `n_pages` pages of `page_size` tokens each, for one layer, shared by many sequences.

    Sequences are created with :meth:`add_sequence` (or :meth:`fork`), grown with :meth:`append`,
    read with :meth:`gather` and released with :meth:`free`. Running out of pages raises ValueError.
    """

    def __init__(self, n_pages: int, page_size: int, n_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        self.n_pages = _validate.positive_int("n_pages", n_pages)
        self.page_size = _validate.positive_int("page_size", page_size)
        self.n_kv_heads = _validate.positive_int("n_kv_heads", n_kv_heads)
        self.head_dim = _validate.positive_int("head_dim", head_dim)
        self.k_pages = torch.zeros(n_pages, n_kv_heads, page_size, head_dim, dtype=dtype, device=device)
        self.v_pages = torch.zeros_like(self.k_pages)  # (n_pages, Hkv, page_size, D)
        self.refcount = [0] * n_pages  # owners of each page; 0 = free
        self.free_pages = list(range(n_pages - 1, -1, -1))  # a stack: pop() hands out page 0 first
        self.block_tables: dict[int, list[int]] = {}  # sequence id -> its pages, in order
        self.lengths: dict[int, int] = {}  # sequence id -> tokens stored
        self._next_id = 0

    # ------------------------------------------------------------------ bookkeeping
    def _seq(self, seq_id: object) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise TypeError(f"seq_id must be an int, got {type(seq_id).__name__}")
        if seq_id not in self.block_tables:
            raise ValueError(f"seq_id {seq_id} is not a live sequence (live: {sorted(self.block_tables)})")
        return seq_id

    def _allocate(self) -> int:
        if not self.free_pages:
            raise ValueError(f"the pool is full: all {self.n_pages} pages of {self.page_size} tokens are in use")
        page = self.free_pages.pop()
        self.refcount[page] = 1
        return page

    def _release(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self.free_pages.append(page)

    def add_sequence(self) -> int:
        """Start an empty sequence; returns its id."""
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self.block_tables[seq_id], self.lengths[seq_id] = [], 0
        return seq_id

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every page of `seq_id` (no copy: reference counts go up)."""
        parent = self._seq(seq_id)
        child = self.add_sequence()
        self.block_tables[child] = list(self.block_tables[parent])
        self.lengths[child] = self.lengths[parent]
        for page in self.block_tables[child]:
            self.refcount[page] += 1
        return child

    def free(self, seq_id: int) -> None:
        """Drop a sequence; pages nobody else points at go back to the pool."""
        for page in self.block_tables.pop(self._seq(seq_id)):
            self._release(page)
        del self.lengths[seq_id]

    @property
    def pages_in_use(self) -> int:
        return self.n_pages - len(self.free_pages)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page of keys plus its page of values."""
        return 2 * self.k_pages[0].numel() * self.k_pages.element_size()

    # ------------------------------------------------------------------ reading and writing
    def slot(self, seq_id: int, position: int) -> tuple[int, int]:
        """The block-table lookup: (page, offset) holding token `position` of sequence `seq_id`."""
        table = self.block_tables[self._seq(seq_id)]
        if isinstance(position, bool) or not isinstance(position, int):
            raise TypeError(f"position must be an int, got {type(position).__name__}")
        if not 0 <= position < self.lengths[seq_id]:
            raise ValueError(f"position {position} is outside sequence {seq_id} of length {self.lengths[seq_id]}")
        return table[position // self.page_size], position % self.page_size

    def append(self, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v (Hkv, T_new, D) after the tokens of `seq_id`, taking new pages as needed; a shared
        last page is copied first (copy-on-write), so a fork never changes what its sibling sees."""
        table = self.block_tables[self._seq(seq_id)]
        want = (self.n_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            _validate.tensor(name, t, min_rank=3, floating=True)
        if k.dim() != 3 or k.shape != v.shape or (k.shape[0], k.shape[2]) != want:
            raise ValueError(f"k and v must both be (Hkv={want[0]}, T_new, D={want[1]}), got k {tuple(k.shape)} "
                             f"and v {tuple(v.shape)}")
        pos, written = self.lengths[seq_id], 0
        shared_tail = pos % self.page_size != 0 and self.refcount[table[-1]] > 1
        need = math.ceil((pos + k.shape[1]) / self.page_size) - len(table) + shared_tail
        if need > len(self.free_pages):
            raise ValueError(f"the pool is full: appending {k.shape[1]} tokens to sequence {seq_id} needs {need} "
                             f"free pages of {self.page_size} tokens, {len(self.free_pages)} of {self.n_pages} left")
        while written < k.shape[1]:
            offset = pos % self.page_size
            if offset == 0:
                table.append(self._allocate())
            elif self.refcount[table[-1]] > 1:  # shared, partly filled last page: copy before writing
                old, table[-1] = table[-1], self._allocate()
                self.k_pages[table[-1]] = self.k_pages[old]
                self.v_pages[table[-1]] = self.v_pages[old]
                self._release(old)
            n = min(self.page_size - offset, k.shape[1] - written)
            self.k_pages[table[-1], :, offset:offset + n] = k[:, written:written + n]  # (Hkv, n, D)
            self.v_pages[table[-1], :, offset:offset + n] = v[:, written:written + n]
            pos, written = pos + n, written + n
        self.lengths[seq_id] = pos

    def gather(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `seq_id` read through its block table: (Hkv, L, D) each (copies)."""
        table = torch.tensor(self.block_tables[self._seq(seq_id)], dtype=torch.long)
        length = self.lengths[seq_id]

        def read(pages: torch.Tensor) -> torch.Tensor:
            x = pages[table].transpose(0, 1)  # (n, Hkv, P, D) -> (Hkv, n, P, D)
            return x.reshape(self.n_kv_heads, -1, self.head_dim)[:, :length]  # (Hkv, n*P, D) -> (Hkv, L, D)

        return read(self.k_pages), read(self.v_pages)

    def sequence(self, seq_id: int) -> "PagedSequence":
        """A view of one sequence with the ``update(k, v)`` protocol of chapter 07's caches (batch 1)."""
        return PagedSequence(self, self._seq(seq_id))


class PagedSequence:
    """One sequence of a :class:`PagedKVCache` behind the KV-cache protocol of
    :class:`~attncourse.MultiHeadAttention`: ``update`` takes (1, Hkv, T_new, D) and returns every key and
    value of the sequence (1, Hkv, S, D)."""

    def __init__(self, cache: PagedKVCache, seq_id: int):
        self.cache, self.seq_id = cache, seq_id

    def __len__(self) -> int:
        return self.cache.lengths[self.seq_id]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for name, t in (("k", k), ("v", v)):
            _validate.tensor(name, t, min_rank=4, floating=True)
            if t.dim() != 4 or t.shape[0] != 1:
                raise ValueError(f"{name} must be (1, Hkv, T_new, D) for one paged sequence, got {tuple(t.shape)}")
        self.cache.append(self.seq_id, k[0], v[0])
        k_all, v_all = self.cache.gather(self.seq_id)  # (Hkv, S, D) each
        return k_all[None], v_all[None]  # (1, Hkv, S, D)


def paged_attention(query: torch.Tensor, cache: PagedKVCache, seq_ids: list[int], *,
                    scale: float | None = None, alibi_slopes: torch.Tensor | None = None,
                    pages_per_step: int = 1) -> torch.Tensor:
    """Attention of a batch of sequences of different lengths, reading keys and values from the pool in place.

    query (B, H, Tq, D): the last Tq tokens of each sequence in `seq_ids` (already appended), H a multiple of
    Hkv (query head h reads KV head h // (H / Hkv), with no copy of K/V per query head). Each query sees the
    keys of its own sequence up to its own position. Returns (B, H, Tq, D).

    The loop is the one vLLM's and FlashInfer's kernels run: for each sequence, walk its block table
    `pages_per_step` pages at a time, score the queries against those pages only (a tile of at most
    ``pages_per_step * page_size`` keys, read where it lies in the pool) and fold the tile into an online
    softmax (chapter 08). No (Hkv, L, D) copy of a sequence is ever made. Positions are absolute: page i of
    the table holds positions ``i * page_size ...``, which is what the causal mask and `alibi_slopes` (H,)
    (bias ``-slope * (query position - key position)``, ALiBi) use. RoPE needs nothing here: keys are cached
    already rotated at their own positions.
    """
    _validate.tensor("query", query, min_rank=4, floating=True)
    if not isinstance(seq_ids, (list, tuple)) or not seq_ids:
        raise TypeError(f"seq_ids must be a non-empty list of sequence ids, got {seq_ids!r}")
    b, h, tq, d = query.shape if query.dim() == 4 else (None,) * 4
    if query.dim() != 4 or b != len(seq_ids) or d != cache.head_dim or h % cache.n_kv_heads:
        raise ValueError(f"query must be (B={len(seq_ids)}, H (a multiple of Hkv={cache.n_kv_heads}), Tq, "
                         f"D={cache.head_dim}), got {tuple(query.shape)}")
    _validate.positive_int("pages_per_step", pages_per_step)
    if alibi_slopes is not None:
        _validate.tensor("alibi_slopes", alibi_slopes, min_rank=1, floating=True)
        if alibi_slopes.shape != (h,):
            raise ValueError(f"alibi_slopes must be (H,) = ({h},), got {tuple(alibi_slopes.shape)}")
    lengths = [cache.lengths[cache._seq(s)] for s in seq_ids]
    if min(lengths) < tq:
        raise ValueError(f"every sequence must hold at least Tq={tq} tokens, got lengths {lengths}")
    scale = d ** -0.5 if scale is None else float(scale)
    h_kv, group, size = cache.n_kv_heads, h // cache.n_kv_heads, cache.page_size
    work = _compute_dtype(query.dtype)
    slopes = None if alibi_slopes is None else alibi_slopes.to(work).view(h_kv, group, 1, 1)  # (Hkv, G, 1, 1)
    out = query.new_empty(b, h, tq, d)
    for row, (seq, length) in enumerate(zip(seq_ids, lengths)):
        q = query[row].to(work).view(h_kv, group, tq, d) * scale  # (H, Tq, D) -> (Hkv, G, Tq, D): heads of a group
        q_pos = torch.arange(length - tq, length, device=query.device)  # (Tq,) absolute positions
        m = torch.full((h_kv, group, tq), _NEG_INF, dtype=work, device=query.device)  # running max
        l = torch.zeros_like(m)  # noqa: E741  running sum
        acc = torch.zeros(h_kv, group, tq, d, dtype=work, device=query.device)  # unnormalised output
        table = cache.block_tables[seq]
        for i in range(0, math.ceil(length / size), pages_per_step):
            pages = table[i:i + pages_per_step]  # the next few entries of the block table
            k_pos = torch.arange(i * size, (i + len(pages)) * size, device=query.device)  # (C,) C = pages * P
            k_tile, v_tile = (x[pages[0]] if len(pages) == 1 else x[pages].transpose(0, 1).flatten(1, 2)
                              for x in (cache.k_pages, cache.v_pages))  # (Hkv, C, D): read in place (one tile)
            s = q @ k_tile.to(work)[:, None].transpose(-2, -1)  # (Hkv, G, Tq, D) @ (Hkv, 1, D, C) -> (Hkv, G, Tq, C)
            if slopes is not None:
                s = s - slopes * (q_pos[:, None] - k_pos[None, :]).to(work)  # ALiBi on absolute positions
            s = s.masked_fill((k_pos[None, :] > q_pos[:, None]) | (k_pos[None, :] >= length), _NEG_INF)
            m_new = torch.maximum(m, s.amax(dim=-1))  # (Hkv, G, Tq)
            ref = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = torch.exp(s - ref[..., None])  # (Hkv, G, Tq, C)
            alpha = torch.exp(m - ref)
            l = alpha * l + p.sum(dim=-1)  # noqa: E741
            acc = alpha[..., None] * acc + p @ v_tile.to(work)[:, None]  # (Hkv, G, Tq, C) @ (Hkv, 1, C, D)
            m = m_new
        out[row] = (acc / l[..., None]).reshape(h, tq, d).to(query.dtype)  # every query sees key 0: l > 0
    return out


def paged_varlen_attention(query: torch.Tensor, query_lens: list[int], cache: PagedKVCache, seq_ids: list[int], *,
                           scale: float | None = None, pages_per_step: int = 1) -> torch.Tensor:
    """One mixed step of a server that chunks its prefills: prompt chunks and decode tokens in one flat batch.

    query (N, H, D): the new tokens of every sequence in `seq_ids`, concatenated (vLLM's and FlashInfer's "varlen"
    layout: sequence r owns rows ``sum(query_lens[:r]) ...`` of length ``query_lens[r]``, a chunk of its prompt or 1
    decode token). Each sequence's new tokens are its last ``query_lens[r]`` tokens, already appended to the cache, so
    a chunk reads every earlier chunk through the block table and itself under a bottom-right causal mask. Each
    sequence runs :func:`paged_attention`'s page loop with its own query length, as a unified kernel does within one
    launch. Returns (N, H, D). Raises ValueError for lengths that do not add up to N or exceed a sequence."""
    _validate.tensor("query", query, min_rank=3, floating=True)
    if query.dim() != 3:
        raise ValueError(f"query must be (N tokens, H, D), got {tuple(query.shape)}")
    if not isinstance(query_lens, (list, tuple)) or len(query_lens) != len(seq_ids) or not query_lens:
        raise ValueError(f"query_lens must list one length per sequence ({len(seq_ids)}), got {query_lens!r}")
    for n in query_lens:
        _validate.positive_int("query_lens entry", n)
    if sum(query_lens) != query.shape[0]:
        raise ValueError(f"query_lens must add up to the N={query.shape[0]} query rows, got {list(query_lens)}")
    out, start = [], 0
    for seq, n in zip(seq_ids, query_lens):
        q = query[start:start + n].transpose(0, 1)[None]  # (n, H, D) -> (1, H, n, D)
        out.append(paged_attention(q, cache, [seq], scale=scale, pages_per_step=pages_per_step)[0].transpose(0, 1))
        start += n
    return torch.cat(out, 0)  # (N, H, D)


@dataclass(frozen=True)
class MemoryWaste:
    """Token slots for a batch: ``used`` hold real tokens; ``contiguous`` and ``paged`` are the slots each
    scheme reserves. Waste = reserved - used."""

    used: int
    contiguous: int
    paged: int

    @property
    def contiguous_waste(self) -> float:
        return 1 - self.used / self.contiguous

    @property
    def paged_waste(self) -> float:
        return 1 - self.used / self.paged if self.paged else 0.0


def memory_waste(lengths: list[int], max_len: int, page_size: int) -> MemoryWaste:
    """Slots reserved for sequences of the given final `lengths`: contiguous preallocation reserves
    `max_len` per sequence; paging reserves ``ceil(L / page_size)`` pages of `page_size` slots."""
    _validate.positive_int("max_len", max_len)
    _validate.positive_int("page_size", page_size)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= max_len for n in lengths):
        raise ValueError(f"lengths must be a non-empty list of ints in [0, max_len={max_len}], got {lengths!r}")
    paged = sum(math.ceil(n / page_size) * page_size for n in lengths)
    return MemoryWaste(used=sum(lengths), contiguous=max_len * len(lengths), paged=paged)
