"""Checks for chapter 11, long context in practice (solutions/11_long_context.ipynb).

Expected values come from the package's reference implementations (block_sparse.tile_states, the paged cache,
chapter 08's merge, paged_attention, the ring itself with its sends counted (ch11_ring), the scheduler) or from
dense attention over the same pairs, never from a copy of a solution.
"""

from __future__ import annotations

import math

import torch

from attncourse.block_sparse import tile_states
from attncourse.online_softmax import AttentionState, finalize_attention_state, merge_attention_states
from attncourse.paged_cache import PagedKVCache, paged_attention
from attncourse.scheduler import random_workload, simulate
from . import Case, edits, exercise
from .ch11_given import FIX_PAGED, _breaker_rewrite_paged
from .ch11_ring import ring_bytes_measured

# The configuration of the prediction: a 128k-token prompt over 8 ranks, a LLaMA-3-8B-like layer in bfloat16.
RING_CONFIG = dict(batch=1, n_kv_heads=8, seq_len=131072, head_dim=128, world_size=8, bytes_per_element=2,
                   grad_bytes=4)


# ----------------------------------------------------------------------------- 1. tile states from a dense mask


def _shortcut_tile_states(mask, block_q, block_k):
    """The package's tile_states on a mask function that looks the dense mask up: must be refused."""
    return tile_states(lambda b, h, i, j: mask[i, j], mask.shape[0], mask.shape[1], block_q, block_k)


