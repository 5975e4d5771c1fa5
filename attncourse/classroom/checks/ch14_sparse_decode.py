"""Chapter 14's exercise 5: one DSA decode step, the lightning indexer's top-k then attention over those tokens only
(solutions/14_learned_sparse_attention.ipynb).

The expected values come from the package (``indexer_scores``, ``top_k_tokens``, ``token_select_attention``), which
the answer may not call. The property is read from the trace: the main keys and values (the large cache the indexer
exists to avoid reading) are touched only through an indexing operator naming at most ``top_k`` rows, or through
views of at most ``top_k`` rows; every other operator's work stays within a few passes over the indexer's inputs
and the selected rows.
"""

from __future__ import annotations

import math

import torch

from attncourse.learned_sparse import indexer_scores, token_select_attention, top_k_tokens
from . import Case, exercise
from .ch09 import _rows
from .ch14 import _op
from .ch14_recall import _INDEXING, _VIEWS, _op_work

_DECODE_PASSES = 8  # passes over the indexer's inputs and the selected rows an honest answer may make (about 2)


def _decode_reference(q, k, v, q_index, w_index, k_index, top_k):
    """(out (H, Dv), idx (min(top_k, S),) ascending): the package's indexer, top-k and token-selected attention."""
    scores = indexer_scores(q_index[None, :, None], w_index[None, :, None], k_index[None], causal=False)  # (1, 1, S)
    idx = top_k_tokens(scores, top_k)[0, 0]
    idx = idx[idx >= 0].sort().values
    out = token_select_attention(q[None, :, None], k[None, None], v[None, None], idx[None, None])  # (1, H, 1, Dv)
    return out[0, :, 0], idx


def _reads_top_k(runs) -> str | None:
    """The main keys and values are read at the selected rows only: an indexing operator may take the whole cache
    but names at most top_k rows of it; any other operator (a product, a copy, a comparison) may take views of at
    most top_k rows. And the work of all operators (multiply-adds of products, entries of the others, indexing by
    the entries it names) stays within a few passes over the indexer's inputs and the selected rows, whatever the
    tensors are called."""
    for run in runs:
        q, k, v, q_index, _w, k_index, top_k = run.case.args
        s = k.shape[0]
        n_sel = min(top_k, s)
        why = rows_read_beyond(run, k, v, n_sel, "the main", f"the {n_sel} the indexer selected", "the selected rows",
                               "a few rows at a time or not, the main attention must read the selected tokens only")
        if why:
            return why
        h, d = q.shape
        dv = v.shape[1]
        hi, di = q_index.shape
        need = hi * s * di + 4 * hi * s + n_sel * (d + dv) + h * n_sel * (d + dv) + s
        total = sum(_op_work(name, [shape for _l, _o, shape, _s in tensors])
                    for name, _launch, _helper, tensors in run.trace["ops"])
        if total > _DECODE_PASSES * need + 4096:
            return (f"case '{run.case.name}': your operators did {total:,} multiply-adds and entries in all, more than "
                    f"{_DECODE_PASSES} times what the indexer over {s} tokens and attention over {n_sel} of them need "
                    f"({need:,}): the main attention's work must follow the selection, not the context")
    return None


