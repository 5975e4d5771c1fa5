"""Chapter 09's exercises 5 (the tiled forward in FlashAttention-1's order: key tiles outside) and 4b (the bfloat16
study: exercise 4's measurement as a function of its design), solutions/09_flash_attention.ipynb."""

from __future__ import annotations

import math
import re

import torch

from attncourse.sdpa import scaled_dot_product_attention
from . import Case, exercise
from .ch09 import _NO_READ, _rows, all_bf16_refusal, bf16_error_band, bf16_errors


# ----------------------------------------------------------------------------- 5. implement: the tiled forward


_WIDE_READS = re.compile(r"^(mm|bmm|addmm|baddbmm|addbmm|matmul|mv|dot|einsum|linear|sum|nansum|mean|amax|amin|max|"
                         r"min|aminmax|prod|logsumexp|softmax|log_softmax|norm|linalg_vector_norm|cumsum|cumprod|"
                         r"cummax|logcumsumexp|topk|sort|argmax|argmin|var|std|median|kthvalue)$")


def _keys_outside(runs) -> str | None:
    """FlashAttention-1's order, from the trace: keys and values are read one tile of at most block_k rows on the
    block_k grid and the loop never returns to a tile it has left (key tiles outside, each visited once), queries one
    block of the grid at a time, under the causal mask no query block with a key tile none of its rows may see, and no
    matrix product or reduction takes in a tensor whose last axis is wider than a block or tile (no row of all T
    scores, no K^T at once; elementwise work on the rows' statistics kept for all T rows is bookkeeping)."""
    for run in runs:
        q, k, v, bq, bk, causal = run.case.args
        t, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
        widest = max(bq, bk, d, dv)  # a block's per-row statistics (..., B_q) are not a row of scores
        cur_q, cur_k, left = None, {}, {"arg1": set(), "arg2": set()}
        for name, _launch, _helper, tensors in run.trace["ops"]:
            op = name.split("::")[-1].split(".")[0]
            if _NO_READ.match(op):
                continue
            # only a matrix product or a reduction can read a row of scores (or K^T) at once; an elementwise
            # operator on the rows' statistics kept for all T rows, (..., T), is bookkeeping: log(l) at the end
            for _label, _off, shape, _stride in (tensors if _WIDE_READS.match(op.lstrip("_")) else ()):
                if len(shape) >= 1 and int(shape[-1]) > widest:
                    return (f"case '{run.case.name}': an operator ({op}) took in a tensor of shape {tuple(shape)}, "
                            f"wider than any tile of the {bq} x {bk} tiling: a tiled forward holds one tile of scores "
                            "at a time, never a row of all T scores or the whole of K")
            for tensor in tensors:
                if tensor[0] == "arg0":
                    a, b = _rows(tensor, d, t * d)
                    if a % bq or b - a != min(bq, t - a):
                        return (f"case '{run.case.name}': one operator read query rows {a}..{b - 1}, not a block of "
                                f"the grid of {bq}-row blocks the call asks for: keep block_q as given")
                    cur_q = (a, b)
                elif tensor[0] in ("arg1", "arg2"):
                    what, width = ("key", d) if tensor[0] == "arg1" else ("value", dv)
                    c, e = _rows(tensor, width, t * width)
                    if e - c > bk or c % bk:
                        return (f"case '{run.case.name}': one operator read {what}s {c}..{e - 1}, not a tile of the "
                                f"grid of {bk}-row tiles the call asks for: keep block_k as given")
                    if c in left[tensor[0]]:
                        return (f"case '{run.case.name}': your loop came back to {what}s {c}..{e - 1} after moving on "
                                "to another tile: in this loop order each key tile is visited once, with every query "
                                "block inside it")
                    if tensor[0] in cur_k and cur_k[tensor[0]] != c:
                        left[tensor[0]].add(cur_k[tensor[0]])
                    cur_k[tensor[0]] = c
            reads = {tensor[0] for tensor in tensors}
            if causal and cur_q and "arg1" in cur_k and reads & {"arg0", "arg1"} and cur_q[1] - 1 < cur_k["arg1"]:
                return (f"case '{run.case.name}': the queries {cur_q[0]}..{cur_q[1] - 1} met keys from "
                        f"{cur_k['arg1']} on, which none of them may see under the causal mask: skip that block")
    return None


