"""Checks for chapter 14, attention that learns where to look (solutions/14_learned_sparse_attention.ipynb).

Expected values come from the package (``moba_gate``, ``selected_work``) or from the course's oracle
(``scaled_dot_product_attention`` under the selection's token mask), never from a copy of the solution.
"""

from __future__ import annotations

import math
import re

import torch

from attncourse.learned_sparse import blocks_to_mask, mean_pool_blocks, moba_gate, n_blocks, selected_work
from attncourse.online_softmax import AttentionState, finalize_attention_state, online_attention_update
from attncourse.sdpa import scaled_dot_product_attention
from . import Case, exercise
from .ch09 import _NO_READ, _rows

TILES_QUESTION = dict(seq_len=4096, block_size=64, top_k=8)  # the configuration the prediction asks about
_MATMUL = re.compile(r"^(mm|bmm|addmm|baddbmm|matmul|mv|dot|vdot|addbmm|_efficient_attention_forward)$")
_REDUCE = re.compile(r"^(sum|mean|cumsum)$")


def _op(name: str) -> str:
    return name.split("::")[-1].split(".")[0]


# ----------------------------------------------------------------------------- 1. implement MoBA's gate


def _no_token_scores(runs) -> str | None:
    """No (T, T) tensor of query-key scores is ever formed: no operator receives a tensor with two adjacent dims of
    size T, and no matrix product multiplies two operands that both run over the T tokens."""
    for run in runs:
        t = run.case.args[0].shape[-2]
        for name, _launch, _helper, tensors in run.trace["ops"]:
            for _label, _off, shape, _stride in tensors:
                if any(a == t and b == t for a, b in zip(shape, shape[1:])):
                    return (f"case '{run.case.name}': an operator ({_op(name)}) received a tensor of shape {shape}, "
                            f"a T x T = {t} x {t} grid: the gate scores blocks, one summary per block, never single keys")
            if _MATMUL.match(_op(name)) and len(tensors) >= 2 and all(t in shape for _l, _o, shape, _s in tensors[-2:]):
                return (f"case '{run.case.name}': a matrix product ({_op(name)}) multiplied two operands that both run "
                        f"over the {t} tokens: that is the T x T score matrix the gate exists to avoid")
    return None


