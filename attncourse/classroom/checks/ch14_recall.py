"""Chapter 14's exercise 4, the selection-recall experiment (solutions/14_learned_sparse_attention.ipynb)."""

from __future__ import annotations

import math
import re

import torch

from attncourse.learned_sparse import moba_gate
from . import Case, exercise
from .ch11 import READ_AROUND  # a tensor's numbers reached around the trace's read count
from .ch14 import _MATMUL, _op


# ----------------------------------------------------------------------------- 4. experiment: recall against top_k

RECALL = dict(n_seq=64, seq_len=256, dim=32, block=16)  # the exercise's sizes: 64 sequences, T=256, D=32, blocks of 16


def _selection_recall_reference(seed: int, top_k: int) -> float:
    """The exercise's measurement, through the package's full gate (which the answer may not call): share of the
    64 sequences whose last query's MoBA selection holds the block of a planted needle key."""
    n, t, d, block = RECALL["n_seq"], RECALL["seq_len"], RECALL["dim"], RECALL["block"]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 1, t, d, generator=gen)
    k = torch.randn(n, 1, t, d, generator=gen)
    pos = torch.randint(0, t - block, (n,), generator=gen)
    rows = torch.arange(n)
    k[rows, 0, pos] += q[:, 0, -1]
    sel = moba_gate(q, k, block, top_k)[:, 0, -1]  # (n, nB)
    return float(sel[rows, pos // block].float().mean())


def _op_work(name: str, shapes: list) -> int:
    """Multiply-adds (a matrix product: batch x m x k x n from its operands' shapes) or entries (any other operator:
    the broadcast of its inputs) one operator does, whatever the layout its tensors were reshaped to."""
    shapes = [tuple(int(x) for x in sh) for sh in shapes]
    if _VIEWS.match(_op(name)):  # a new view of the same entries: no work
        return 0
    if _INDEXING.match(_op(name)):  # reads or writes the entries its indices name, not the whole source
        return sum(math.prod(sh) for sh in shapes[1:])
    if _MATMUL.match(_op(name)) and len(shapes) >= 2:
        a, b = shapes[-2], shapes[-1]
        if len(a) >= 1 and len(b) >= 1:
            batch = math.prod(a[:-2]) if len(a) > 2 else math.prod(b[:-2]) if len(b) > 2 else 1
            rows = a[-2] if len(a) >= 2 else 1
            cols = b[-1] if len(b) >= 2 else 1
            return batch * rows * a[-1] * cols
    try:
        return math.prod(torch.broadcast_shapes(*shapes)) if shapes else 0
    except RuntimeError:
        return sum(math.prod(sh) for sh in shapes)


_VIEWS = re.compile(r"^(view|_unsafe_view|reshape|_reshape_alias|select|slice|expand|expand_as|unsqueeze|squeeze|"
                    r"transpose|permute|t|alias|as_strided|detach|unbind|split|split_with_sizes|chunk|narrow|unflatten|"
                    r"flatten|lift_fresh|view_as|movedim|diagonal|_to_copy_view)$")
_INDEXING = re.compile(r"^(index|index_put_|index_put|_index_put_impl_|index_select|gather|take|take_along_dim|"
                       r"embedding)$")  # embedding(weight, indices): a row gather, like index_select
_RECALL_PASSES = 6  # passes over the keys an honest measurement may make (the solutions make about 1: the pooling)


def _last_query_only(runs) -> str | None:
    """Only the last query is scored: no matrix product runs over the 256 positions, no operator receives a
    (positions x blocks) grid of scores or masks (that is MoBA's whole gate, 256 times the work the measurement
    needs), and, whatever the layout, the multiply-adds and entries of all its operators stay within a bounded
    number of passes over the keys (views and the entries indexing names are free; the whole gate takes 16 passes
    more, in its products alone)."""
    t, nb = RECALL["seq_len"], RECALL["seq_len"] // RECALL["block"]
    keys = RECALL["n_seq"] * t * RECALL["dim"]  # one pass over the keys: drawing, planting, pooling
    for run in runs:
        total = sum(_op_work(name, [shape for _l, _o, shape, _s in tensors])
                    for name, _launch, _helper, tensors in run.trace["ops"])
        if total > _RECALL_PASSES * keys:
            return (f"case '{run.case.name}': your code's operators did {total:,} multiply-adds and entries in all, "
                    f"more than {_RECALL_PASSES} passes over the keys ({_RECALL_PASSES * keys:,}): scoring the last "
                    f"query needs {RECALL['n_seq']} x {nb} x {RECALL['dim']} multiply-adds, and scoring every "
                    f"position, in whatever layout, takes {t} times that")
    for run in runs:
        for name, _launch, _helper, tensors in run.trace["ops"]:
            op = _op(name)
            for _label, _off, shape, _stride in tensors:
                grid = (t in shape and nb in shape) or t * nb in shape  # in any layout
                if grid or (_MATMUL.match(op) and t in shape):
                    return (f"case '{run.case.name}': an operator ({op}) received a tensor of shape {shape}, one row "
                            f"per position: the measurement needs the last query's {nb} block scores only")
    return None


# Numbers an honest measurement may read out of its tensors into plain Python: the last query's block scores (64 x 16,
# for a top-k done on lists) and a few per sequence (needle positions, hits). Scoring in Python needs the block means
# and the last queries (64 x 16 x 32 + 64 x 32 floats) at least; the whole gate, every query (review 12b's route H).
_RECALL_READ_MOST = RECALL["n_seq"] * (RECALL["seq_len"] // RECALL["block"] + 4)


def _scored_in_torch(runs) -> str | None:
    """The scores come from PyTorch: no more numbers read out into plain Python (tolist, storage reads, item,
    float, int: ``trace["read"]`` and one ``_local_scalar_dense`` each) than the last query's block scores and a
    few per sequence; then :func:`_last_query_only`. The function takes no tensors, so the guard's read-out budget
    (a share of the arguments' entries) does not apply here: the property counts instead."""
    for run in runs:
        trace = run.trace or {}
        read = trace.get("read", 0) + trace.get("counts", {}).get("aten::_local_scalar_dense", 0)
        if read > _RECALL_READ_MOST:
            return (f"case '{run.case.name}': your code read {read:,} numbers out of its tensors into plain Python "
                    f"(tolist, item, float), more than {_RECALL_READ_MOST:,}: the gate's scores are computed outside "
                    "PyTorch, where the check cannot see how many positions you scored; score the last query with "
                    "tensor operations")
    return _last_query_only(runs)


def _recall_shortcut_package(seed, top_k):
    """The package's gate over every query: refused for calling it."""
    n, t, d, block = 64, 256, 32, 16
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, 1, t, d, generator=gen), torch.randn(n, 1, t, d, generator=gen)
    pos, rows = torch.randint(0, t - block, (n,), generator=gen), torch.arange(n)
    k[rows, 0, pos] += q[:, 0, -1]
    return float(moba_gate(q, k, block, top_k)[:, 0, -1][rows, pos // block].float().mean())


def _recall_breaker_full_gate(seed, top_k):
    """MoBA's whole gate by hand (every query against every block summary): the right recall, 256 times the
    scores (refused by the property)."""
    n, t, d, block = 64, 256, 32, 16
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, 1, t, d, generator=gen), torch.randn(n, 1, t, d, generator=gen)
    pos, rows = torch.randint(0, t - block, (n,), generator=gen), torch.arange(n)
    k[rows, 0, pos] += q[:, 0, -1]
    gate = q[:, 0] @ k[:, 0].view(n, t // block, block, d).mean(2).transpose(-2, -1)  # (n, T, nB)
    own, blocks = torch.arange(t)[:, None] // block, torch.arange(t // block)[None, :]
    rank = gate.masked_fill(blocks >= own, -math.inf).argsort(-1, descending=True).argsort(-1)
    sel = ((rank < top_k - 1) & (blocks < own) | (blocks == own))[:, -1]  # (n, nB): the last query's row
    return float(sel[rows, pos // block].float().mean())


def _recall_close(got, expected):
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = float(got)
    if not isinstance(got, float):
        return f"expected a Python float, got {type(got).__name__}"
    if abs(got - expected) > 1e-9:
        return (f"your recall is {abs(got - expected):.3g} away from what the same measurement gives here: check the "
                "draws (their order, shapes and seed), where the needle goes, and which blocks the last query keeps")
    return None


@exercise("14-selection-recall", "selection_recall", points=2, category="experiment",
          forbid=("attncourse.learned_sparse.moba_gate", "attncourse.learned_sparse.mean_pool_blocks",
                  "attncourse.learned_sparse.selected_work", "attncourse.learned_sparse.blocks_to_mask", *READ_AROUND),
          allow=(), ops=("attention", "softmax", "logsumexp"), prop=_scored_in_torch,
          shortcuts=(_recall_shortcut_package,), breakers=(_recall_breaker_full_gate,),
          prop_doc="only the last query is scored against the block summaries, in PyTorch: no positions x blocks "
                   "grid, no matrix product over the positions (from the trace), and no more numbers read out into "
                   "plain Python than the last query's block scores and a few per sequence",
          hint="follow the recipe's draws in their order with one generator; the needle is added to one key of "
               "each sequence; then only the last query matters: its own block, and the top_k - 1 best of the "
               "blocks before it by its dot product with each block's mean key")
def _selection_recall():
    """Measure how often MoBA's selection holds a planted needle, for several seeds and top_k."""
    return [Case(f"seed {seed}, top_k {top_k}", (seed, top_k), expected=_selection_recall_reference(seed, top_k),
                 compare=_recall_close)
            for seed in (0, 1, 2) for top_k in (2, 4, 8)]
