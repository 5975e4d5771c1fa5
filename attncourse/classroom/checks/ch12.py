"""Checks for chapter 12, attention variants and what heads learn (solutions/12_attention_variants.ipynb)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attncourse.heads import induction_scores
from attncourse.variants import diff_lambda_init, differential_attention, sigmoid_attention
from attncourse.vit import patchify
from . import Case, edits, exercise, forbidden
from .ch12_given import FIX_LAMBDA, FIX_SIGMOID, _breaker_rewrite_lambda, _breaker_rewrite_sigmoid


def _qkv(gen: torch.Generator, lead: tuple, tq: int, tk: int, d: int, dv: int, n: int = 1) -> list[torch.Tensor]:
    qs = [torch.randn(*lead, tq, d, generator=gen, dtype=torch.float64) for _ in range(n)]
    ks = [torch.randn(*lead, tk, d, generator=gen, dtype=torch.float64) for _ in range(n)]
    return [*qs, *ks, torch.randn(*lead, tk, dv, generator=gen, dtype=torch.float64)]


def _shortcut_sigmoid(q, k, v, is_causal=False):
    return sigmoid_attention(q, k, v, is_causal=is_causal)


@exercise("12-sigmoid", "sigmoid_attn", points=2, category="implement",
          forbid=("attncourse.sigmoid_attention", "attncourse.variants.sigmoid_attention"),
          allow=(), ops=("attention", "softmax"),
          prop_doc="sigmoid attention is a closed formula: equal outputs in float64 (causal or not, Tq != Tk, and a causal "
                   "case with Tq != Tk that tells the top-left mask from the bottom-right one) are "
                   "the skill once the package's sigmoid_attention and the fused kernels are refused",
          shortcuts=(_shortcut_sigmoid,),
          hint="each weight is the sigmoid of its own scaled score plus the bias the lesson derives, with no "
               "normalisation over the row; with is_causal, a key after the query must get weight exactly 0, "
               "which a score of minus infinity gives")
def _sigmoid():
    """Sigmoid attention with the bias b = -log(Tk), optionally causal."""
    gen = torch.Generator().manual_seed(120)
    cases = []
    for lead, tq, tk, d, dv, causal in (((2, 3), 5, 5, 8, 8, False), ((1, 2), 4, 9, 4, 6, False),
                                        ((2,), 6, 6, 8, 3, True), ((3, 1), 1, 7, 5, 5, False), ((2, 2), 7, 7, 4, 4, True),
                                        ((2,), 4, 9, 4, 5, True)):  # Tq != Tk, causal: query i sees keys 0..i
        q, k, v = _qkv(gen, lead, tq, tk, d, dv)
        cases.append(Case(f"q {tuple(q.shape)}, k {tuple(k.shape)}, is_causal={causal}", (q, k, v),
                          {"is_causal": causal}, expected=sigmoid_attention(q, k, v, is_causal=causal),
                          rtol=1e-6, atol=1e-8))  # a bias computed in float32 (log of a float32 Tk) is still right
    return cases


def _shortcut_diff(q, k, v, lam, is_causal=False):
    (q1, q2), (k1, k2) = q.chunk(2, dim=-1), k.chunk(2, dim=-1)
    return differential_attention(q1, k1, q2, k2, v, lam, is_causal=is_causal)


def _shortcut_diff_sdpa(q, k, v, lam, is_causal=False):
    (q1, q2), (k1, k2) = q.chunk(2, dim=-1), k.chunk(2, dim=-1)
    a = F.scaled_dot_product_attention(q1, k1, v, is_causal=is_causal)
    return a - lam * F.scaled_dot_product_attention(q2, k2, v, is_causal=is_causal)


def _breaker_diff(q, k, v, lam, is_causal=False):
    """Each map multiplied by v on its own, then subtracted: the right output, v read twice."""
    d = q.size(-1) // 2
    outs = []
    for part in (slice(0, d), slice(d, d + d)):
        s = (q[..., part] @ k[..., part].mT) / math.sqrt(d)
        if is_causal:
            s = s.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
        outs.append(s.softmax(dim=-1) @ v)
    return outs[0] - lam * outs[1]


def _value_macs(op: str, tensors: list, dv: int) -> int:
    """Multiply-adds an operation spends producing rows of width `dv` (a value product): matrix products whose
    output has `dv` rows or columns, and broadcast products whose result ends in `dv` (a multiply-then-sum)."""
    name = op.split("::")[-1].split(".")[0]
    shapes = [tuple(t[2]) for t in tensors]
    if name in ("mm", "bmm", "matmul", "baddbmm", "addmm", "addbmm") and len(shapes) >= 2:
        a, b = shapes[-2], shapes[-1]
        if len(a) < 2 or len(b) < 2:
            return 0
        m, k, n = a[-2], a[-1], b[-1]
        return math.prod(a[:-2]) * m * k * n if dv in (m, n) else 0
    if name == "mul" and len(shapes) == 2 and all(shapes):
        out = torch.broadcast_shapes(*shapes)
        return math.prod(out) if out and out[-1] == dv and len(out) >= 3 else 0
    return 0


def _one_value_product(runs) -> str | None:
    """v (the third argument) enters exactly one arithmetic operation, and the value products cost what ONE map
    times v costs: the maps are subtracted before touching v (a copy of v used twice, or the two maps laid side by
    side against v stacked twice, do twice the work)."""
    for run in runs:
        ops = (run.trace or {}).get("ops", ())
        uses = [op for op, _, _, tensors in ops
                if any(t[0] == "arg2" for t in tensors) and not forbidden.DATA_OPS.match(op.split("::")[-1].split(".")[0])]
        if len(uses) != 1:
            return (f"on case '{run.case.name}' the values v entered {len(uses)} operations "
                    f"({', '.join(u.split('::')[-1] for u in uses[:4])}): subtract the two maps first, then multiply "
                    "by v once")
        q, k, v = run.case.args[:3]
        one = math.prod(q.shape[:-1]) * k.shape[-2] * v.shape[-1]  # (lead, Tq) rows, Tk keys, dv features: one product
        spent = sum(_value_macs(op, tensors, v.shape[-1]) for op, _, _, tensors in ops)
        if spent > 1.25 * one:
            return (f"on case '{run.case.name}' your value products cost {spent / one:.1f} times one map times v: "
                    "the values were multiplied by both maps (a copy of v counts as v); subtract the two maps "
                    "first, then multiply by v once")
    return None


@exercise("12-diff-attention", "diff_attn", points=3, category="implement",
          forbid=("attncourse.differential_attention", "attncourse.variants.differential_attention",
                  "attncourse.scaled_dot_product_attention", "attncourse.sdpa.scaled_dot_product_attention",
                  "torch.nn.functional.scaled_dot_product_attention"),
          allow=(), ops=("attention",), prop=_one_value_product,
          prop_doc="one value product: the two maps are subtracted before v is touched (v enters one operation, and the "
                   "multiply-adds of products with v's width are those of one map times v)",
          breakers=(_breaker_diff,),
          shortcuts=(_shortcut_diff, _shortcut_diff_sdpa),
          hint="the first half of the last dim of q and k makes the first map, the second half the second map; "
               "the scale comes from the half width, not the packed one; subtract the maps before touching v "
               "(one value matmul), and block future keys in both maps when asked")
def _diff():
    """Differential attention from packed queries and keys [q1 | q2], [k1 | k2], optionally causal."""
    gen = torch.Generator().manual_seed(121)
    cases = []
    for lead, tq, tk, d, dv, lam, causal in (((2, 2), 5, 5, 4, 8, 0.2, False), ((1, 3), 3, 7, 8, 16, 0.8, False),
                                             ((2,), 6, 6, 4, 8, 0.0, True), ((1, 1), 1, 9, 2, 4, 0.5, False),
                                             ((2, 2), 8, 8, 8, 16, -0.3, True)):
        q, k, v = _qkv(gen, lead, tq, tk, 2 * d, dv)
        expected = differential_attention(q[..., :d], k[..., :d], q[..., d:], k[..., d:], v, lam, is_causal=causal)
        cases.append(Case(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, lam={lam}, is_causal={causal}",
                          (q, k, v, lam), {"is_causal": causal}, expected=expected, rtol=1e-7, atol=1e-9))
    return cases


def _random_maps(gen: torch.Generator, lead: tuple, t: int) -> torch.Tensor:
    s = torch.randn(*lead, t, t, generator=gen, dtype=torch.float64) * 2
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))  # causal
    return torch.softmax(s, -1)


def _shortcut_induction(weights, seg_len):
    return induction_scores(weights, seg_len)


def _breaker_induction(weights, seg_len):
    """A Python loop over the queries of the second copy: the right scores, one indexing per position."""
    total = torch.zeros(weights.shape[:-2], dtype=weights.dtype)
    for t in range(seg_len, 2 * seg_len):
        total = total + weights[..., t, t - seg_len + 1]
    return total / seg_len


def _ops_count(run) -> int:
    trace = run.trace or {}
    return sum(trace.get("counts", {}).values()) + trace.get("dropped", 0)


def _no_loop_over(size, what):
    """A property: the operation count does not grow with `size(run)` (no Python loop over `what`)."""
    def prop(runs):
        small, large = min(runs, key=size), max(runs, key=size)
        if _ops_count(large) > 2 * _ops_count(small) + 20:
            return (f"your code ran {_ops_count(large)} PyTorch operations for {size(large)} {what} and "
                    f"{_ops_count(small)} for {size(small)}: the work grows with the number of {what}, so it loops "
                    f"over them in Python; handle all {what} at once")
        return None

    prop.__name__ = f"no_loop_over_{what.replace(' ', '_')}"
    return prop


@exercise("12-induction-score", "induction_score", points=2, category="implement",
          forbid=("attncourse.induction_scores", "attncourse.heads.induction_scores"),
          allow=(), ops=("attention", "softmax"), prop=_no_loop_over(lambda run: run.case.args[1], "positions"),
          prop_doc="no Python loop over positions: the operation count does not grow with the segment length",
          breakers=(_breaker_induction,),
          shortcuts=(_shortcut_induction,),
          hint="only queries of the second copy count; each looks one position after its token's earlier "
               "occurrence, a fixed offset below the diagonal; gather those entries (a diagonal of the map, or "
               "advanced indexing with two index vectors) and average them over the queries")
def _induction_score():
    """Score every head's map for the induction pattern on a repeated sequence."""
    gen = torch.Generator().manual_seed(122)
    cases = []
    for lead, seg_len in (((3,), 4), ((2, 4), 6), ((1, 2, 3), 5), ((2,), 1), ((2, 2), 48)):
        w = _random_maps(gen, lead, 2 * seg_len)
        cases.append(Case(f"weights {tuple(w.shape)}, seg_len={seg_len}", (w, seg_len),
                          expected=induction_scores(w, seg_len), rtol=1e-7, atol=1e-9))
    return cases