def _breaker_tile_states(mask, block_q, block_k):
    """Every tile visited by a Python loop: the right states, one handful of operations per tile."""
    t_q = mask.shape[0]
    t_k = mask.shape[1]
    n_q, n_k = -(-t_q // block_q), -(-t_k // block_k)
    states = torch.zeros(n_q, n_k, dtype=torch.long)
    for a in range(n_q):
        for b in range(n_k):
            tile = mask[a * block_q:(a + 1) * block_q, b * block_k:(b + 1) * block_k]
            states[a, b] = 2 if bool(tile.all()) else 1 if bool(tile.any()) else 0
    return states


def _no_loop_over_tiles(runs) -> str | None:
    """The number of PyTorch operations must not grow with the number of tiles (no Python loop over tiles)."""
    def tiles(run):
        mask, bq, bk = run.case.args
        return -(-mask.shape[0] // bq) * -(-mask.shape[1] // bk)

    def ops(run):
        return sum((run.trace or {}).get("counts", {}).values()) + (run.trace or {}).get("dropped", 0)

    def read(run):  # booleans and integers too: a mask read out into lists is the loop over tiles, moved to Python
        return (run.trace or {}).get("read", 0)

    few, many = min(runs, key=tiles), max(runs, key=tiles)
    if read(many) > 2 * read(few) + 20:
        return (f"your code read {read(many)} numbers out of its tensors into plain Python for {tiles(many)} tiles "
                f"and {read(few)} for {tiles(few)}: the tiles are reduced in Python, not in PyTorch; reduce every "
                "tile at once with tensor operations")
    if ops(many) > 2 * ops(few) + 20:
        return (f"your code ran {ops(many)} PyTorch operations for {tiles(many)} tiles and {ops(few)} for "
                f"{tiles(few)}: the work grows with the number of tiles, so it loops over tiles in Python; "
                "reduce every tile at once")
    return None


# The mask's elements reached without a read-out the trace counts: its address (for ctypes), its pickle or saved
# file, its text (repr, str, format and print all go through torch._tensor_str), or NumPy's view of it (.numpy(),
# np.asarray through __array__, from_dlpack). Printing a tensor inside the answer is refused with them.
READ_AROUND = ("torch.Tensor.data_ptr", "torch.UntypedStorage.data_ptr", "torch.Tensor.__reduce_ex__",
               "ctypes.string_at", "ctypes.cast", "torch.save", "torch._tensor_str._str", "torch.Tensor.__repr__",
               "torch.Tensor.__format__", "torch.Tensor.numpy", "torch.Tensor.__array__", "torch.Tensor.__dlpack__")


def _flex_callables() -> tuple[str, ...]:
    """Every callable of torch.nn.attention.flex_attention, private ones included: create_block_mask reduces the
    mask to tile states with _convert_mask_to_block_mask, which would answer the exercise in one call."""
    import torch.nn.attention.flex_attention as flex

    return tuple(f"{flex.__name__}.{name}" for name, obj in sorted(vars(flex).items())
                 if callable(obj) and getattr(obj, "__module__", None) == flex.__name__)


@exercise("11-tile-states", "tile_states_of", points=2, category="implement",
          forbid=("attncourse.block_sparse.tile_states", "attncourse.flash.causal_tile_map", *_flex_callables(),
                  *READ_AROUND),
          allow=(), ops=("attention",), prop=_no_loop_over_tiles,
          prop_doc="every tile is reduced at once: the operation count does not grow with the number of tiles",
          breakers=(_breaker_tile_states,),
          shortcuts=(_shortcut_tile_states,),
          hint="test a mask whose sides are not multiples of the tile sizes: what state should a small corner tile "
               "get when every pair it really holds is allowed?")
def _tile_states_cases():
    """From a dense boolean mask, the state of every (block_q x block_k) tile: 0 empty, 1 partial, 2 full."""
    gen = torch.Generator().manual_seed(11)
    cases = []
    i, j = torch.arange(40)[:, None], torch.arange(40)[None, :]
    specs = [
        ("causal, T = 32, tiles 8 x 8", (j <= i)[:32, :32], 8, 8),
        ("sliding window of 6, T = 40, tiles 16 x 8", ((i - j) >= 0) & ((i - j) < 6), 16, 8),
        ("Longformer-like, Tq = 37, Tk = 29, tiles 8 x 16 (ragged ends)",
         (((i - j).abs() <= 3) | (i < 2) | (j < 2))[:37, :29], 8, 16),
        ("random, 5 x 7, tiles 2 x 3", torch.rand(5, 7, generator=gen) < 0.3, 2, 3),
        ("all allowed, one tile bigger than the mask", torch.ones(6, 5, dtype=torch.bool), 8, 8),
        ("nothing allowed", torch.zeros(9, 9, dtype=torch.bool), 4, 4),
        ("random, 64 x 96, tiles 4 x 4 (384 tiles)", torch.rand(64, 96, generator=gen) < 0.05, 4, 4),
    ]
    for name, mask, bq, bk in specs:
        mask = mask.contiguous()
        expected = tile_states(lambda b, h, q, k, m=mask: m[q, k], mask.shape[0], mask.shape[1], bq, bk)
        cases.append(Case(name, (mask, bq, bk), expected=expected, compare="equal"))
    return cases


# ----------------------------------------------------------------------------- 2. the slot mapping of an append


def _slot_reference(block_table, length, n_new, page_size, free_pages, last_page_shared):
    """The package's PagedKVCache.append on a pool in this state; returns (new block table, flat slots)."""
    n_pages = max([*block_table, *free_pages, 0]) + 2  # the page after the last is the sibling's shared copy
    cache = PagedKVCache(n_pages, page_size, 1, 1, dtype=torch.float64)
    seq = cache.add_sequence()
    cache.block_tables[seq], cache.lengths[seq] = list(block_table), length
    cache.free_pages = list(free_pages)
    cache.refcount = [0] * n_pages
    for page in block_table:
        cache.refcount[page] = 1
    if last_page_shared and block_table:
        cache.refcount[block_table[-1]] = 2  # a forked sibling still lists it
    zeros = torch.zeros(1, n_new, 1, dtype=torch.float64)
    cache.append(seq, zeros, zeros)
    slots = [cache.slot(seq, t) for t in range(length, length + n_new)]
    return (torch.tensor(cache.block_tables[seq], dtype=torch.long),
            torch.tensor([page * page_size + offset for page, offset in slots], dtype=torch.long))


@exercise("11-slot-mapping", "slot_mapping", points=2, category="implement",
          forbid=("attncourse.paged_cache.PagedKVCache.append", "attncourse.paged_cache.PagedKVCache.slot",
                  "attncourse.paged_cache.PagedKVCache._allocate"),
          allow=(), ops=(),
          prop_doc="the block table and the slots are plain integers from plain integers: the page arithmetic is the "
                   "only way to them once the cache's own code is refused, so equal values are the skill",
          shortcuts=(_slot_reference,),
          hint="test an append that starts in the middle of a shared page and runs over two page boundaries: "
               "which page does its first token land in, and which pages leave the free list, in what order?")
def _slot_mapping():
    """The block table after a chunked append and the flat slot (page * P + offset) each new token is written to."""
    gen = torch.Generator().manual_seed(112)  # the pages, page sizes and lengths are drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731

    def state(n_table, length, n_new, page, shared):
        """A pool of shuffled page numbers: the sequence's pages, then a free list with what the append needs."""
        needed = -(-(length + n_new) // page) - n_table + (1 if shared and length % page else 0)
        perm = torch.randperm(n_table + needed + pick(0, 3), generator=gen).tolist()
        return (perm[:n_table], length, n_new, page, perm[n_table:], shared)

    cases = []
    page = pick(3, 6)
    cases.append((f"{page - 1} tokens into a fresh sequence, pages of {page}", state(0, 0, page - 1, page, False)))
    page, off, n_table = pick(3, 8), None, pick(2, 4)
    off = pick(1, page - 1)
    n_new = (page - off) + page + pick(1, page - 1)
    cases.append((f"a chunk of {n_new} from position {(n_table - 1) * page + off} crosses two page boundaries",
                  state(n_table, (n_table - 1) * page + off, n_new, page, False)))
    page, n_table = pick(3, 8), pick(1, 3)
    off = pick(1, page - 1)
    n_new = (page - off) + page * pick(0, 2)
    cases.append(("the chunk ends exactly at a page boundary", state(n_table, (n_table - 1) * page + off, n_new, page,
                                                                    False)))
    page, n_table = pick(3, 8), pick(1, 3)
    off = pick(1, page - 1)
    cases.append(("the last page is shared after a fork: copy-on-write, then a new page",
                  state(n_table, (n_table - 1) * page + off, (page - off) + pick(1, page), page, True)))
    page, n_table = pick(3, 8), pick(1, 3)
    cases.append(("a shared last page that is full is not copied",
                  state(n_table, n_table * page, pick(1, 2 * page), page, True)))
    n_table = pick(1, 3)
    cases.append(("pages of 1 token", state(n_table, n_table, pick(2, 4), 1, False)))
    # "Leave the arguments unchanged": cases 2 and 4 again, on the very same list objects (the grader's kernel
    # loads them as one pickle, so it keeps them shared too). An answer that appended to the caller's block table or
    # popped its free list in the first call meets a longer table and a shorter free list here, and answers wrongly.
    for again in (1, 3):
        name, args = cases[again]
        cases.append((f"case {again + 1}'s lists again, as the first call left them (it must not change them)", args))
    return [Case(name, args, expected=_slot_reference(*args), compare="equal") for name, args in cases]


# ----------------------------------------------------------------------------- 3. merging two ranks' partials


def _merge_reference(out_a, lse_a, out_b, lse_b):
    a = AttentionState(lse_a, torch.ones_like(lse_a), out_a)  # chapter 08's state, built from the partial
    b = AttentionState(lse_b, torch.ones_like(lse_b), out_b)
    return finalize_attention_state(merge_attention_states(a, b))


@exercise("11-merge-ranks", "merge_partials", points=2, category="implement",
          forbid=("attncourse.online_softmax.merge_attention_states", "attncourse.online_softmax.merge_softmax_states",
                  "attncourse.online_softmax.online_attention_update"),
          allow=(), ops=("softmax",),
          prop_doc="a merge is a closed formula of its four inputs; equal values on every case (empty sides, very "
                   "different masses) are the skill once the library's merges and a softmax over the lses are refused",
          shortcuts=(_merge_reference,),
          hint="the merged lse is the log of the summed masses of both sides; each side's output then counts in "
               "proportion to its own share of that mass. A row where both sides are empty must come out as zeros "
               "and minus infinity: never subtract an infinite reference from itself")
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
    # a layer's worth (4 heads x 64 rows x 8 dims, 4,608 numbers in all): more than an answer may read out into
    # plain Python (a quarter of its inputs), so a tolist-and-loops detour is refused, as a merge on tensors is not
    add("4 heads, 64 query rows, head dim 8", r(4, 64, 8), r(4, 64), r(4, 64, 8), r(4, 64))
    return cases


# ----------------------------------------------------------------------------- 4. find the bug: paged ALiBi decode


def paged_alibi_reference(query, k_pages, v_pages, block_table, length, slopes):
    """The package's paged decode (one sequence, one query token at position length - 1), in float64."""
    n_pages, hkv, page, d = k_pages.shape
    cache = PagedKVCache(n_pages, page, hkv, d, dtype=torch.float64)
    cache.k_pages, cache.v_pages = k_pages.double(), v_pages.double()
    seq = cache.add_sequence()
    cache.block_tables[seq], cache.lengths[seq] = list(block_table), length
    out = paged_attention(query.double()[None, :, None], cache, [seq], alibi_slopes=slopes.double())
    return out[0, :, 0].to(query.dtype)  # (H, D)


def _breaker_paged_alibi(query, k_pages, v_pages, block_table, length, slopes):
    """The sequence's pages gathered into one dense (H, L, D) cache, then one softmax: the right output, no paging."""
    h, d = query.shape
    hkv, page = k_pages.shape[1], k_pages.shape[2]
    group = h // hkv
    kv_of = torch.arange(h) // group
    keys = k_pages[block_table].transpose(0, 1).reshape(hkv, -1, d)[:, :length][kv_of]  # (H, L, D)
    vals = v_pages[block_table].transpose(0, 1).reshape(hkv, -1, d)[:, :length][kv_of]
    s = (keys @ query[:, :, None]).squeeze(-1) / math.sqrt(d)  # (H, L)
    s = s - slopes[:, None] * ((length - 1) - torch.arange(length))[None, :]
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (p[:, None, :] @ vals).squeeze(1) / p.sum(-1, keepdim=True)


def _page_by_page(runs) -> str | None:
    """No tensor holds the keys of more than two pages: on the long cases, no operation sees a dimension as long as
    the sequence (or its pages laid end to end), and no tensor the answer made (not a view of an input) holds more
    elements than two pages' keys for every query head."""
    for run in runs:
        q, k_pages, _, table, length, _ = run.case.args
        page = k_pages.shape[2]
        if length <= 2 * page:
            continue
        gathered = {length, len(table) * page, k_pages.shape[1] * length, k_pages.shape[1] * len(table) * page,
                    q.shape[0] * length}
        two_pages = 2 * q.shape[0] * page * k_pages.shape[3]  # H query heads x 2 pages x D
        for op, _, _, tensors in (run.trace or {}).get("ops", ()):
            for label, _, shape, _ in tensors:
                if gathered & set(shape) or (label is None and math.prod(shape) > two_pages):
                    return (f"on case '{run.case.name}' your code ran {op.split('::')[-1]} on a tensor of shape "
                            f"{tuple(shape)}: the keys of the whole sequence in one tensor. Read the pages in place, "
                            "one at a time")
    return None


@exercise("11-find-the-bug-1", "paged_alibi_decode_fixed", points=2, category="bug", aliases=("11-paged-alibi-bug",),
          forbid=("attncourse.paged_cache.paged_attention", "attncourse.paged_cache.PagedKVCache.gather",
                  "torch.nn.functional.scaled_dot_product_attention", "attncourse.sdpa.scaled_dot_product_attention"),
          allow=(), ops=("attention",), prop=edits.prop(FIX_PAGED, "`paged_alibi_decode_fixed`", also=_page_by_page),
          prop_doc="the diagnosis: the fixed step still reads the pages in place one at a time (no tensor holds the "
                   "whole sequence, nor more than two pages' keys for every head), and it is the given step with a "
                   "small edit where it is wrong (a paged decode written afresh does not show the bug was found)",
          breakers=(_breaker_paged_alibi, _breaker_rewrite_paged),
          bug_words=("physical", "logical", "page number", "page id", "page's number", "pool index",
                     "holds positions", "table holds"),
          hint="the first tests use block tables of one particular kind; build a pool the way a server fills one "
               "(the lesson decoded several sequences round-robin), test a sequence from it against dense attention "
               "over its keys, and look at which inputs the step's bias depends on")
def _paged_alibi_cases():
    """Find and fix the bug in a paged decode step with ALiBi and grouped-query attention."""
    gen = torch.Generator().manual_seed(14)
    cases = []
    for name, (n_pages, heads, n_kv, page, d, table, length) in {
        "one page, 3 tokens, 2 heads over 2 KV heads": (4, 2, 2, 4, 8, [2], 3),
        "two pages in order, 7 tokens, 4 heads over 1 KV head": (4, 4, 1, 4, 8, [0, 1], 7),
        "three pages out of order, 10 tokens, 4 heads over 2 KV heads": (6, 4, 2, 4, 8, [5, 0, 3], 10),
        "pages of 2, 9 tokens, 8 heads over 2 KV heads": (8, 8, 2, 2, 4, [7, 1, 6, 2, 4], 9),
        "pages of 3, 8 tokens, 6 heads over 3 KV heads": (5, 6, 3, 3, 4, [4, 0, 2], 8),
        "nine pages of 4, 35 tokens, 4 heads over 2 KV heads": (16, 4, 2, 4, 8, [11, 3, 14, 0, 7, 9, 1, 12, 5], 35),
        "seven pages of 5, 33 tokens, 6 heads over 2 KV heads": (9, 6, 2, 5, 4, [8, 2, 6, 0, 4, 1, 7], 33),
    }.items():
        kp = torch.randn(n_pages, n_kv, page, d, generator=gen, dtype=torch.float64)
        vp = torch.randn(n_pages, n_kv, page, d, generator=gen, dtype=torch.float64)
        q = torch.randn(heads, d, generator=gen, dtype=torch.float64)
        slopes = torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)], dtype=torch.float64)
        cases.append(Case(name, (q, kp, vp, table, length, slopes),
                          expected=paged_alibi_reference(q, kp, vp, table, length, slopes)))
    return cases


