"""Checks for chapter 09, FlashAttention by tiling (solutions/09_flash_attention.ipynb).

Expected values come from the course's oracle (``scaled_dot_product_attention`` with an explicit boolean mask,
autograd through it), from the package's instrumented loops (the backward's traffic is counted by running it), never
from a copy of the solution.
"""

from __future__ import annotations

import math
import re

import torch

from attncourse.flash import flash_attention_backward
from attncourse.flash_io import TrafficCounter
from attncourse.sdpa import scaled_dot_product_attention
from . import Case, edits, exercise
from .ch09_guards import _breaker_complex_step, _no_numeric_differentiation
from .ch09_bf16 import (BAND, BF16_SPELLINGS, _bf16_formula, _causal_scores, _fp32_formula,  # noqa: F401 (re-exported)
                        all_bf16_refusal, bf16_error_band, bf16_errors)

HBM_QUESTION = dict(seq_len=4096, head_dim=128, block_q=128, block_k=64, is_causal=True, window=None)  # printed
HBM_QUESTION_WINDOW = dict(seq_len=4096, head_dim=128, block_q=128, block_k=64, is_causal=True, window=1000)


# ----------------------------------------------------------------------------- 1. the backward of one tile


def _shortcut_tile_backward(q, k, v, out, lse, d_out, scale):
    """The package's public backward on one key block: must be refused."""
    return flash_attention_backward(q, k, v, out, lse, d_out, scale=scale)