def planted_induction_maps(gen: torch.Generator, n_layers: int, n_heads: int, seg_len: int, layer: int, head: int,
                           strength: float, prev_at: tuple[int, int] | None = None,
                           decoys: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """Random causal maps (layers, H, 2L, 2L) with an induction stripe mixed into head (layer, head).

    Distractors: a previous-token head at `prev_at` (default: layer 0, the next head), and at each of `decoys` a
    pure duplicate-token head with a sink: over the first copy all weight on key 0 (as the induction head's), over
    the second copy all weight on the token's own earlier occurrence t - L (one key before the induction target)."""
    t = 2 * seg_len
    maps = _random_maps(gen, (n_layers, n_heads), t)
    stripe = torch.zeros(t, t, dtype=torch.float64)
    stripe[torch.arange(seg_len, t), torch.arange(1, seg_len + 1)] = 1.0
    stripe[:seg_len, 0] = 1.0  # first copy: nothing to copy, weight on the first token
    maps[layer, head] = (1 - strength) * maps[layer, head] + strength * stripe
    prev = torch.zeros(t, t, dtype=torch.float64)  # a previous-token head as a distractor
    prev[0, 0] = 1.0
    prev[torch.arange(1, t), torch.arange(t - 1)] = 1.0
    maps[prev_at if prev_at is not None else (0, (head + 1) % n_heads)] = prev
    dup = torch.zeros(t, t, dtype=torch.float64)  # duplicate-token head: the off-by-one of an induction head
    dup[:seg_len, 0] = 1.0
    dup[torch.arange(seg_len, t), torch.arange(0, seg_len)] = 1.0
    for where in decoys:
        maps[where] = dup
    return maps


def _shortcut_find_head(maps, seg_len):
    scores = induction_scores(maps, seg_len)  # (layers, H)
    return divmod(int(scores.argmax()), scores.shape[-1])


@exercise("12-find-head", "find_induction_head", points=1, category="implement",
          forbid=("attncourse.induction_scores", "attncourse.heads.induction_scores"),
          allow=(), ops=("attention", "softmax"),
          prop_doc="the (layer, head) pair is the skill: the planted head moves from layer to layer (the first, a "
                   "middle one, the last), among distractors (a previous-token head; duplicate-token heads that sink "
                   "on key 0 over the first copy and look one key before the induction target over the second), "
                   "and the library's scores are refused",
          shortcuts=(_shortcut_find_head,),
          hint="score every (layer, head) with your own induction score, then turn the flat position of the best "
               "one back into a row and a column of the (layers, H) table, as two Python ints")
def _find_head():
    """Return (layer, head) of the induction head in maps of shape (layers, H, 2L, 2L)."""
    gen = torch.Generator().manual_seed(123)
    cases = []
    for n_layers, n_heads, seg_len, layer, head, strength, prev_at, decoys in (
            (2, 2, 6, 1, 0, 0.7, (0, 1), ((1, 1),)),
            (2, 4, 8, 0, 3, 0.6, (1, 0), ((1, 1), (1, 2))),
            (3, 4, 5, 2, 1, 0.5, (0, 2), ((2, 0), (1, 3))),
            (2, 3, 7, 0, 2, 0.4, (1, 1), ((1, 0), (0, 0))),
            (3, 3, 6, 1, 1, 0.5, (2, 0), ((2, 2), (0, 1)))):
        maps = planted_induction_maps(gen, n_layers, n_heads, seg_len, layer, head, strength, prev_at, decoys)
        scores = induction_scores(maps, seg_len)  # (layers, H)
        expected = divmod(int(scores.argmax()), n_heads)
        assert expected == (layer, head)
        cases.append(Case(f"maps {tuple(maps.shape)}, seg_len={seg_len}", (maps, seg_len), expected=expected,
                          compare="equal"))
    return cases


def _breaker_patchify(images, p):
    """Every patch cut out by a Python loop and stacked: the right patches, one slice per patch."""
    b, c, h, w = images.shape
    patches = [images[:, :, r:r + p, col:col + p].reshape(b, c * p * p)
               for r in range(0, h, p) for col in range(0, w, p)]
    return torch.stack(patches, 1)  # (B, N, C p^2)


def _shortcut_patchify(images, p):
    return patchify(images, p)


def _shortcut_unfold(images, p):
    return F.unfold(images, p, stride=p).transpose(1, 2)


def _shortcut_pixel_unshuffle(images, p):
    return F.pixel_unshuffle(images, p).flatten(2).transpose(1, 2)


@exercise("12-patchify", "my_patchify", points=2, category="implement",
          forbid=("attncourse.patchify", "attncourse.vit.patchify", "torch.nn.functional.unfold",
                  "torch.nn.functional.pixel_unshuffle", "torch.pixel_unshuffle", "torch.nn.PixelUnshuffle",
                  "torch.Tensor.unfold", "torch.nn.functional.conv2d", "torch.conv2d", "torch.nn.Conv2d"),
          # im2col under other names: Tensor.unfold's sliding windows, a convolution with one-hot kernels (review 9)
          allow=(), ops=("aten::im2col", "aten::col2im", "aten::pixel_unshuffle", "aten::pixel_shuffle", "aten::unfold",
                         "aten::unfold_copy", "aten::convolution", "aten::conv2d", "aten::conv1d", "aten::conv3d",
                         "aten::mkldnn_convolution", "aten::slow_conv2d_forward", "aten::thnn_conv2d",
                         "aten::convolution_overrideable", "aten::conv_transpose2d", "aten::conv_tbc"),
          prop=_no_loop_over(lambda run: (run.case.args[0].shape[-2] // run.case.args[1])
                             * (run.case.args[0].shape[-1] // run.case.args[1]), "patches"),
          prop_doc="no Python loop over patches: the operation count does not grow with the number of patches",
          breakers=(_breaker_patchify,),
          shortcuts=(_shortcut_patchify, _shortcut_unfold, _shortcut_pixel_unshuffle),
          hint="no loop is needed: reshape can split an axis in two and permute can reorder axes; decide which "
               "axes must sit next to each other for one patch to be contiguous")
def _patchify():
    """Cut images (B, C, H, W) into flattened p x p patches (B, N, C p^2)."""
    gen = torch.Generator().manual_seed(124)
    cases = []
    for b, c, h, w, p in ((2, 1, 16, 16, 4), (1, 3, 8, 12, 4), (2, 2, 6, 6, 3), (1, 1, 5, 5, 5), (3, 2, 4, 6, 2),
                          (1, 2, 32, 48, 2)):
        x = torch.randn(b, c, h, w, generator=gen)
        cases.append(Case(f"images {tuple(x.shape)}, patch_size={p}", (x, p), expected=patchify(x, p),
                          compare="equal"))
    return cases


# ----------------------------------------------------------------------------- find the bug, ablation


def sigmoid_cross_attention_reference(x, context, w_q, w_k, w_v, n_heads):
    """Multi-head sigmoid attention of queries from x (B, Tq, d_model) over keys/values from context (B, Tk, d_model)."""
    b, tq, d_model = x.shape
    tk, d = context.shape[1], d_model // n_heads
    q = (x @ w_q).view(b, tq, n_heads, d).transpose(1, 2)  # (B, H, Tq, d)
    k = (context @ w_k).view(b, tk, n_heads, d).transpose(1, 2)  # (B, H, Tk, d)
    v = (context @ w_v).view(b, tk, n_heads, d).transpose(1, 2)  # (B, H, Tk, d)
    out = sigmoid_attention(q, k, v)  # (B, H, Tq, d)
    return out.transpose(1, 2).reshape(b, tq, d_model)


@exercise("12-find-the-bug-1", "sigmoid_cross_attention_fixed", points=2, category="bug", aliases=("12-sigmoid-bug",),
          forbid=("attncourse.sigmoid_attention", "attncourse.variants.sigmoid_attention"),
          allow=(), ops=("attention", "softmax"), breakers=(_breaker_rewrite_sigmoid,),
          prop=edits.prop(FIX_SIGMOID, "`sigmoid_cross_attention_fixed`"), trace=False,
          prop_doc="the diagnosis: equal outputs with Tq != Tk (a single query over a long context, more queries than "
                   "keys), from the given layer with a small edit where it is wrong (a layer written afresh from the "
                   "lesson's formula does not show the bug was found)",
          bug_words=("query length", "number of queries", "queries instead of", "query count", "length of x",
                     "x's length", "instead of the context", "instead of the keys", "from the queries",
                     "log t_q", "log of the query", "wrong length", "bias uses"),
          hint="the first test only tried queries and keys of the same length; try a context longer or shorter "
               "than x (a single query over a long context is the decode case) and compare each head with the "
               "lesson's formula, or look at what a row of weights adds up to when all scores are 0")
def _sigmoid_bug():
    """Fix a multi-head sigmoid cross-attention layer."""
    gen = torch.Generator().manual_seed(125)
    cases = []
    for b, tq, tk, d_model, heads in ((2, 5, 5, 8, 2), (1, 1, 16, 12, 3), (3, 33, 7, 8, 1), (2, 4, 40, 16, 4)):
        x = torch.randn(b, tq, d_model, generator=gen, dtype=torch.float64)
        context = torch.randn(b, tk, d_model, generator=gen, dtype=torch.float64)
        ws = [torch.randn(d_model, d_model, generator=gen, dtype=torch.float64) / math.sqrt(d_model)
              for _ in range(3)]
        cases.append(Case(f"x {tuple(x.shape)}, context {tuple(context.shape)}, n_heads={heads}",
                          (x, context, *ws, heads), expected=sigmoid_cross_attention_reference(x, context, *ws, heads),
                          rtol=1e-6, atol=1e-8))  # a float32 bias is still right
    return cases


@exercise("12-find-the-bug-2", "lambda_init_schedule_fixed", points=1, category="bug", aliases=("12-lambda-bug",),
          forbid=("attncourse.diff_lambda_init", "attncourse.variants.diff_lambda_init"),
          allow=(), ops=(), breakers=(_breaker_rewrite_lambda,),
          prop=edits.prop(FIX_LAMBDA, "`lambda_init_schedule_fixed`"), trace=False,
          prop_doc="the diagnosis: equal values for stacks of 1 to 32 layers, from the given schedule with a small "
                   "edit where it is wrong (the paper's formula written afresh does not show the bug was found)",
          bug_words=("0-based", "zero-based", "1-based", "one-based", "off by one", "off-by-one", "starts at 0",
                     "starts at zero", "index shift", "exponent zero", "shifted by one",
                     "one layer too"),
          hint="test it where you can work the formula out by hand: a one-layer stack, whose only layer is the "
               "first; then follow that layer through the code, next to the paper's formula")
def _lambda_bug():
    """Fix the lambda_init schedule of a Differential Transformer stack."""
    gen = torch.Generator().manual_seed(127)  # the stack depths are drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    depths = (1, pick(2, 4), pick(5, 9), pick(10, 32))  # a one-layer stack always: the case to work out by hand
    return [Case(f"n_layers={n}", (n,), expected=torch.tensor([diff_lambda_init(l) for l in range(1, n + 1)],
                                                             dtype=torch.float64), rtol=1e-12, atol=1e-12)
            for n in depths]