# ----------------------------------------------------------------------------- 5. predict the ring's bytes


@exercise("11-ring-bytes", "ring_prediction", points=1, category="predict",
          parts=("bytes one rank sends in the backward ring", "bytes one rank sends in the forward and backward rings"),
          forbid=("attncourse.ring.ring_bytes_per_rank", "attncourse.ring.ulysses_bytes_per_rank"),
          allow=(), ops=("torch",),
          prop_doc="the prediction is a count in plain integers, written as a function of the layer and the world "
                   "size so that no package call (the ring's own byte formulas, the checker's) can stand in for it: "
                   "equal counts on every configuration are the skill",
          hint="test your count on two ranks by following one rank's sends through the backward loop step by step, "
               "then see what changes at the last step")
def _ring_bytes():
    """Predict (backward bytes per rank, forward + backward bytes per rank) of a ring training step, as a function
    of (batch, n_kv_heads, seq_len, head_dim, world_size, bytes_per_element, grad_bytes): K and V travel in
    `bytes_per_element` bytes, dK and dV in `grad_bytes` (ring-flash-attention's bfloat16 blocks, float32 gradients).
    With two dtypes, a law fitted to runs in one dtype cannot say which sends are gradients: only the count can."""
    gen = torch.Generator().manual_seed(15)  # two more layers, drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    configs = [("B=1, Hkv=8, T=131072, D=128, W=8, K/V bfloat16, dK/dV float32 (the exercise's layer)", RING_CONFIG)]
    for kv_bytes, grad_bytes in ((4, 8), (2, 2)):  # other mixtures, and one dtype for all
        w = pick(2, 9)
        cfg = dict(batch=pick(1, 4), n_kv_heads=2 ** pick(0, 3), seq_len=w * 64 * pick(1, 64), head_dim=32 * pick(1, 4),
                   world_size=w, bytes_per_element=kv_bytes, grad_bytes=grad_bytes)
        configs.append((", ".join(f"{k}={v}" for k, v in cfg.items()), cfg))
    cases = []
    for name, cfg in configs:
        forward, backward = ring_bytes_measured(**cfg)  # counted at dist.isend in the ring itself (ch11_ring)
        cases.append(Case(f"(backward, forward + backward) bytes per rank for {name}", tuple(cfg.values()),
                          expected=(backward, forward + backward), compare="equal"))
    return cases