def _shortcut_autograd(q, k, v, out, lse, d_out, scale):
    """Autograd through the block's contribution out_blk = exp(S - lse) V with D folded in: must be refused."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    p = (q @ k.transpose(-2, -1) * scale - lse[..., None]).exp()  # (..., Bq, Bk)
    delta = (d_out * out).sum(-1, keepdim=True)  # (..., Bq, 1)
    # d/dS of <dO, P V> - <D, rowsum P> gives P * (dP - D): the gradient of the real loss restricted to the block
    loss = (d_out * (p @ v)).sum() - (delta * p.sum(-1, keepdim=True)).sum()
    return torch.autograd.grad(loss, (q, k, v))


@exercise("09-tile-backward", "tile_backward", points=3, category="implement",
          forbid=("attncourse.flash.flash_attention_backward", "torch.autograd.grad", "torch.Tensor.backward",
                  "torch.autograd.backward", "torch.func.vjp", "torch.func.grad", "torch.func.jacrev",
                  "torch.autograd.functional.vjp", "torch.autograd.functional.jacobian",
                  "torch.autograd.functional.jvp", "torch.autograd.functional.hessian", "torch.autograd.functional.vhp",
                  "torch.autograd.functional.hvp", "torch.func.jacfwd", "torch.func.jvp", "torch.func.linearize",
                  "torch.func.hessian", "torch.autograd.forward_ad.make_dual",
                  "torch.autograd.forward_ad.unpack_dual", "torch.autograd.forward_ad.dual_level",
                  "torch.softmax", "torch.nn.functional.scaled_dot_product_attention"),
          shortcuts=(_shortcut_tile_backward, _shortcut_autograd), allow=(),
          ops=("softmax", "attention", "logsumexp", "aten::_make_dual", "aten::_unpack_dual"),
          prop=_no_numeric_differentiation, breakers=(_breaker_complex_step,),
          prop_doc="a block's gradients are their numbers: equality on partial blocks, Dv != D and scores x 20 (where "
                   "P must come from lse) is the property; and they come from the chain rule: the operator count "
                   "and the largest tensor do not grow with the number of input entries (no finite differences)",
          title="The backward of one key block, probabilities rebuilt from lse",
          hint="the block holds only some of each row's keys, so the probabilities cannot be normalised inside it: "
               "rebuild them from what the forward saved for the whole row. The softmax's Jacobian needs one number "
               "per row, and section 4 of the lesson shows how to get it from the output and its gradient alone. "
               "Then follow the chain rule through the two products, remembering where the scale enters")
def _tile_backward():
    """dq (this block's share), dk and dv of one key block, given the final out and lse of every query row."""
    gen = torch.Generator().manual_seed(11)
    cases = []
    for name, (lead, tq, tk, d, dv, k0, k1, mult) in {
        "(2, 3) rows x 6 queries, keys 4..11 of 20": ((2, 3), 6, 20, 8, 8, 4, 11, 1.0),
        "the first 5 keys of 17, Dv != D": ((1,), 9, 17, 16, 5, 0, 5, 1.0),
        "the whole row as one block": ((2,), 4, 7, 8, 8, 0, 7, 1.0),
        "large scores (x 20): P must come from lse, not from exp of raw scores": ((1, 2), 5, 13, 8, 8, 6, 13, 20.0),
    }.items():
        q = torch.randn(*lead, tq, d, generator=gen, dtype=torch.float64) * mult
        k = torch.randn(*lead, tk, d, generator=gen, dtype=torch.float64)
        v = torch.randn(*lead, tk, dv, generator=gen, dtype=torch.float64)
        d_out = torch.randn(*lead, tq, dv, generator=gen, dtype=torch.float64)
        scale = 1 / math.sqrt(d)
        s = (q @ k.transpose(-2, -1)) * scale  # (..., Tq, Tk)
        lse = torch.logsumexp(s, dim=-1)  # (..., Tq)
        qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
        out = scaled_dot_product_attention(qr, kr, vr)
        dq_all, dk_all, dv_all = torch.autograd.grad(out, (qr, kr, vr), d_out)
        # this block's share of dq: dS restricted to the block's columns, times its keys
        p = torch.exp(s - lse[..., None])  # (..., Tq, Tk)
        ds = p * (d_out @ v.transpose(-2, -1) - (d_out * out.detach()).sum(-1, keepdim=True))
        dq_blk = ds[..., k0:k1] @ k[..., k0:k1, :] * scale  # (..., Tq, Bk) @ (..., Bk, D) -> (..., Tq, D)
        if k0 == 0 and k1 == tk:
            torch.testing.assert_close(dq_blk, dq_all)  # the reference itself, on the whole row
        cases.append(Case(name, (q, k[..., k0:k1, :], v[..., k0:k1, :], out.detach(), lse, d_out, scale),
                          expected=(dq_blk, dk_all[..., k0:k1, :], dv_all[..., k0:k1, :]), rtol=1e-7, atol=1e-9))
    return cases


# ----------------------------------------------------------------------------- 2. find the bug: a sliding window


def window_mask(t: int, window: int) -> torch.Tensor:
    """(T, T) boolean: query i sees keys i - window < j <= i."""
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    return (j <= i) & (j > i - window)


_NO_READ = re.compile(r"^(view|_unsafe_view|reshape|expand|permute|transpose|t|slice|select|unsqueeze|squeeze|alias|"
                      r"detach|lift_fresh|as_strided|split|split_with_sizes|unbind|chunk|narrow|diagonal|unfold|"
                      r"empty|empty_like|empty_strided|zeros|zeros_like|ones|ones_like|full|full_like|new_empty|"
                      r"new_zeros|new_full|new_ones|arange|scalar_tensor|_local_scalar_dense|item|is_nonzero|"
                      r"sym_size|sym_stride|sym_numel|sym_storage_offset|_has_compatible_shallow_copy_type|set_|"
                      r"resize_)$")


def _rows(tensor, row_stride: int, batch_stride: int) -> tuple[int, int]:
    """The [first, last + 1) rows of an input of rows `row_stride` wide that a view of it covers (batch axes aside)."""
    _label, offset, shape, stride = tensor
    if 0 in shape:
        return 0, 0
    within = offset % batch_stride
    span = sum((n - 1) * st for n, st in zip(shape, stride) if 0 < st < batch_stride)
    return within // row_stride, (within + span) // row_stride + 1


def _tiles_in_band(runs) -> str | None:
    """Keys and values are read tile by tile (at most block_k rows per operator, starting on the block_k grid), only
    after a block of block_q queries (on the block_q grid: the blocks the call asks for, not smaller ones), and only
    from the key blocks that hold a key the window lets that query block see."""
    for run in runs:
        q, _k, v, window, bq, bk = run.case.args
        t, d = q.shape[-2], q.shape[-1]
        current = None  # the query rows of the latest operator that read q
        for name, _launch, _helper, tensors in run.trace["ops"]:
            if _NO_READ.match(name.split("::")[-1].split(".")[0]):
                continue
            for tensor in tensors:
                if tensor[0] == "arg0":
                    a, b = _rows(tensor, d, t * d)
                    if b - a > bq:
                        return (f"case '{run.case.name}': one operator read {b - a} query rows at once; the loop takes "
                                f"the queries one block of at most {bq} at a time")
                    if a % bq or b - a != min(bq, t - a):
                        return (f"case '{run.case.name}': one operator read query rows {a}..{b - 1}, not a block of "
                                f"the grid of {bq}-row blocks the call asks for: keep block_q as given")
                    current = (a, b)
            for tensor in tensors:
                if tensor[0] not in ("arg1", "arg2"):
                    continue
                what = "key" if tensor[0] == "arg1" else "value"
                c, e = _rows(tensor, d if what == "key" else v.shape[-1], t * (d if what == "key" else v.shape[-1]))
                if e - c > bk:
                    return (f"case '{run.case.name}': one operator read {e - c} {what} rows at once; keys and values "
                            f"are read one tile of at most {bk} rows at a time")
                if c % bk:
                    return (f"case '{run.case.name}': one operator read {what}s {c}..{e - 1}, which do not start a "
                            f"tile of the grid of {bk}-row tiles the call asks for: keep block_k as given")
                if current is None:
                    return f"case '{run.case.name}': {what}s were read before any block of queries"
                a, b = current
                lo = max(a - window + 1, 0) // bk * bk
                hi = min(-(-b // bk) * bk, t)
                if c < lo or e > hi:
                    return (f"case '{run.case.name}': for the queries {a}..{b - 1} your loop read {what}s {c}..{e - 1}, "
                            "in a tile that holds no key those queries may see; visit only the tiles inside the band")
    return None


def _breaker_dense(q, k, v, window, block_q, block_k):
    """Dense masked attention over all keys in one pass, written out: no tiles, no band (refused by the property)."""
    t, d = q.shape[-2], q.shape[-1]
    s = q @ k.transpose(-2, -1) / math.sqrt(d)  # (..., T, T)
    rows, cols = torch.arange(t)[:, None], torch.arange(t)[None, :]
    s = s.masked_fill((cols > rows) | (cols <= rows - window), -math.inf)
    p = torch.exp(s - s.amax(-1, keepdim=True))  # every row sees its own key: the max is finite
    return (p @ v) / p.sum(-1, keepdim=True)


def _band_breaker(name: str, skip_before_band: bool, doc: str):
    """A tiled causal-window attention written afresh without reading the given code, the first tile's empty rows
    handled; its inner loop starts at key 0 (every causal tile, the band masked, not skipped) or at the tile holding
    the block's first key in the band (`skip_before_band`). Right values either way; the first reads outside the band
    (refused by the trace), the second is refused as no edit of the given function. A closure, not a call into
    this module, so that a breaker run as learner code enters no check code."""

    def breaker(q, k, v, window, block_q, block_k):
        t, d = q.shape[-2], q.shape[-1]
        out = torch.empty_like(q)
        for q0 in range(0, t, block_q):
            q1 = min(q0 + block_q, t)
            m = q.new_full((*q.shape[:-2], q1 - q0, 1), -math.inf)  # (..., Bq, 1)
            l = q.new_zeros(*q.shape[:-2], q1 - q0, 1)  # noqa: E741
            acc = q.new_zeros(*q.shape[:-2], q1 - q0, v.shape[-1])  # (..., Bq, Dv)
            start = max(q0 - window + 1, 0) // block_k * block_k if skip_before_band else 0
            for k0 in range(start, q1, block_k):
                k1 = min(k0 + block_k, q1)
                s = q[..., q0:q1, :] @ k[..., k0:k1, :].transpose(-2, -1) / math.sqrt(d)
                rows, cols = torch.arange(q0, q1)[:, None], torch.arange(k0, k1)[None, :]
                s = s.masked_fill((cols > rows) | (cols <= rows - window), -math.inf)
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # a row with nothing seen yet
                p, alpha = torch.exp(s - ref), torch.exp(m - ref)
                l, acc, m = alpha * l + p.sum(-1, keepdim=True), alpha * acc + p @ v[..., k0:k1, :], m_new  # noqa: E741
            out[..., q0:q1, :] = acc / l
        return out

    breaker.__name__ = breaker.__qualname__ = name
    breaker.__doc__ = doc
    return breaker


_breaker_causal_tiles = _band_breaker("_breaker_causal_tiles", False, "Tiles, but every causal tile from key 0: the "
                                      "band is masked, not skipped (refused by the property).")
_breaker_rewrite_band = _band_breaker("_breaker_rewrite_band", True, "Band tiles only, written afresh without reading "
                                      "the given code: right values and reads, refused as no edit of the given function.")


# The given function exactly as the exercise notebook shows it (tests/test_edits.py compares the two).
BUGGY_WINDOW = '''\
def windowed_attention_buggy(q, k, v, window, block_q, block_k):
    # q, k, v (..., T, D); causal with a window: query i sees keys i - window < j <= i
    t, d = q.shape[-2], q.shape[-1]
    out = torch.empty_like(q)                                               # (..., T, D)
    for q0 in range(0, t, block_q):
        q1 = min(q0 + block_q, t)
        k_lo = max(q0 - window + 1, 0) // block_k * block_k                 # the block holding the block's first key
        m = q.new_full((*q.shape[:-2], q1 - q0, 1), -math.inf)             # (..., Bq, 1) running max
        l = q.new_zeros(*q.shape[:-2], q1 - q0, 1)                          # (..., Bq, 1) running sum
        acc = q.new_zeros(*q.shape[:-2], q1 - q0, v.shape[-1])              # (..., Bq, Dv) unnormalised output
        for k0 in range(k_lo, q1, block_k):
            k1 = min(k0 + block_k, q1)
            s = q[..., q0:q1, :] @ k[..., k0:k1, :].transpose(-2, -1) / math.sqrt(d)  # (..., Bq, Bk)
            rows, cols = torch.arange(q0, q1)[:, None], torch.arange(k0, k1)[None, :]
            s = s.masked_fill((cols > rows) | (cols <= rows - window), -math.inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))              # (..., Bq, 1)
            p = torch.exp(s - m_new)                                        # (..., Bq, Bk)
            alpha = torch.exp(m - m_new)                                    # (..., Bq, 1)
            l = alpha * l + p.sum(-1, keepdim=True)
            acc = alpha * acc + p @ v[..., k0:k1, :]                        # (..., Bq, Dv)
            m = m_new
        out[..., q0:q1, :] = acc / l
    return out
'''
# Line 15 (the mask value) is a place for a fix too: a finite mask such as -1e30 is right on every case (a fully
# masked tile's finite garbage is wiped by alpha = exp(-1e30 - m) = 0 at the row's first visible key).
FIX_WINDOW = edits.SmallEdit(BUGGY_WINDOW, most=18, lines=(15, 16, 17, 18),
                             names=("ref", "isinf", "isneginf", "isfinite", "nan_to_num"))


@exercise("09-find-the-bug-1", "windowed_attention_fixed", points=2, category="bug", aliases=("09-window-bug",),
          forbid=("attncourse.flash.flash_attention", "attncourse.flash.flash_attention_forward",
                  "torch.nn.functional.scaled_dot_product_attention", "attncourse.sdpa.scaled_dot_product_attention",
                  "attncourse.online_softmax.online_attention_update"),
          allow=(), ops=("attention", "softmax", "logsumexp"),
          prop=edits.prop(FIX_WINDOW, "`windowed_attention_fixed`", also=_tiles_in_band),
          breakers=(_breaker_dense, _breaker_causal_tiles, _breaker_rewrite_band),
          prop_doc="keys and values are read tile by tile, on the block grid the call asks for, only from the tiles "
                   "the window lets each query block see (every read's rows, from the trace); and the diagnosis: the "
                   "answer is the given function with a small edit where it is wrong (a tiled attention written "
                   "afresh does not show the bug was found)",
          bug_words=("-inf - -inf", "-inf minus -inf", "inf - inf", "infinity minus infinity", "inf minus inf",
                     "-inf - (-inf)", "fully masked row", "row is fully masked", "rows fully masked",
                     "sees no key in the first", "no key in the first tile", "max is still -inf", "max stays -inf",
                     "m_new is -inf", "still minus infinity", "isinf(m_new", "isneginf(m_new", "safe max",
                     "finite reference", "0 * nan", "nan * 0"),
          title="Fix a sliding-window tiled attention that passes its author's tests",
          hint="its author tested decoding (one query per block) and windows wider than the sequence: build an input "
               "they did not try, find the first tile after which a row's running state is no longer a number, and "
               "ask what that row could see in that tile, and what the lesson's argument for the first tile assumed")
def _window_bug():
    """Tiled causal attention with a sliding window that must visit only the key blocks inside the band."""
    gen = torch.Generator().manual_seed(12)
    cases = []
    for name, (t, d, window, bq, bk) in {
        "T=40, window 8, blocks 8 x 8": (40, 8, 8, 8, 8),
        "T=37, window 5, blocks 8 x 4": (37, 8, 5, 8, 4),
        "T=50, window 12, blocks 16 x 8": (50, 16, 12, 16, 8),
        "T=23, window 1, blocks 4 x 4": (23, 8, 1, 4, 4),
        "T=30, window 100 (wider than T), blocks 8 x 8": (30, 8, 100, 8, 8),
    }.items():
        q, k, v = (torch.randn(2, t, d, generator=gen, dtype=torch.float64) for _ in range(3))
        expected = scaled_dot_product_attention(q, k, v, window_mask(t, window))
        cases.append(Case(name, (q, k, v, window, bq, bk), expected=expected, rtol=1e-7, atol=1e-9))
    return cases


# ----------------------------------------------------------------------------- 3. predict: the backward's traffic


def _counted_backward(seq_len: int, head_dim: int, block_q: int, block_k: int, is_causal: bool,
                      window: int | None) -> tuple[int, int]:
    x = torch.zeros(1, 1, seq_len, head_dim)  # (B, H, N, d): the values do not change what the loop loads
    counter = TrafficCounter()
    flash_attention_backward(x, x, x, x, torch.zeros(1, 1, seq_len), x, is_causal=is_causal, window=window,
                             block_q=block_q, block_k=block_k, traffic=counter)
    return counter.total_reads, counter.total_writes


def hbm_backward_reference(seq_len: int, head_dim: int, block_q: int, block_k: int, is_causal: bool,
                           window: int | None = None) -> tuple[int, int]:
    """The checker's reference: (reads, writes) in elements of the tiled backward, one head, counted by running the
    package's loop on zeros with a `TrafficCounter` (the package has no formula for it: that is the exercise).

    Every load and store the loop reports is a number of rows times d or times 1, so each count is affine in d: it
    is counted at d = 1 and d = 2 (cheap tiles, the same tile grid) and extended to `head_dim` exactly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny tiles: threads only add contention (10x slower on a busy machine)
    try:
        one, two = (_counted_backward(seq_len, dim, block_q, block_k, is_causal, window) for dim in (1, 2))
    finally:
        torch.set_num_threads(threads)
    return tuple(a + (b - a) * (head_dim - 1) for a, b in zip(one, two))


@exercise("09-predict-hbm", "hbm_prediction", points=2, category="predict",
          parts=("reads", "writes"),
          forbid=("attncourse.flash_io.hbm_traffic_flash", "attncourse.flash_io.hbm_traffic_fa2",
                  "attncourse.flash_io.hbm_traffic_standard_backward",
                  "attncourse.flash_io.flash_block_sizes", "attncourse.flash_io.hbm_traffic_standard",
                  "attncourse.flash_io.theorem2_bound", "attncourse.flash_io.Band",
                  "attncourse.flash.flash_attention_backward",
                  "attncourse.classroom.checks.ch09.hbm_backward_reference"),
          allow=(), ops=("torch",),
          prop_doc="the prediction is two counts in plain integers, written as a function of (N, d, B_q, B_k, causal, "
                   "window) so that the instrumented loop cannot stand in for it (the package has no formula for "
                   "the backward's traffic, and the expected counts are the loop's own, counted on zeros): equal "
                   "counts on every configuration, the exercise's and drawn ones whose N is not a multiple of either "
                   "block and whose blocks differ, with no mask, the causal mask and causal windows, are the skill",
          hint="take each tensor in section 4's gradient formulas and ask which block it belongs to (the key block "
               "the outer loop holds on chip, or the query block a tile visits) and, for each result, which loop "
               "owns it; then count the query rows each key block visits under the mask (the first on the block "
               "grid, the last the one that still sees a key of the block), partial blocks included, and "
               "everything the loops need before they can start")
def _predict_hbm():
    """Predict the HBM elements read and written by the tiled backward (key blocks outside), as a function of
    (seq_len N, head_dim d, block_q, block_k, is_causal, window)."""
    gen = torch.Generator().manual_seed(13)  # four more configurations, drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    configs = [tuple(HBM_QUESTION.values()), tuple(HBM_QUESTION_WINDOW.values())]
    for causal, windowed in ((False, False), (True, False), (True, True), (True, True)):
        d = 16 * pick(1, 8)
        block_q, block_k = 16 * pick(2, 8), 16 * pick(2, 8)
        while block_k == block_q:
            block_k = 16 * pick(2, 8)
        n = pick(300, 1500)
        while n % block_q == 0 or n % block_k == 0:
            n += 1
        window = None
        if windowed:  # a window neither block divides, wider or narrower than the blocks
            window = pick(3, 400)
            while window % block_q == 0 or window % block_k == 0:
                window += 1
        configs.append((n, d, block_q, block_k, causal, window))
    return [Case(f"(reads, writes) of the backward for N={n}, d={d}, B_q={bq}, B_k={bk}, "
                 f"{('causal, window ' + str(w) if w else 'causal') if c else 'no mask'}", (n, d, bq, bk, c, w),
                 expected=hbm_backward_reference(n, d, bq, bk, c, w), compare="equal")
            for n, d, bq, bk, c, w in configs]


# ----------------------------------------------------------------------------- 4. experiment: bfloat16 error


def _errors_close(got, expected):
    if not (isinstance(got, (tuple, list)) and len(got) == 3 and all(isinstance(x, float) for x in got)):
        return f"expected a tuple of three Python floats, got {got!r}"
    errors, band = expected
    # the first two are measured on outputs rounded to bfloat16 once, which is what sets their largest error: the same
    # measurement gives the same number; the all-bfloat16 formula rounds wherever the learner's order of operations
    # does, hence a band over the legitimate orders
    for name, g, e, tol in zip(("the tiled error", "the untiled float32 error"), got, errors, (1e-4, 1e-3)):
        if not abs(g - e) <= tol * e:
            return (f"{name} is {g:.3g}, more than {tol:g} (relative) away from what the same measurement gives here: "
                    "check the reference, the precision each method computes in, and the mask")
    return all_bf16_refusal(got[2], band)


@exercise("09-bf16-error", "bf16_errors_measured", points=2, category="experiment",
          allow=("attncourse.flash.flash_attention", "attncourse.sdpa.scaled_dot_product_attention"),
          hint="the exact attention of the rounded inputs is the float64 one; the untiled method at the tiled "
               "kernel's precision does its arithmetic in float32 and rounds once, at the end, as the kernel "
               "does; the third stays in bfloat16 at every step, so no library attention function for it "
               "(they compute in float32 inside)")
def _bf16_error():
    """Measure the bfloat16 error of the tiled attention, of the untiled one at the same precision, and of the
    untiled one written in bfloat16, on inputs the check draws."""
    gen = torch.Generator().manual_seed(29)
    cases = []
    for t, scale in ((64, 1.0), (300, 2.0), (200, 2.5), (150, 0.5), (64, 3.0)):
        q, k, v = ((scale * torch.randn(1, 2, t, 32, generator=gen, dtype=torch.float64)).to(torch.bfloat16)
                   for _ in range(3))
        cases.append(Case(f"T={t}, inputs of scale {scale:g}", (q, k, v),
                          expected=(bf16_errors(q, k, v), bf16_error_band(q, k, v)), compare=_errors_close))
    return cases


# exercises 5 (the tiled forward, FlashAttention-1's order) and 4b (the bf16 study): ch09_tiled.py
