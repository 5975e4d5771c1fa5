"""Checks for chapter 14, attention that learns where to look (solutions/14_learned_sparse_attention.ipynb).

Expected values come from the package (``moba_gate``, ``selected_work``) or from the course's oracle
(``scaled_dot_product_attention`` under the selection's token mask), never from a copy of the solution.

Shortcuts (refused for what they call) share :func:`_select_blocks`. Breakers (refused by the property) cannot: the
guard files every function of this module under the course's code, so a breaker that called a helper here would be
refused for entering check code, which proves nothing about its property. Each breaker therefore ranks the blocks
itself, in two lines (:func:`_select_blocks`'s rule written with ``argsort``).
"""

from __future__ import annotations

import math
import re

import torch

from attncourse.learned_sparse import blocks_to_mask, mean_pool_blocks, moba_gate, selected_work
from attncourse.online_softmax import AttentionState, finalize_attention_state, online_attention_update
from attncourse.sdpa import scaled_dot_product_attention
from . import Case, edits, exercise
from .ch09 import _NO_READ, _rows

TILES_QUESTION = dict(seq_len=4096, block_size=64, top_k=8)  # the configuration the prediction asks about
_MATMUL = re.compile(r"^(mm|bmm|addmm|baddbmm|matmul|mv|dot|vdot|addbmm|_efficient_attention_forward)$")
_REDUCE = re.compile(r"^(sum|mean|cumsum)$")
_RANDOM = tuple(f"random.{n}" for n in ("Random", "random", "gauss", "normalvariate", "uniform", "randint", "randrange",
                                         "choice", "choices", "sample", "shuffle", "getrandbits", "seed"))
_RANDOM += tuple(f"random.Random.{n}" for n in ("random", "gauss", "normalvariate", "uniform", "randint", "randrange",
                                                "choice", "choices", "sample", "shuffle", "getrandbits", "seed"))
_GATE_PASSES = 48  # passes over the gate's own tensors an honest answer may make (the solutions make under 20)


def _op(name: str) -> str:
    return name.split("::")[-1].split(".")[0]


from .ch14_breakers import (BUGGY_MOBA, _breaker_dense, _breaker_rewrite_moba, _breaker_row_scores,  # noqa: E402
                            _breaker_token_scores)

# ----------------------------------------------------------------------------- 1. implement MoBA's gate