def _breaker_token_scores(query, key, block_size, top_k):
    """Every query-key score, then averaged per block: the same gate values, T x T work (refused by the property)."""
    b, h, t = query.shape[:3]
    hkv = key.shape[1]
    nb = -(-t // block_size)
    k = key.repeat_interleave(h // hkv, dim=1)
    s = query @ k.transpose(-2, -1)  # (B, H, T, T)
    padded = s.new_zeros(b, h, t, nb * block_size)
    padded[..., :t] = s
    sizes = torch.full((nb,), float(block_size), dtype=s.dtype)
    sizes[-1] = t - (nb - 1) * block_size
    gate = padded.view(b, h, t, nb, block_size).sum(-1) / sizes  # (B, H, T, nB) = q . mean of the block's keys
    own = torch.arange(t) // block_size
    past = torch.arange(nb)[None, :] < own[:, None]
    sel = torch.zeros(b, h, t, nb, dtype=torch.bool)
    if top_k > 1 and nb > 1:
        idx = gate.masked_fill(~past, -math.inf).topk(min(top_k - 1, nb - 1), dim=-1).indices
        sel.scatter_(-1, idx, True)
        sel &= past
    sel[..., torch.arange(t), own] = True
    return sel


def _shortcut_package(query, key, block_size, top_k):
    return moba_gate(query, key, block_size, top_k)


def _shortcut_pool(query, key, block_size, top_k):
    """The package's pooling, then the rest by hand: must be refused."""
    h, hkv, t = query.shape[1], key.shape[1], query.shape[2]
    pooled = mean_pool_blocks(key, block_size).repeat_interleave(h // hkv, dim=1)
    gate = query @ pooled.transpose(-2, -1)
    nb = pooled.shape[-2]
    own = torch.arange(t) // block_size
    past = torch.arange(nb)[None, :] < own[:, None]
    sel = torch.zeros(gate.shape, dtype=torch.bool)
    if top_k > 1 and nb > 1:
        sel.scatter_(-1, gate.masked_fill(~past, -math.inf).topk(min(top_k - 1, nb - 1), dim=-1).indices, True)
        sel &= past
    sel[..., torch.arange(t), own] = True
    return sel


@exercise("14-moba-gate", "moba_select", points=3, category="implement",
          forbid=("attncourse.learned_sparse.moba_gate", "attncourse.learned_sparse.mean_pool_blocks",
                  "torch.nn.functional.scaled_dot_product_attention", "torch.softmax"),
          allow=(), ops=("attention", "softmax", "logsumexp"), prop=_no_token_scores,
          breakers=(_breaker_token_scores,), shortcuts=(_shortcut_package, _shortcut_pool),
          prop_doc="the gate never forms a T x T score grid: no operator receives one, no matrix product runs over "
                   "the tokens on both sides (from the trace)",
          title="MoBA's block gate: choose each query's key blocks from one summary per block",
          hint="summarise each block of keys by one vector first (mind the last block, which may be short), score "
               "every query against the summaries of its own KV head, and choose only among the blocks that lie "
               "wholly before the query's own block; the own block is always kept and counts towards top_k")
def _moba_gate_cases():
    """(B, H, T, nB) bool: MoBA's causal block selection, own block always kept, top_k counting it."""
    gen = torch.Generator().manual_seed(14)
    cases = []
    for name, (b, h, hkv, t, d, block, top_k) in {
        "B=2, H=2, T=40, blocks of 8, top 3": (2, 2, 2, 40, 16, 8, 3),
        "T=37: the last block holds 1 key (blocks of 6), top 2": (1, 2, 2, 37, 8, 6, 2),
        "grouped heads: H=4 over Hkv=2, T=44, blocks of 5, top 4": (2, 4, 2, 44, 8, 5, 4),
        "top_k larger than the blocks: every earlier block (T=30, blocks of 7, top 9)": (1, 3, 1, 30, 8, 7, 9),
        "top_k = 1: the own block only (T=27, blocks of 4)": (1, 2, 1, 27, 8, 4, 1),
    }.items():
        q = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
        k = torch.randn(b, hkv, t, d, generator=gen, dtype=torch.float64)
        cases.append(Case(name, (q, k, block, top_k), expected=moba_gate(q, k, block, top_k), compare="equal"))
    return cases


# ----------------------------------------------------------------------------- 2. find the bug: a selected-block loop


def _budgeted_reads(runs) -> str | None:
    """Keys and values are read one block at a time (at most block_size rows per operator; a sum or mean over the
    keys for the block summaries excepted), and no more key and value rows in all than the selected blocks hold."""
    for run in runs:
        q, k, v, block, top_k = run.case.args
        h, t, d = q.shape
        budget = 0
        for i in range(t):
            budget += min(top_k, i // block + 1) * block
        budget *= h
        read = {"arg1": 0, "arg2": 0}
        for name, _launch, _helper, tensors in run.trace["ops"]:
            op = _op(name)
            if _NO_READ.match(op):
                continue
            for label, off, shape, stride in tensors:
                if label not in read:
                    continue
                if label == "arg1" and _REDUCE.match(op):
                    continue  # the block summaries: one pass over the keys
                width = d if label == "arg1" else v.shape[-1]
                a, e = _rows((label, off, shape, stride), width, t * width)
                if e - a > block:
                    return (f"case '{run.case.name}': one operator ({op}) read {e - a} "
                            f"{'key' if label == 'arg1' else 'value'} rows at once; the loop reads one block of at "
                            f"most {block} rows at a time")
                read[label] += e - a
        for label, what in (("arg1", "key"), ("arg2", "value")):
            if read[label] > budget:
                return (f"case '{run.case.name}': your loop read {read[label]} {what} rows, more than the "
                        f"{budget} that the selected blocks of all queries and heads hold")
    return None


def _breaker_dense(q, k, v, block, top_k):
    """Dense attention under the selection's token mask: right output, every key read at once."""
    h, t, d = q.shape
    nb = -(-t // block)
    means = torch.stack([k[:, i * block:(i + 1) * block].mean(1) for i in range(nb)], 1)  # (H, nB, D)
    gate = q @ means.transpose(-2, -1)  # (H, T, nB)
    own = torch.arange(t) // block
    earlier = torch.arange(nb)[None, :] < own[:, None]
    sel = torch.zeros(h, t, nb, dtype=torch.bool)
    if top_k > 1 and nb > 1:
        sel.scatter_(-1, gate.masked_fill(~earlier, -math.inf).topk(min(top_k - 1, nb - 1), dim=-1).indices, True)
        sel &= earlier
    sel[:, torch.arange(t), own] = True
    allowed = sel.repeat_interleave(block, dim=-1)[..., :t] & torch.ones(t, t, dtype=torch.bool).tril()
    s = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill(~allowed, -math.inf)  # (H, T, T)
    m0 = q.new_full((h, t), -math.inf)
    state = online_attention_update(AttentionState(m0, torch.zeros_like(m0), q.new_zeros(h, t, v.shape[-1])), s, v)
    return finalize_attention_state(state)[0]


def _breaker_every_block(q, k, v, block, top_k):
    """Per query, every earlier block visited and the unselected ones masked: right output, too many reads."""
    h, t, d = q.shape
    nb = -(-t // block)
    means = torch.stack([k[:, i * block:(i + 1) * block].mean(1) for i in range(nb)], 1)  # (H, nB, D)
    gate = q @ means.transpose(-2, -1)  # (H, T, nB)
    own = torch.arange(t) // block
    earlier = torch.arange(nb)[None, :] < own[:, None]
    sel = torch.zeros(h, t, nb, dtype=torch.bool)
    if top_k > 1 and nb > 1:
        sel.scatter_(-1, gate.masked_fill(~earlier, -math.inf).topk(min(top_k - 1, nb - 1), dim=-1).indices, True)
        sel &= earlier
    sel[:, torch.arange(t), own] = True
    out = torch.empty(h, t, v.shape[-1], dtype=q.dtype)
    for hh in range(h):
        for i in range(t):
            m0 = q.new_full((1,), -math.inf)
            state = AttentionState(m0, torch.zeros_like(m0), q.new_zeros(1, v.shape[-1]))
            for b in range(i // block + 1):
                k0, k1 = b * block, min((b + 1) * block, t)
                s = (q[hh, i:i + 1] @ k[hh, k0:k1].transpose(-2, -1)) / math.sqrt(d)
                keep = (torch.arange(k0, k1) <= i) & bool(sel[hh, i, b])
                state = online_attention_update(state, s.masked_fill(~keep[None, :], -math.inf), v[hh, k0:k1])
            out[hh, i] = finalize_attention_state(state)[0][0]
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
          ops=("attention", "softmax", "logsumexp"), prop=_budgeted_reads,
          breakers=(_breaker_dense, _breaker_every_block),
          prop_doc="keys and values are read block by block, never more rows than the selected blocks hold (rows read, "
                   "from the trace)",
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
    }.items():
        q, k, v = (torch.randn(h, t, d, generator=gen, dtype=torch.float64) for _ in range(3))
        cases.append(Case(name, (q, k, v, block, top_k), expected=_block_loop_reference(q, k, v, block, top_k),
                          rtol=1e-7, atol=1e-9))
    return cases


# ----------------------------------------------------------------------------- 3. predict: blocks and keys


def tiles_reference(seq_len: int, block_size: int, top_k: int) -> tuple[int, int]:
    """(blocks visited, keys scored) per head with one query per tile, counted from a real gate on random data."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, seq_len, 8, generator=gen)
    k = torch.randn(1, 1, seq_len, 8, generator=gen)
    work = selected_work(moba_gate(q, k, block_size, top_k), block_size, seq_len)
    return work["blocks"], work["keys"]


@exercise("14-predict-tiles", "tiles_prediction", kind="value", points=2, category="predict",
          parts=("blocks visited", "keys scored"),
          hint="a query in block i has i earlier blocks to choose from; count the blocks each query reads, then the "
               "keys, remembering that inside its own block a query sees only the keys up to itself")
def _predict_tiles():
    """Predict the blocks visited and keys scored per head by MoBA's loop, T=4096, blocks of 64, top_k=8."""
    expected = tiles_reference(**TILES_QUESTION)
    return [Case("(blocks visited, keys scored) for T=4096, blocks of 64, top_k=8, one query per tile",
                 expected=expected, compare="equal")]


# ----------------------------------------------------------------------------- 4. experiment: recall against top_k


def selection_recall_reference(seed: int, top_k: int) -> float:
    """The exercise's measurement (its text gives the recipe): share of 64 sequences whose last query's MoBA
    selection holds the block of a planted needle key."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(64, 1, 256, 32, generator=gen)
    k = torch.randn(64, 1, 256, 32, generator=gen)
    pos = torch.randint(0, 240, (64,), generator=gen)
    rows = torch.arange(64)
    k[rows, 0, pos] += q[:, 0, -1]
    sel = moba_gate(q, k, 16, top_k)[:, 0, -1]  # (64, nB)
    return float(sel[rows, pos // 16].float().mean())


def _recall_close(got, expected):
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = float(got)
    if not isinstance(got, float):
        return f"expected a Python float, got {type(got).__name__}"
    if abs(got - expected) > 1e-9:
        return (f"your recall is {abs(got - expected):.3g} away from what the same measurement gives here: check the "
                "draws (their order, shapes and seed), where the needle goes, and which block you test")
    return None


@exercise("14-selection-recall", "selection_recall", points=2, category="experiment",
          allow=("attncourse.learned_sparse.moba_gate",),
          hint="follow the recipe's draws in their order with one generator; the needle is added to one key of "
               "each sequence, and the question is only whether the last query's selection holds that key's block")
def _selection_recall():
    """Measure how often MoBA's selection holds a planted needle, for several seeds and top_k."""
    return [Case(f"seed {seed}, top_k {top_k}", (seed, top_k), expected=selection_recall_reference(seed, top_k),
                 compare=_recall_close)
            for seed in (0, 1, 2) for top_k in (2, 4, 8)]