def rows_read_beyond(run, k, v, n_sel, whose, chosen, rows, total_hint) -> str | None:
    """Why `run` read more of the cache (arguments 1 and 2, `k` and `v`) than the `n_sel` rows selected, or None: an
    indexing operator may take the whole cache but name at most `n_sel` rows; any other operator may take views of at
    most `n_sel` rows; the rows read in all stay within 3 times `n_sel`. `whose`, `chosen` and `rows` word the
    message ("the main", "the 64 the indexer selected", "the selected rows"); `total_hint` ends the last one."""
    s = k.shape[0]
    read = {"arg1": 0, "arg2": 0}
    for name, _launch, _helper, tensors in run.trace["ops"]:
        op = _op(name)
        if _VIEWS.match(op):
            continue
        for label, off, shape, stride in tensors:
            if label not in read:
                continue
            what = "key" if label == "arg1" else "value"
            width = k.shape[1] if label == "arg1" else v.shape[1]
            if _INDEXING.match(op):  # the rows its index tensor names (a boolean mask names every row)
                named = max([int(sh[0]) for lab, _o, sh, _s in tensors if lab is None and len(sh) >= 1] or [s])
                if op == "take":  # flat indices into the (S, width) cache: width of them per row
                    named = -(-named // max(width, 1))
                if named > n_sel:
                    return (f"case '{run.case.name}': an indexing operator ({op}) named {named} rows of {whose} "
                            f"{what}s (indices or a mask over every row), more than {chosen}: gather {rows} by "
                            "their indices")
                read[label] += named
                continue
            a, e = _rows((label, off, shape, stride), width, s * width)
            if e - a > n_sel:
                return (f"case '{run.case.name}': an operator ({op}) read {e - a} rows of {whose} {what}s at once, "
                        f"more than {chosen}: that is dense attention (masked or not); take {rows} first and "
                        "attend over those only")
            read[label] += e - a
    for label, what in (("arg1", "key"), ("arg2", "value")):
        if read[label] > 3 * n_sel:
            return (f"case '{run.case.name}': your operators read {read[label]} rows of {whose} {what}s in all, "
                    f"more than 3 times {chosen}: {total_hint}")
    return None


def _decode_shortcut_package(q, k, v, q_index, w_index, k_index, top_k):
    """The package's indexer, top-k and token attention: refused for calling them."""
    return _decode_reference(q, k, v, q_index, w_index, k_index, top_k)


def _decode_breaker_dense_masked(q, k, v, q_index, w_index, k_index, top_k):
    """The indexer's top-k, then dense attention over every cached key with the others masked: right output, the work
    of dense attention (refused by the property)."""
    scores = (w_index[:, None] * torch.relu(q_index @ k_index.T)).sum(0)  # (S,)
    idx = scores.topk(min(top_k, k.shape[0])).indices.sort().values
    keep = torch.zeros(k.shape[0], dtype=torch.bool)
    keep[idx] = True
    s = (q @ k.T / math.sqrt(q.shape[-1])).masked_fill(~keep, -math.inf)  # (H, S)
    return torch.softmax(s, -1) @ v, idx


def _decode_breaker_copy_then_gather(q, k, v, q_index, w_index, k_index, top_k):
    """A float copy of the whole cache, then the gather from the copy: right output, every row read (refused)."""
    scores = (w_index[:, None] * torch.relu(q_index @ k_index.T)).sum(0)
    idx = scores.topk(min(top_k, k.shape[0])).indices.sort().values
    kc, vc = k * 1.0, v * 1.0  # (S, D), (S, Dv): copies of all S rows
    p = torch.softmax(q @ kc[idx].T / math.sqrt(q.shape[-1]), -1)
    return p @ vc[idx], idx


@exercise("14-indexer-decode", "indexer_decode", points=3, category="implement",
          forbid=("attncourse.learned_sparse.indexer_scores", "attncourse.learned_sparse.top_k_tokens",
                  "attncourse.learned_sparse.token_select_attention", "attncourse.learned_sparse.blocks_to_mask",
                  "attncourse.sdpa.scaled_dot_product_attention", "attncourse.flash.flash_attention"),
          allow=(), ops=(), prop=_reads_top_k,  # PyTorch's attention on the gathered rows is allowed: the skill is
          # the selection and reading only its rows (the trace refuses attention over the whole cache, masked or not)
          shortcuts=(_decode_shortcut_package,),
          breakers=(_decode_breaker_dense_masked, _decode_breaker_copy_then_gather),
          prop_doc="the main keys and values are read at the top_k selected rows only (an indexing operator naming "
                   "at most top_k rows, or views of at most top_k rows), and the work of all operators stays within "
                   "a few passes over the indexer's inputs and the selected rows (from the trace): dense attention "
                   "with the unselected keys masked, or a copy of the whole cache, is refused",
          title="One DeepSeek Sparse Attention decode step: the lightning indexer's top-k, then attention over those "
                "tokens only",
          hint="where does the rectifier go in the indexer's score, before or after the heads' weights are "
               "applied? How many tokens can you choose when the cache is shorter than top_k? Which rows of the main "
               "keys and values does the attention of the chosen tokens need, and can you take only those before "
               "any score is computed?")
def _indexer_decode_cases():
    """(out (H, Dv), idx (min(top_k, S),) long ascending) for one decode query over S cached tokens."""
    gen = torch.Generator().manual_seed(142)
    cases = []
    for name, (h, d, dv, hi, di, s, top_k) in {
        "H=4 heads, S=40 cached tokens, top 8": (4, 16, 12, 3, 8, 40, 8),
        "top_k larger than the cache: S=9, top 16": (2, 8, 8, 2, 4, 9, 16),
        "one indexer head, S=100, top 1": (3, 8, 6, 1, 6, 100, 1),
        "a long cache: H=16, S=4096, top 64 (dense attention reads 64 times the selection)": (16, 64, 64, 2, 8, 4096, 64),
        "a long cache, few heads: H=2, S=3000, top 32": (2, 16, 16, 2, 8, 3000, 32),
    }.items():
        q = torch.randn(h, d, generator=gen, dtype=torch.float64)
        k = torch.randn(s, d, generator=gen, dtype=torch.float64)
        v = torch.randn(s, dv, generator=gen, dtype=torch.float64)
        q_index = torch.randn(hi, di, generator=gen, dtype=torch.float64)
        w_index = torch.randn(hi, generator=gen, dtype=torch.float64)  # signed, as the indexer's weights are
        for _ in range(20):  # redraw the indexer keys on a near-tie that the package's float32 scores would reorder
            k_index = torch.randn(s, di, generator=gen, dtype=torch.float64)
            args = (q, k, v, q_index, w_index, k_index, top_k)
            in64 = (w_index[:, None] * torch.relu(q_index @ k_index.T)).sum(0).topk(min(top_k, s)).indices.sort()[0]
            if torch.equal(in64, _decode_reference(*args)[1]):
                break
        cases.append(Case(name, args, expected=_decode_reference(*args), rtol=1e-7, atol=1e-9))
    return cases