def _no_token_scores(runs) -> str | None:
    """No (queries x keys) grid of single-key scores is ever formed, in any layout: no operator receives a tensor with
    a dim for the Tq queries and another for the S keys (two dims of size T when Tq = S = T, wherever they sit), or
    with as many elements as B*H*Tq*S where no gate tensor could be that large, and no matrix product multiplies an
    operand that runs over the queries with one that runs over the keys."""
    for run in runs:
        query, key = run.case.args[0], run.case.args[1]
        b, h, t, d = query.shape
        s = key.shape[2]
        nb = -(-s // run.case.args[2])

        def grid(shape) -> bool:
            dims = list(shape)
            return dims.count(t) >= 2 if t == s else (t in dims and s in dims)

        for name, _launch, _helper, tensors in run.trace["ops"]:
            for _label, _off, shape, _stride in tensors:
                numel = math.prod(int(x) for x in shape)
                quadratic = numel >= b * h * t * s > 2 * b * h * (t * nb + s) * max(d, 1)
                if t > 1 and grid(shape) or quadratic:
                    return (f"case '{run.case.name}': an operator ({_op(name)}) received a tensor of shape {shape}, "
                            f"which holds a {t} x {s} grid of query-key scores: the gate scores blocks, one summary "
                            "per block, never single keys")
            if t > 1 and _MATMUL.match(_op(name)) and len(tensors) >= 2:
                a, c = (list(shape) for _l, _o, shape, _s in tensors[-2:])
                if (t in a and s in c) or (s in a and t in c):
                    return (f"case '{run.case.name}': a matrix product ({_op(name)}) multiplied an operand that runs "
                            f"over the {t} queries with one that runs over the {s} keys: that is the score grid the "
                            "gate exists to avoid")
        if t < s:  # a chunk or a decode step: only the Tq given queries are scored, not all S positions
            rows = {s, nb * run.case.args[2]}  # every position, padded to whole blocks or not
            for name, _launch, _helper, tensors in run.trace["ops"]:
                shapes = [list(shape) for _l, _o, shape, _s in tensors]
                scored = any(nb in sh and d in sh and rows & set(sh) and len({nb, d, *(rows & set(sh))}) >= 3
                             for sh in shapes)
                if _MATMUL.match(_op(name)) and len(shapes) >= 2 and len(shapes[-2]) >= 2 and len(shapes[-1]) >= 2:
                    a, c = shapes[-2], shapes[-1]
                    scored |= (a[-1] == d and c[-2] == d and ((a[-2] in rows and c[-1] == nb)
                                                              or (a[-2] == nb and c[-1] in rows)))
                if scored:
                    return (f"case '{run.case.name}': an operator ({_op(name)}) scored {s} positions against the "
                            f"{nb} block summaries, but only the last {t} are queries: padding the queries to every "
                            "position and keeping the last rows does the gate's work for tokens that are not asking; "
                            "score the given queries, placed by their positions")
        # the total work, whatever the shapes: pooling reads B*Hkv*S*D, scoring B*H*Tq*(nB + D) and the selection
        # B*H*Tq*nB entries, so a bounded number of passes over those; each query against every key reads
        # B*H*Tq*S*D entries in all, which no tensor's shape shows
        bound = _GATE_PASSES * b * h * (t * (d + nb) + s * d) + 4096
        total = sum(math.prod(int(x) for x in shape) for _n, _l, _h, tensors in run.trace["ops"]
                    for _label, _off, shape, _stride in tensors)
        if total > bound:
            return (f"case '{run.case.name}': your code's operators took in {total} tensor entries in all, more than "
                    f"{bound} ({_GATE_PASSES} passes over the queries, the keys, the block summaries and the (Tq, nB) "
                    "gate): that is work that grows as queries x keys, as if every key were scored for every query, a "
                    "few queries at a time; the gate scores blocks, one summary per block, never single keys")
    return None


def _as_indices(selected: torch.Tensor, top_k: int) -> torch.Tensor:
    """(..., Tq, nB) bool -> (..., Tq, top_k) long: the selected blocks in increasing order, then -1."""
    nb = selected.shape[-1]
    order = torch.where(selected, torch.arange(nb), nb).sort(-1).values  # selected first, ascending; nB elsewhere
    order = torch.cat([order, order.new_full((*order.shape[:-1], max(top_k - nb, 0)), nb)], -1)[..., :top_k]
    return order.masked_fill(order == nb, -1)


def _gate_reference(query: torch.Tensor, key: torch.Tensor, block_size: int, top_k: int) -> torch.Tensor:
    """The package's gate for the last Tq of S positions (the earlier queries do not change a query's selection)."""
    s, t = key.shape[2], query.shape[2]
    full = torch.cat([query.new_zeros(*query.shape[:2], s - t, query.shape[-1]), query], 2)  # (B, H, S, D)
    return _as_indices(moba_gate(full, key, block_size, top_k)[..., s - t:, :], top_k)


def _shortcut_package(query, key, block_size, top_k):
    """The package's gate over all S positions, the last Tq rows kept, as indices: must be refused."""
    return _gate_reference(query, key, block_size, top_k)


def _shortcut_pool(query, key, block_size, top_k):
    """The package's pooling, then the package's gate on keys that hold each block's mean: must be refused."""
    means = mean_pool_blocks(key, block_size).repeat_interleave(block_size, dim=2)[:, :, :key.shape[2]]
    return _gate_reference(query, means, block_size, top_k)


@exercise("14-moba-gate", "moba_select", points=3, category="implement",
          forbid=("attncourse.learned_sparse.moba_gate", "attncourse.learned_sparse.mean_pool_blocks",
                  "torch.nn.functional.scaled_dot_product_attention", "torch.softmax"),
          allow=(), ops=("attention", "softmax", "logsumexp"), prop=_no_token_scores,
          breakers=(_breaker_token_scores, _breaker_row_scores), shortcuts=(_shortcut_package, _shortcut_pool),
          prop_doc="the gate never forms a queries x keys score grid: no operator receives one, no matrix product runs "
                   "over the queries on one side and the keys on the other, the entries its operators take in "
                   "stay within a bounded number of passes over the queries, the keys, the block summaries and the "
                   "(Tq, nB) gate, and for a chunk or a decode step only the Tq given queries are scored, not every "
                   "position (from the trace)",
          title="MoBA's block gate for a chunk of new queries: each query's key blocks as a list of indices",
          hint="the queries are the last Tq of the S positions, so a query's own block follows from its position "
               "among all S, not from its row; summarise each block of keys by one vector first (S need not be a "
               "multiple of block_size), score every query against the summaries of its own KV head, and choose only "
               "among the blocks that lie wholly before the query's own block; the own block is always kept and "
               "counts towards top_k. List the chosen blocks in increasing order and fill the rest of the row with -1")
def _moba_gate_cases():
    """(B, H, Tq, top_k) long: MoBA's causal block selection for the last Tq of S positions, as sorted indices."""
    gen = torch.Generator().manual_seed(14)
    cases = []
    for name, (b, h, hkv, s, t, d, block, top_k) in {
        "prefill: B=2, H=2, Tq = S = 40, blocks of 8, top 3": (2, 2, 2, 40, 40, 16, 8, 3),
        "a chunk: the last 13 of S=37 (the last block holds 1 key, blocks of 6), top 2": (1, 2, 2, 37, 13, 12, 6, 2),
        "grouped heads: H=4 over Hkv=2, the last 21 of S=44, blocks of 5, top 4": (2, 4, 2, 44, 21, 9, 5, 4),
        "top_k larger than the blocks: the last 11 of S=30, blocks of 7, top 9": (1, 3, 1, 30, 11, 8, 7, 9),
        "top_k = 1: the own block only, the last 6 of S=27, blocks of 4": (1, 2, 1, 27, 6, 8, 4, 1),
        "decode: one query after S=203 keys, blocks of 16, top 5": (2, 2, 1, 203, 1, 12, 16, 5),
        "a long chunk: the last 200 of S=1000, blocks of 64, top 3": (1, 1, 1, 1000, 200, 4, 64, 3),
    }.items():
        q = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
        k = torch.randn(b, hkv, s, d, generator=gen, dtype=torch.float64)
        cases.append(Case(name, (q, k, block, top_k), expected=_gate_reference(q, k, block, top_k), compare="equal"))
    return cases


# ----------------------------------------------------------------------------- 2. find the bug: a selected-block loop


def _budgeted_reads(runs) -> str | None:
    """The work follows the selection. Keys and values are read one block at a time (at most block_size rows per
    operator; a sum or mean over the keys for the block summaries excepted), no more key and value rows in all than
    the selected blocks hold, and, whatever the tensors are called (copies of K and V included), the tensor entries
    all operators take in stay within a few times what one pass over the selected blocks needs: per head, the
    selected keys' and values' entries, the same again per (query, block) visit for the running state, and the gate
    over all queries once. The scores and the weighted values are tensor products (matrix or elementwise) taking in at
    least the entries of q, k and v, so the work cannot leave PyTorch for plain Python."""
    for run in runs:
        q, k, v, block, top_k = run.case.args
        h, t, d = q.shape
        dv = v.shape[-1]
        nb = -(-t // block)
        budget = visits = keys = 0
        for i in range(t):
            read = min(top_k, i // block + 1)
            budget += read * block
            visits += read
            keys += i % block + 1 + (read - 1) * block
        budget *= h
        read = {"arg1": 0, "arg2": 0}
        span = top_k * block  # the most keys one query's selection holds
        entries = products = 0
        for name, _launch, _helper, tensors in run.trace["ops"]:
            op = _op(name)
            for _label, _off, shape, _stride in tensors:
                rows = list(shape[:-1]) + ([shape[-1]] if shape and shape[-1] not in (d, dv) else [])
                if sum(1 for x in rows if x > span) >= 2:  # (H, T, T) scores or a (T, T) mask, on copies or not
                    return (f"case '{run.case.name}': an operator ({op}) received a tensor of shape {tuple(shape)}, "
                            f"queries against more keys than a selection of {top_k} blocks of {block} holds: that is "
                            "dense attention; the loop scores each query against its selected blocks only")
            if _NO_READ.match(op):
                continue
            if _MATMUL.match(op) or op == "mul":
                products += sum(math.prod(int(x) for x in shape) for _l, _o, shape, _s in tensors)
            entries += sum(math.prod(int(x) for x in shape) for _l, _o, shape, _s in tensors)
            for label, off, shape, stride in tensors:
                if label not in read:
                    continue
                if label == "arg1" and _REDUCE.match(op):
                    continue  # the block summaries: one pass over the keys
                width = d if label == "arg1" else dv
                a, e = _rows((label, off, shape, stride), width, t * width)
                if e - a > block:
                    return (f"case '{run.case.name}': one operator ({op}) read {e - a} "
                            f"{'key' if label == 'arg1' else 'value'} rows at once; the loop reads one block of at "
                            f"most {block} rows at a time")
                read[label] += e - a
        need = q.numel() + k.numel() + v.numel()
        if products < need:
            return (f"case '{run.case.name}': your operators multiplied only {products} tensor entries ({need} in q, "
                    "k and v): the loop scores every query against its selected blocks and weights their values with "
                    "tensor products (q against a block of keys, the weights against a block of values), not in "
                    "plain Python")
        for label, what in (("arg1", "key"), ("arg2", "value")):
            if read[label] > budget:
                return (f"case '{run.case.name}': your loop read {read[label]} {what} rows, more than the "
                        f"{budget} that the selected blocks of all queries and heads hold")
        allowed = 4 * h * ((keys + visits) * (d + dv) + t * (d + nb))
        if t >= 8 * span and ((run.trace or {}).get("dropped", 0) or entries > allowed):  # the long cases: a query's
            # earlier keys outnumber its selection there, so reading them costs far more than the selection
            return (f"case '{run.case.name}': your operators took in {entries} tensor entries, more than 4 times what "
                    f"one pass over the selected blocks needs ({allowed // 4}: {keys} selected keys with their values "
                    f"and {visits} (query, block) visits per head, plus the gate once): the work follows every earlier "
                    "key, not the selection (copies of the keys and values count too); visit each query's selected "
                    "blocks only, and compute the gate once for all queries")
    return None


def _breaker_every_block(q, k, v, block, top_k):
    """Every earlier block visited, one block of queries against one block of keys at a time, the unselected
    (query, block) pairs masked: right output, block-sized reads, but the work of all earlier blocks."""
    h, t, d = q.shape
    nb = -(-t // block)
    gate = q @ torch.stack([k[:, i * block:(i + 1) * block].mean(1) for i in range(nb)], 1).transpose(-2, -1)
    own, blocks = torch.arange(t)[:, None] // block, torch.arange(nb)[None, :]
    rank = gate.masked_fill(blocks >= own, -math.inf).argsort(-1, descending=True).argsort(-1)  # (H, T, nB)
    sel = (rank < top_k - 1) & (blocks < own) | (blocks == own)
    out = torch.empty(h, t, v.shape[-1], dtype=q.dtype)
    for hh in range(h):
        for qb in range(nb):
            q0, q1 = qb * block, min((qb + 1) * block, t)
            m0 = q.new_full((q1 - q0,), -math.inf)
            state = AttentionState(m0, torch.zeros_like(m0), q.new_zeros(q1 - q0, v.shape[-1]))
            for b in range(qb + 1):
                k0, k1 = b * block, min((b + 1) * block, t)
                s = (q[hh, q0:q1] @ k[hh, k0:k1].transpose(-2, -1)) / math.sqrt(d)
                keep = (torch.arange(k0, k1)[None, :] <= torch.arange(q0, q1)[:, None]) & sel[hh, q0:q1, b, None]
                state = online_attention_update(state, s.masked_fill(~keep, -math.inf), v[hh, k0:k1])
            out[hh, q0:q1] = finalize_attention_state(state)[0]
    return out


def _gate3(q, k, block, top_k):
    return moba_gate(q[None], k[None], block, top_k)[0]  # (H, T, nB)


def _block_loop_reference(q, k, v, block, top_k):
    sel = _gate3(q, k, block, top_k)
    return scaled_dot_product_attention(q, k, v, blocks_to_mask(sel, block, q.shape[1]))


@exercise("14-find-the-bug-1", "moba_attention_fixed", points=2, category="bug",
          forbid=("attncourse.learned_sparse.moba_gate", "attncourse.learned_sparse.selected_attention",
                  "attncourse.learned_sparse.blocks_to_mask", "attncourse.sdpa.scaled_dot_product_attention",
                  "torch.nn.functional.scaled_dot_product_attention", "attncourse.flash.flash_attention"),
          allow=("attncourse.online_softmax.online_attention_update", "attncourse.online_softmax.finalize_attention_state",
                 "attncourse.online_softmax.AttentionState"),
          ops=("attention", "softmax", "logsumexp"),
          prop=edits.prop(edits.SmallEdit(BUGGY_MOBA, most=14, lines=(13, 14, 15, 18),  # 18: filter the loop's blocks
                                          names=("int", "sum", "item", "isfinite", "isinf", "isneginf", "values")),
                          "`moba_attention_fixed`", also=_budgeted_reads),
          breakers=(_breaker_dense, _breaker_every_block, _breaker_rewrite_moba),
          prop_doc="keys and values are read block by block, never more rows than the selected blocks hold, the "
                   "products (matrix or elementwise) take in at least the entries of q, k and v, and the "
                   "tensor entries all operators take in (copies of K and V included) stay within 4 times one pass "
                   "over the selected blocks plus the gate (from the trace, on the two cases of 128 tokens in blocks "
                   "of 4, where the earlier keys of all queries outnumber their selections 10 and 26 times); and the "
                   "diagnosis: the given function with a small edit where it is wrong (a MoBA loop written afresh "
                   "does not show the bug was found)",
          bug_words=("-inf pick", "-inf picks", "fewer earlier blocks", "not enough earlier", "picks later blocks",
                     "later blocks picked", "chooses later blocks", "& past", "&= past", "masked picks",
                     "topk returns masked", "top-k returns masked", "not yet written", "ahead of the query",
                     "blocks after the own", "blocks after its own"),
          title="Fix a MoBA attention loop that is right for most queries only",
          hint="compare its output with dense attention under the token mask of a selection you build yourself, "
               "query by query; then print, for a query where they differ, which blocks the loop visits")
def _moba_bug_cases():
    """MoBA attention, one query at a time over its selected blocks, (H, T, D) tensors."""
    gen = torch.Generator().manual_seed(15)
    cases = []
    for name, (h, t, d, block, top_k) in {
        "H=2, T=24, blocks of 6, top 2": (2, 24, 8, 6, 2),
        "H=1, T=21, blocks of 4 (last holds 1), top 3": (1, 21, 8, 4, 3),
        "H=2, T=30, blocks of 5, top 4": (2, 30, 8, 5, 4),
        "H=1, T=16, blocks of 8, top 1": (1, 16, 8, 8, 1),
        "H=1, T=128, blocks of 4, top 2, D=32": (1, 128, 32, 4, 2),
        "H=1, T=128, blocks of 4, top 1, D=32": (1, 128, 32, 4, 1),
    }.items():
        q, k, v = (torch.randn(h, t, d, generator=gen, dtype=torch.float64) for _ in range(3))
        cases.append(Case(name, (q, k, v, block, top_k), expected=_block_loop_reference(q, k, v, block, top_k),
                          rtol=1e-7, atol=1e-9))
    return cases


# ----------------------------------------------------------------------------- 3. predict: blocks and keys


@exercise("14-predict-tiles", "tiles_prediction", points=2, category="predict",
          parts=("blocks visited", "keys scored"),
          forbid=("attncourse.learned_sparse.moba_gate", "attncourse.learned_sparse.selected_work",
                  "attncourse.learned_sparse.blocks_to_mask", "attncourse.learned_sparse.selected_attention",
                  "attncourse.learned_sparse.n_blocks", *_RANDOM),
          allow=(), ops=("torch",),
          prop_doc="the prediction is a count in plain integers, written as a function of (seq_len, block_size, "
                   "top_k) so that no package call (the gate and its counter, the checker's) can stand in for it, "
                   "and no simulation either: random draws are refused, and one case has about 2^30 tokens, where "
                   "a count query by query cannot finish; equal counts on the exercise's configuration and on "
                   "drawn ones (ragged last blocks, top_k larger than the blocks) are the skill",
          hint="a query in block i has i earlier blocks to choose from; count the blocks each query reads, then the "
               "keys, remembering that inside its own block a query sees only the keys up to itself, and that the "
               "last block may be short; every query of a block reads as many blocks, so sum block by block or in "
               "closed form (one case has about 2^30 tokens)")
def _predict_tiles():
    """Predict (blocks visited, keys scored) per head by MoBA's loop with one query per tile, as a function of
    (seq_len, block_size, top_k)."""
    # Counted here from a real gate on random data (the counts do not depend on the data), in local names only: the
    # checks module exposes no value or function that returns the answer.
    gen = torch.Generator().manual_seed(141)  # two more configurations, drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    configs = [TILES_QUESTION]
    block = 2 ** pick(3, 6)
    configs.append(dict(seq_len=block * pick(3, 40) + pick(1, block - 1), block_size=block, top_k=pick(2, 6)))
    block = 2 ** pick(2, 5)
    n = pick(2, 6)
    configs.append(dict(seq_len=block * n + pick(0, block - 1), block_size=block, top_k=n + pick(1, 4)))
    block = 2 ** pick(12, 14)  # a long context: a simulation query by query, or a loop over the tokens, cannot finish
    configs.append(dict(seq_len=2 ** 30 + block * pick(1, 64) + pick(1, block - 1), block_size=block, top_k=pick(4, 16)))

    cases = []
    for cfg in configs:
        t, block, top_k = cfg["seq_len"], cfg["block_size"], cfg["top_k"]
        expected = _counted(t, block, top_k, gen)
        cases.append(Case(f"(blocks visited, keys scored) for T={t}, blocks of {block}, top_k={top_k}, one query per "
                          "tile", (t, block, top_k), expected=expected, compare="equal"))
    return cases


def _gate_counts(t, block, top_k, gen):
    """(blocks, keys) read by the package's gate on random data, counted from its (T, nB) selection."""
    q, k = torch.randn(2, 1, 1, t, 2, generator=gen).unbind(0)
    selected = moba_gate(q, k, block, top_k)[0, 0]  # (T, nB)
    seen = (torch.arange(t)[:, None] - block * torch.arange(selected.shape[-1])[None, :] + 1).clamp(0, block)
    return int(selected.sum()), int((seen * selected).sum())  # a selected block's keys at or before the query


def _counted(t, block, top_k, gen):
    """The reference for exercise 3, always from a real gate (no formula here to copy): directly where the gate
    fits, else from two gates with the same block, top_k and last block, top_k and top_k + 1 whole blocks before it
    (from there on every whole block adds the same work), extended linearly in the number of whole blocks."""
    if t < 2 ** 20:
        counts = _gate_counts(t, block, top_k, gen)
        if t <= 1024:  # the package's own counter agrees where its token mask fits
            work = selected_work(moba_gate(*torch.randn(2, 1, 1, t, 2, generator=gen).unbind(0), block, top_k), block, t)
            assert counts == (work["blocks"], work["keys"]), (t, block, top_k, counts, work)
        return counts
    m, r = divmod(t, block)
    lo, hi = (_gate_counts(n * block + r, block, top_k, gen) for n in (top_k, top_k + 1))
    return tuple(a + (m - top_k) * (b - a) for a, b in zip(lo, hi))


# exercise 4 (the selection-recall experiment): ch14_recall.py
