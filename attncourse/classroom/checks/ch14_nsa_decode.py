"""Chapter 14's exercise 6: one NSA decode step for a GQA group, its selected branch: the group's one choice of blocks
(compressed probabilities summed over the group's query heads, NSA's eq. 10), then attention that reads only the
rows of those blocks (solutions/14_learned_sparse_attention.ipynb).

The expected values come from the package (``nsa_select`` for the choice, ``token_select_attention`` for attention
over the chosen rows), which the answer may not call. The property is read from the trace, as for exercise 5: the
group's keys and values are touched only through an indexing operator naming at most the selected rows, or through
views of at most that many rows; every other operator's work stays within a few passes over the compressed keys and
the selected rows. The choice itself is judged by value: a choice per head (their union), the raw scores summed
instead of each head's probabilities, or the best head's probability instead of the sum choose other blocks.
"""

from __future__ import annotations

import math

import torch

from attncourse.learned_sparse import nsa_select, token_select_attention
from . import Case, exercise
from .ch14_recall import _op_work
from .ch14_sparse_decode import rows_read_beyond

_NSA_PASSES = 8  # passes over the compressed keys and the selected rows an honest answer may make (about 2)


def _nsa_reference(q, k, v, k_cmp, block_size, top_n):
    """(out (G, Dv), blocks (n,) ascending): the package's selection (eq. 10) and attention over the chosen rows."""
    g, d = q.shape
    s = k.shape[0]
    own = max(s - 1, 0) // block_size  # the block of the last position
    nb = own + 1
    probs = torch.softmax(q @ k_cmp.T / math.sqrt(d), -1) if own else q.new_zeros(g, 0)  # (G, own)
    full = q.new_zeros(1, g, s, nb)
    full[0, :, -1, :own] = probs  # the last position's row; nsa_select reads its own block from the position
    sel = nsa_select(full, 1, top_n, block_size)[0, 0, -1]  # (nB,) bool
    blocks = sel.nonzero().flatten()
    starts = blocks * block_size
    rows = torch.cat([torch.arange(a, min(a + block_size, s)) for a in starts.tolist()])
    out = token_select_attention(q[None, :, None], k[None, None], v[None, None], rows[None, None])  # (1, G, 1, Dv)
    return out[0, :, 0], blocks


def _reads_selected_blocks(runs) -> str | None:
    """The group's keys and values are read at the rows of the chosen blocks only: an indexing operator may take the
    whole cache but names at most that many rows of it; any other operator may take views of at most that many rows;
    the rows read in all stay within 3 times the selection, and the work of all operators within a few passes over
    the compressed keys and the selected rows, whatever the tensors are called."""
    for run in runs:
        q, k, v, k_cmp, block_size, top_n = run.case.args
        s = k.shape[0]
        own = max(s - 1, 0) // block_size
        n_sel = min(top_n, own) * block_size + (s - own * block_size)  # the chosen earlier blocks and its own
        why = rows_read_beyond(run, k, v, n_sel, "the group's", f"the {n_sel} rows of the blocks the group chose",
                               "the chosen blocks' rows",
                               "the selected branch loads each chosen block once for the whole group, and nothing else")
        if why:
            return why
        g, d = q.shape
        dv = v.shape[1]
        need = 2 * g * own * d + 4 * g * own + n_sel * (d + dv) + g * n_sel * (d + dv) + own + s
        total = sum(_op_work(name, [shape for _l, _o, shape, _s in tensors])
                    for name, _launch, _helper, tensors in run.trace["ops"])
        if total > _NSA_PASSES * need + 4096:
            return (f"case '{run.case.name}': your operators did {total:,} multiply-adds and entries in all, more "
                    f"than {_NSA_PASSES} times what scoring {own} compressed blocks and attending over {n_sel} rows "
                    f"need ({need:,}): the work must follow the selection, not the context")
    return None


def _nsa_shortcut_package(q, k, v, k_cmp, block_size, top_n):
    """The package's selection and token attention: refused for calling them."""
    return _nsa_reference(q, k, v, k_cmp, block_size, top_n)