def _breaker_query_outer(q, k, v, block_q, block_k, is_causal):
    """The lesson's loop order (query blocks outside): right tiles, right skip, the other order."""
    t, d = q.shape[-2], q.shape[-1]
    outs, lses = [], []
    for q0 in range(0, t, block_q):
        q1 = min(q0 + block_q, t)
        m = q.new_full((*q.shape[:-2], q1 - q0, 1), -math.inf)
        l = q.new_zeros(*q.shape[:-2], q1 - q0, 1)  # noqa: E741
        acc = q.new_zeros(*q.shape[:-2], q1 - q0, v.shape[-1])
        for k0 in range(0, q1 if is_causal else t, block_k):
            k1 = min(t, k0 + block_k)
            s = q[..., q0:q1, :] @ k[..., k0:k1, :].transpose(-2, -1) / math.sqrt(d)
            if is_causal:
                s = s.masked_fill(torch.arange(q0, q1)[:, None] < torch.arange(k0, k1)[None, :], -math.inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p, alpha = torch.exp(s - m_new), torch.exp(m - m_new)
            l, acc, m = alpha * l + p.sum(-1, keepdim=True), alpha * acc + p @ v[..., k0:k1, :], m_new  # noqa: E741
        outs.append(acc / l)
        lses.append((m + l.log())[..., 0])
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _breaker_row_of_scores(q, k, v, block_q, block_k, is_causal):
    """Keys read tile by tile, but the scores of a query block glued into a row of T and softmaxed at once."""
    t, d = q.shape[-2], q.shape[-1]
    outs, lses = [], []
    for q0 in range(0, t, block_q):
        q1 = min(q0 + block_q, t)
        end = q1 if is_causal else t
        tiles = [q[..., q0:q1, :] @ k[..., k0:min(k0 + block_k, end), :].transpose(-2, -1) / math.sqrt(d)
                 for k0 in range(0, end, block_k)]
        s = torch.cat(tiles, dim=-1)  # (..., Bq, keys seen): a row of scores, not a tile
        if is_causal:
            rows, cols = torch.arange(q0, q1)[:, None], torch.arange(end)[None, :]
            s = s.masked_fill(cols > rows, -math.inf)
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        vs = torch.cat([v[..., k0:min(k0 + block_k, end), :] for k0 in range(0, end, block_k)], dim=-2)
        outs.append((p @ vs) / p.sum(-1, keepdim=True))
        lses.append((m + p.sum(-1, keepdim=True).log())[..., 0])
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _shortcut_pytorch(q, k, v, block_q, block_k, is_causal):
    """PyTorch's kernel for the output, torch.logsumexp over the full scores for the lse: must be refused."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal), torch.logsumexp(s, -1)


def _shortcut_package_flash(q, k, v, block_q, block_k, is_causal):
    """The package's tiled forward: must be refused."""
    from attncourse.flash import flash_attention_forward
    return flash_attention_forward(q, k, v, is_causal=is_causal, block_q=block_q, block_k=block_k)


@exercise("09-tiled-forward", "tiled_forward_keys_outside", points=3, category="implement",
          forbid=("torch.nn.functional.scaled_dot_product_attention", "attncourse.sdpa.scaled_dot_product_attention",
                  "attncourse.flash.flash_attention", "attncourse.flash.flash_attention_forward",
                  "attncourse.online_softmax.online_attention_update", "attncourse.online_softmax.merge_attention_states",
                  "attncourse.flash_options.flash_attention_options", "torch.softmax", "torch.logsumexp"),
          shortcuts=(_shortcut_pytorch, _shortcut_package_flash),  # no gradient case: the running state lives in
          gradient=False,  # full-size tensors updated in place, which autograd refuses to differentiate
          allow=(), ops=("attention", "softmax", "logsumexp"), prop=_keys_outside,
          breakers=(_breaker_row_of_scores, _breaker_query_outer),
          prop_doc="key tiles outside, each visited once; queries read one block of the grid at a time; under the mask "
                   "no query block that sees none of the tile; no matrix product or reduction over anything wider than a "
                   "block or tile (every read and every operand, from the trace)",
          title="The tiled forward in FlashAttention-1's order: key tiles outside",
          hint="with the key tiles outside, no query block's running state can stay on chip between two visits: it "
               "must live in full-size tensors and be read, updated and written back, one block's rows at a time. "
               "Work out what that state is and how it is rescaled when a later tile raises a row's max, and which "
               "query blocks a key tile can matter to under the mask")
def _tiled_forward():
    """(out, lse) of softmax(q k^T / sqrt(d)) v, tiled in FlashAttention-1's order: key tiles outside."""
    gen = torch.Generator().manual_seed(31)
    cases = []
    for name, (lead, t, d, dv, bq, bk, causal, mult) in {
        "T=45, blocks 16 x 8, no mask": ((2, 3), 45, 8, 8, 16, 8, False, 1.0),
        "T=37, blocks 8 x 16, causal, Dv != D": ((1, 2), 37, 16, 5, 8, 16, True, 1.0),
        "T=50, blocks 16 x 16, causal, scores x 20 (the max must be subtracted)": ((2,), 50, 8, 8, 16, 16, True, 20.0),
        "T=61, blocks 8 x 4, no mask, scores x 20": ((1, 1), 61, 4, 6, 8, 4, False, 20.0),
    }.items():
        q = torch.randn(*lead, t, d, generator=gen, dtype=torch.float64) * mult
        k = torch.randn(*lead, t, d, generator=gen, dtype=torch.float64)
        v = torch.randn(*lead, t, dv, generator=gen, dtype=torch.float64)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # PyTorch's kernel
        s = q @ k.transpose(-2, -1) / math.sqrt(d)  # (..., T, T), the reference's own scores
        if causal:
            s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
        lse = torch.logsumexp(s, dim=-1)  # (..., T)
        torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, is_causal=causal))  # two references
        cases.append(Case(name, (q, k, v, bq, bk, causal), expected=(out, lse), rtol=1e-7, atol=1e-9))
    return cases