# ----------------------------------------------------------------------------- 6. experiment: chunked prefill


CHUNK_EXPERIMENT = dict(n_requests=24, rate=12.0, budgets=(32, 64, 128, 256, 512, 1024, 2048, 4096), floor=0.99)


def budget_reference(seed: int) -> torch.Tensor:
    """[smallest budget of the grid keeping 99 % of the whole-prompt throughput, that throughput ratio, its max TBT (s)]."""
    e = CHUNK_EXPERIMENT
    requests = random_workload(seed, e["n_requests"], rate=e["rate"])
    whole = simulate(requests, token_budget=4096, chunked=False)
    for budget in e["budgets"]:
        run = simulate(requests, token_budget=budget, chunked=True)
        if run.throughput >= e["floor"] * whole.throughput:
            return torch.tensor([budget, run.throughput / whole.throughput, max(run.tbt)], dtype=torch.float64)
    return torch.tensor([float("nan")] * 3, dtype=torch.float64)


@exercise("11-chunking-experiment", "smallest_budget", points=2, category="experiment",
          allow=("attncourse.scheduler.random_workload", "attncourse.scheduler.simulate",
                 "attncourse.scheduler.SimResult", "attncourse.scheduler.Request"),
          hint="a budget too small pays the weight read on every step for too few tokens; compare every budget "
               "with the same whole-prompt run of the same requests, and watch whether the answer is the same "
               "budget for every seed")
def _chunking_cases():
    """The smallest chunk budget that keeps 99 % of the whole-prompt throughput, and what it buys. Five seeds."""
    return [Case(f"seed {seed}", (seed,), expected=budget_reference(seed), rtol=1e-9, atol=1e-12)
            for seed in (0, 1, 2, 3, 4)]