def _nsa_breaker_dense_masked(q, k, v, k_cmp, block_size, top_n):
    """The group's right choice, then dense attention over every cached key with the other blocks masked: right
    output, dense work (refused by the property)."""
    s, own = k.shape[0], (k.shape[0] - 1) // block_size
    imp = torch.softmax(q @ k_cmp.T / math.sqrt(q.shape[1]), -1).sum(0)  # (own,)
    blocks = torch.cat([imp.topk(min(top_n, own)).indices, torch.tensor([own])]).sort().values
    keep = torch.isin(torch.arange(s) // block_size, blocks)
    w = torch.softmax((q @ k.T / math.sqrt(q.shape[1])).masked_fill(~keep, -math.inf), -1)  # (G, S)
    return w @ v, blocks


def _nsa_breaker_copy_then_gather(q, k, v, k_cmp, block_size, top_n):
    """A float copy of the whole cache, then the chosen rows taken from the copy: right output, every row read."""
    s, own = k.shape[0], (k.shape[0] - 1) // block_size
    imp = torch.softmax(q @ k_cmp.T / math.sqrt(q.shape[1]), -1).sum(0)
    blocks = torch.cat([imp.topk(min(top_n, own)).indices, torch.tensor([own])]).sort().values
    rows = torch.arange(s)[torch.isin(torch.arange(s) // block_size, blocks)]
    kc, vc = k * 1.0, v * 1.0  # (S, D), (S, Dv): copies of all S rows
    return torch.softmax(q @ kc[rows].T / math.sqrt(q.shape[1]), -1) @ vc[rows], blocks


@exercise("14-nsa-group-decode", "nsa_group_decode", points=3, category="implement",
          forbid=("attncourse.learned_sparse.nsa_select", "attncourse.learned_sparse.nsa_attention",
                  "attncourse.learned_sparse.compressed_attention", "attncourse.learned_sparse.selected_attention",
                  "attncourse.learned_sparse.token_select_attention", "attncourse.learned_sparse.blocks_to_mask",
                  "attncourse.learned_sparse.moba_gate", "attncourse.sdpa.scaled_dot_product_attention",
                  "attncourse.flash.flash_attention"),
          allow=(), ops=(), prop=_reads_selected_blocks,  # PyTorch's attention on the gathered rows is allowed: the
          # skill is the group's choice and reading only its blocks (the trace refuses attention over the whole cache)
          shortcuts=(_nsa_shortcut_package,),
          breakers=(_nsa_breaker_dense_masked, _nsa_breaker_copy_then_gather),
          prop_doc="the group's keys and values are read at the rows of the chosen blocks only (an indexing operator "
                   "naming at most those rows, or views of at most that many rows), and the work of all operators "
                   "stays within a few passes over the compressed keys and the selected rows (from the trace): dense "
                   "attention with the other blocks masked, or a copy of the whole cache, is refused",
          title="One NSA decode step for a GQA group: one shared choice of blocks, then attention over those blocks only",
          hint="what does each head's row of compressed scores become before the heads are combined, so that no head "
               "outweighs the others by the scale of its scores? Which block must every query read whatever the "
               "ranking says, and may it be ranked? Which rows does that leave the attention to load, and can you take "
               "only those before any score against the cache is computed?")
def _nsa_decode_cases():
    """(out (G, Dv), blocks (n,) long ascending) for the newest query of one GQA group over S cached tokens."""
    gen = torch.Generator().manual_seed(146)
    cases = []
    for name, (g, d, dv, s, block, top_n) in {
        "G=4 heads, S=61 cached tokens in blocks of 8, top 2": (4, 16, 12, 61, 8, 2),
        "a full last block: G=2, S=48, blocks of 8, top 3": (2, 8, 8, 48, 8, 3),
        "more blocks asked than there are: G=3, S=20, blocks of 8, top 5": (3, 8, 6, 20, 8, 5),
        "the first block only: G=2, S=5, blocks of 8, top 2": (2, 8, 8, 5, 8, 2),
        "a long cache: G=8, S=4096, blocks of 64, top 4 (dense attention reads 13 times the selection)":
            (8, 64, 64, 4096, 64, 4),
        "one head, S=1000, blocks of 16, top 1": (1, 16, 16, 1000, 16, 1),
    }.items():
        own = (s - 1) // block
        for _ in range(50):  # heads on different scales, so that summing scores and summing probabilities differ
            q = torch.randn(g, d, generator=gen, dtype=torch.float64) * (1 + 3 * torch.rand(g, 1, generator=gen,
                                                                                             dtype=torch.float64))
            k = torch.randn(s, d, generator=gen, dtype=torch.float64)
            v = torch.randn(s, dv, generator=gen, dtype=torch.float64)
            k_cmp = k[:own * block].reshape(own, block, d).mean(1) * 2.0 if own else k.new_zeros(0, d)
            imp = torch.softmax(q @ k_cmp.T / math.sqrt(d), -1).sum(0).sort(descending=True).values
            if own <= top_n or imp[top_n - 1] - imp[top_n] > 1e-6:  # no near-tie at the cut
                break
        args = (q, k, v, k_cmp, block, top_n)
        cases.append(Case(name, args, expected=_nsa_reference(*args), rtol=1e-7, atol=1e-9))
    return cases