# ----------------------------------------------------------------------------- 4b. experiment: the study itself


def bf16_study_reference(seeds: tuple[int, ...], shapes: tuple[tuple[int, float], ...]):
    """Reference: the study of exercise 4 over `seeds` x `shapes` ((T, scale) pairs), inputs drawn as the exercise
    says (one generator per seed, q, k, v of shape (1, 2, T, 32) per shape in order, scaled, rounded to bfloat16):
    (errors (seeds, shapes, 3) float64, (min, max) of tiled / same precision, (min, max) of all-bf16 / same)."""
    rows = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        row = []
        for t, scale in shapes:
            q, k, v = ((scale * torch.randn(1, 2, t, 32, generator=gen)).to(torch.bfloat16) for _ in range(3))
            row.append(bf16_errors(q, k, v))
        rows.append(row)
    table = torch.tensor(rows, dtype=torch.float64)  # (seeds, shapes, 3): tiled, same precision, all-bf16
    same = table[..., 1]
    spread = [(float(r.min()), float(r.max())) for r in (table[..., 0] / same, table[..., 2] / same)]
    return table, spread[0], spread[1]


def bf16_study_bands(seeds: tuple[int, ...], shapes: tuple[tuple[int, float], ...]) -> list[list[tuple[float, float]]]:
    """The band of legitimate all-bfloat16 errors (ch09.bf16_error_band) for every draw of the same design."""
    bands = []
    for seed in seeds:
        gen, row = torch.Generator().manual_seed(seed), []
        for t, scale in shapes:
            q, k, v = ((scale * torch.randn(1, 2, t, 32, generator=gen)).to(torch.bfloat16) for _ in range(3))
            row.append(bf16_error_band(q, k, v))
        bands.append(row)
    return bands


def _study_close(got, expected):
    expected, bands = expected
    if not (isinstance(got, (tuple, list)) and len(got) == 3 and isinstance(got[0], torch.Tensor)):
        return f"expected (errors tensor, (min, max), (min, max)), got {type(got).__name__}"
    errors, tiling, precision = got
    if tuple(errors.shape) != tuple(expected[0].shape):
        return (f"errors has shape {tuple(errors.shape)}, expected (seeds, shapes, 3) = {tuple(expected[0].shape)}: "
                "one row per seed, one column per shape, in the order given")
    errors = errors.double()
    for i, (name, tol) in enumerate(zip(("tiled", "untiled float32"), (1e-4, 1e-3))):
        bad = ((errors[..., i] - expected[0][..., i]).abs() > tol * expected[0][..., i]).nonzero()
        if len(bad):
            s, j = bad[0].tolist()
            return (f"the {name} error of seed #{s}, shape #{j} is not what the same measurement gives here: draw "
                    "the inputs exactly as the exercise says (one generator per seed, q, k, v per shape in order)")
    for s, row in enumerate(bands):  # the all-bfloat16 column: within the band of its legitimate spellings
        for j, band in enumerate(row):
            if all_bf16_refusal(float(errors[s, j, 2]), band):
                return (f"the all-bfloat16 error of seed #{s}, shape #{j} is not what the same measurement gives "
                        "here: draw the inputs exactly as the exercise says (one generator per seed, q, k, v per "
                        "shape in order), and measure each draw as in exercise 4")
    same = errors[..., 1]  # the ratios must be those of the learner's own errors
    for name, g, r, tol in (("tiled / same precision", tiling, errors[..., 0] / same, 1e-3),
                            ("all-bfloat16 / same precision", precision, errors[..., 2] / same, 1e-3)):
        e = (float(r.min()), float(r.max()))
        if not (isinstance(g, (tuple, list)) and len(g) == 2
                and all(abs(float(x) - y) <= tol * abs(y) for x, y in zip(g, e))):
            return f"the (min, max) of {name} over the draws is not what your own errors give"
    return None


@exercise("09-bf16-study", "bf16_study", points=1, category="experiment",
          allow=("attncourse.flash.flash_attention", "attncourse.sdpa.scaled_dot_product_attention"),
          hint="loop over the seeds, make one generator per seed, draw q, k, v for each shape in the order given, "
               "call your bf16_errors_measured on each draw, and compute the two ratios from the errors you measured")
def _bf16_study():
    """The measurement of exercise 4 as a function of the design: every draw's three errors and the spread of the
    two ratios that answer the question."""
    cases = []
    for seeds, shapes in (((0, 1, 2), ((64, 1.0), (300, 2.0))), ((5, 6, 7, 8), ((128, 0.5), (200, 3.0), (96, 1.5)))):
        cases.append(Case(f"seeds {seeds}, (T, scale) in {shapes}", (seeds, shapes),
                          expected=(bf16_study_reference(seeds, shapes), bf16_study_bands(seeds, shapes)),
                          compare=_study_close))
    return cases
