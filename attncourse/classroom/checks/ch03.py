"""Checks for chapter 03, scaled dot-product attention (solutions/03_scaled_dot_product_attention.ipynb)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from attncourse.sdpa import scaled_dot_product_attention
from . import Case, edits, exercise, forbidden
from .predictions import whole

# Implement-it-yourself exercises may not call an attention that is already written: PyTorch's fused kernel or
# the course's oracle (under either name).
_FORBID = ("torch.nn.functional.scaled_dot_product_attention", "attncourse.scaled_dot_product_attention",
           "attncourse.sdpa.scaled_dot_product_attention")
_SOFTMAX = ("torch.softmax", "torch.nn.functional.softmax", "attncourse.safe_softmax", "attncourse.sdpa.safe_softmax")


def _qkv(gen: torch.Generator, q_shape, k_len: int, dv: int | None = None, dtype=torch.float64):
    *lead, _, d = q_shape
    dv = d if dv is None else dv
    q = torch.randn(*q_shape, generator=gen, dtype=dtype)
    k = torch.randn(*lead, k_len, d, generator=gen, dtype=dtype)
    v = torch.randn(*lead, k_len, dv, generator=gen, dtype=dtype)
    return q, k, v


# ----------------------------------------------------------------------------- 1. NumPy alone


def _has_scipy() -> bool:
    import importlib.util

    return importlib.util.find_spec("scipy") is not None


def _numpy_through_torch(Q, K, V):
    """A right answer that hands the work to the course's oracle: must be refused."""
    out, w = scaled_dot_product_attention(*(torch.from_numpy(x) for x in (Q, K, V)), return_weights=True)
    return out.numpy(), w.numpy()


def _numpy_through_fused(Q, K, V):
    """A right answer built on PyTorch's softmax: must be refused."""
    q, k, v = (torch.from_numpy(x) for x in (Q, K, V))
    w = torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1)
    return (w @ v).numpy(), w.numpy()


def _numpy_through_aten_math(Q, K, V):
    """PyTorch's math attention under its ATen name, handed back as NumPy: must be refused."""
    q, k, v = (torch.from_numpy(x) for x in (Q, K, V))
    out, w = torch.ops.aten._scaled_dot_product_attention_math(q, k, v)
    return out.numpy(), w.numpy()


def _numpy_through_log_softmax(Q, K, V):
    """A softmax spelled as exp(log_softmax) in PyTorch: must be refused (any PyTorch operation is)."""
    w = torch.log_softmax(torch.from_numpy(Q @ K.T / np.sqrt(Q.shape[1])), dim=-1).exp().numpy()
    return w @ V, w


def _numpy_through_scipy(Q, K, V):
    """SciPy's softmax: must be refused."""
    from scipy.special import softmax

    w = softmax(Q @ K.T / np.sqrt(Q.shape[1]), axis=-1)
    return w @ V, w


@exercise("03-sdpa-numpy", "attention_numpy", points=2, numpy=True, category="implement",
          forbid=_FORBID + _SOFTMAX, allow=(), ops=("torch",),
          shortcuts=(_numpy_through_torch, _numpy_through_fused, _numpy_through_aten_math,
                     _numpy_through_log_softmax) + ((_numpy_through_scipy,) if _has_scipy() else ()),
          prop_doc="output equality is the property: the attention computed from the arrays, with no PyTorch "
                   "operation at all (the guard refuses every one); one case puts a row's scores near +20,000 and "
                   "another's near -20,000, beyond the range of any floating-point type NumPy has (long double "
                   "included), so exponentials of the raw scores fail it in every width; what passes is a softmax "
                   "that subtracts from each row, before exponentiating, a value of the row's own size: its maximum "
                   "(the lesson's way) or its log-sum-exp computed stably (np.logaddexp makes that shift inside)",
          hint="compare every query with every key, scale so that the scores' spread does not grow with the "
               "width, and turn each query's row into a distribution over the keys; shift each row by its own "
               "largest score before exponentiating, so that nothing overflows")
def _sdpa_numpy():
    """Scaled dot-product attention in NumPy alone, on 2-D (T, d) inputs."""
    gen = torch.Generator().manual_seed(3)
    cases = []
    for name, (tq, tk, d, dv) in {
        "the notes' (4, 8) inputs": (4, 4, 8, 8),
        "more keys than queries (3 x 5)": (3, 5, 8, 8),
        "value dim differs from key dim": (4, 6, 8, 3),
        "large scores (d_k = 64, the largest scaled score near 2,000)": (2, 7, 64, 4),
        "huge scores (one row near +20,000, one near -20,000)": (2, 5, 16, 4),
    }.items():
        q, k, v = _qkv(gen, (tq, d), tk, dv)
        if "large" in name:  # exp overflows float64 from about 709: scaled so that an unshifted softmax does
            factor = (2000 / (q @ k.T / d ** 0.5).abs().max()).sqrt()
            q, k = q * factor, k * factor
        if "huge" in name:  # beyond long double too (exp overflows it near 11,356 and underflows near -11,400):
            # only a per-row shift survives (the maximum, or a stable log-sum-exp), whatever width exp is taken in
            q[:, 0] = torch.tensor([100.0, -100.0], dtype=q.dtype)
            k[:, 0] = 800.0 + torch.randn(tk, generator=gen, dtype=k.dtype)  # scores near +-100 * 800 / 4
        out, w = scaled_dot_product_attention(q, k, v, return_weights=True)
        cases.append(Case(name, (q, k, v), expected=(out, w), rtol=1e-6, atol=1e-9))
    return cases


# ----------------------------------------------------------------------------- 2. find the bug


def _bug_by_aten(q, k, v):
    """PyTorch's attention kernel under its ATen name: the fix without finding the bug, refused."""
    return torch.ops.aten.scaled_dot_product_attention(q, k, v)


def _bug_by_oracle(q, k, v):
    """The course's attention: refused."""
    return scaled_dot_product_attention(q, k, v)


# The given function exactly as the exercise notebook shows it (tests/test_edits.py compares the two).
BUGGY_ATTENTION = '''\
def attention_buggy(q, k, v):
    inv_scale = q.shape[-1] ** -0.5
    weights = (inv_scale * q @ k.T).softmax(dim=-1)
    return weights @ v
'''
FIX_ATTENTION = edits.SmallEdit(BUGGY_ATTENTION, most=12, lines=(3,),
                                names=("torch", "mT", "transpose", "swapaxes", "swapdims", "movedim"))


def _rewrite_lesson_cell(q, k, v):
    """The lesson's own attention, pasted: right values without reading the given code, refused."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., Tq, Tk)
    return torch.softmax(scores, dim=-1) @ v                    # (..., Tq, Dv)


@exercise("03-find-the-bug-1", "attention_fixed", points=2, category="bug", forbid=_FORBID,
          aliases=("03-batched-attention-bug",),
          bug_words=("mT", "reverses all", "reverses every", "reverse all", "reverses the", "reversed", "all four dims",
                     "all four axes", "every axis is swapped", "all axes", "all dims", "all dimensions",
                     "only the last two", "last two axes", "last two dims", "last two dimensions", "swapaxes",
                     "shape reversed", "permutedims", "deprecated"),
          allow=(), ops=("attention",), shortcuts=(_bug_by_aten, _bug_by_oracle),
          prop=edits.prop(FIX_ATTENTION, "`attention_fixed`"), trace=False, breakers=(_rewrite_lesson_cell,),
          prop_doc="the diagnosis: the right values for inputs of every rank and size (2-D, Tq != Tk, every axis of "
                   "one size), from the given function with a small edit where it is wrong",
          hint="run it on each input of the cell and print the shape of every intermediate: where does one first "
               "differ from what the formula needs?")
def _batched_bug():
    """Find and fix the bug in a colleague's attention."""
    gen = torch.Generator().manual_seed(4)
    cases = []
    for name, (shape, tk) in {
        "square (1, 2, 4, 8)": ((1, 2, 4, 8), 4),
        "Tq != Tk (2, 3, 5, 16) over 9 keys": ((2, 3, 5, 16), 9),
        "every axis the same size (4, 4, 4, 4)": ((4, 4, 4, 4), 4),
        "a single query (1, 1, 1, 4) over 6 keys": ((1, 1, 1, 4), 6),
        "2-D (6, 8) over 5 keys": ((6, 8), 5),
    }.items():
        q, k, v = _qkv(gen, shape, tk)
        cases.append(Case(name, (q, k, v), expected=scaled_dot_product_attention(q, k, v)))
    return cases


# ----------------------------------------------------------------------------- 3. predict


PREDICT_SHAPES = ((2, 4, 5, 16), (2, 1, 7, 16), (2, 1, 7, 8), (2, 1, 1, 7))  # q, k, v, mask: the exercise's


def measured_attention_shapes(q_shape, k_shape, v_shape, mask_shape):
    """(scores, weights, output) shapes, measured by running the course's attention on zeros of these shapes."""
    q, k, v = torch.zeros(q_shape), torch.zeros(k_shape), torch.zeros(v_shape)
    keep = torch.ones(mask_shape, dtype=torch.bool)
    out, w = scaled_dot_product_attention(q, k, v, keep, return_weights=True)
    scores = q @ k.transpose(-2, -1)
    return tuple(scores.shape), tuple(w.shape), tuple(out.shape)


@exercise("03-predict-shapes", "predicted_shapes", points=1, category="predict",
          parts=("scores", "weights", "output"),
          forbid=(*_FORBID, "torch.broadcast_shapes", "torch.broadcast_tensors"),
          allow=(), ops=("torch",),
          prop_doc="the prediction is a rule on plain tuples of ints, a function of the four input shapes, judged on "
                   "the exercise's shapes and on shapes drawn from a seed (the grader draws others, with size-1 axes "
                   "in different places): running attention, a matrix product or PyTorch's broadcasting helper "
                   "inside it is refused, and a table of one configuration's shapes fails the drawn ones",
          hint="write each shape axis by axis, and for every axis ask where it comes from: which leading axes do "
               "q and k share, and what does a matrix product do with leading axes that differ (one of them of "
               "size 1)? Which two axes does a score pair up? Can the mask add or change any? And what decides the "
               "output's last axis?")
def _predict_shapes():
    """Predict, as a function of (q_shape, k_shape, v_shape, mask_shape), the shapes of the scores, the weights and
    the output of scaled dot-product attention."""
    gen = torch.Generator().manual_seed(31)  # three more shape sets, drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    configs = [PREDICT_SHAPES]
    for _ in range(3):
        lead = (pick(2, 4), pick(2, 6))
        tq, tk, d, dv = pick(1, 9), pick(2, 9), 4 * pick(1, 6), 4 * pick(1, 6)
        one = lambda: tuple(n if pick(0, 1) else 1 for n in lead)  # noqa: E731  each axis full or of size 1
        q_lead, k_lead = one(), one()
        m_lead = tuple(max(a, b) if pick(0, 1) else 1 for a, b in zip(q_lead, k_lead))  # broadcasts to the scores
        configs.append(((*q_lead, tq, d), (*k_lead, tk, d), (*k_lead, tk, dv), (*m_lead, tq if pick(0, 1) else 1, tk)))
    return [Case(f"shapes of (scores, weights, output) for q {q}, k {k}, v {v}, mask {m}", (q, k, v, m),
                 expected=measured_attention_shapes(q, k, v, m),
                 compare=whole("a tuple of three shapes (scores, weights, output)"))
            for q, k, v, m in configs]


# ----------------------------------------------------------------------------- 4. masked attention, no NaN


def _masked_by_oracle(q, k, v, keep):
    return scaled_dot_product_attention(q, k, v, keep)


def _masked_by_fused(q, k, v, keep):
    return F.scaled_dot_product_attention(q, k, v, keep)  # zeros on fully masked rows since PyTorch 2.5


def _masked_by_aten(q, k, v, keep):
    return torch.ops.aten.scaled_dot_product_attention(q, k, v, keep)


def _masked_by_safe_softmax(q, k, v, keep):
    s = (q.float() @ k.float().mT) * q.shape[-1] ** -0.5
    return (torch._safe_softmax(s.masked_fill(~keep, float("-inf")), -1).to(v.dtype)) @ v


def _masked_by_aten_safe_softmax(q, k, v, keep):
    s = (q.float() @ k.float().mT) * q.shape[-1] ** -0.5
    return (torch.ops.aten._safe_softmax(s.masked_fill(~keep, float("-inf")), -1).to(v.dtype)) @ v


def _masked_by_log_softmax(q, k, v, keep):
    s = (q.float() @ k.float().mT) * q.shape[-1] ** -0.5
    return (torch.log_softmax(s.masked_fill(~keep, float("-inf")), -1).exp().nan_to_num(0.0).to(v.dtype)) @ v


def _masked_by_one_pass(q, k, v, keep):
    from attncourse.online_softmax import one_pass_softmax

    s = (q.float() @ k.float().mT) * q.shape[-1] ** -0.5
    return one_pass_softmax(s.masked_fill(~keep, float("-inf"))).nan_to_num(0.0).to(v.dtype) @ v


@exercise("03-masked-attention", "masked_attention", points=3, category="implement",
          forbid=_FORBID + _SOFTMAX, allow=(), ops=("attention", "softmax", "logsumexp"),
          shortcuts=(_masked_by_oracle, _masked_by_fused, _masked_by_aten, _masked_by_safe_softmax,
                     _masked_by_aten_safe_softmax, _masked_by_log_softmax, _masked_by_one_pass),
          prop_doc="output equality is the property, gradients included: exact zeros for blocked keys and fully "
                   "blocked rows, the gradients of q, k and v of one case finite and equal to PyTorch's (a NaN-free "
                   "forward whose backward is NaN fails), finite in float16 also where scores pass 65,504, "
                   "wherever the allowed scores lie (two cases put one head's allowed scores below -1e4 in "
                   "float16 and below -1e9 in float32, so a fill that is only large next to scores near 0 fails); "
                   "the guard refuses every softmax and attention kernel, so the softmax is the learner's",
          hint="blocked keys must get a weight of exactly zero; follow a row whose every key is blocked through "
               "your softmax, step by step, and see where it becomes NaN; half precision needs a wider softmax")
def _masked():
    """Attention under a boolean keep-mask that returns zeros for fully masked query rows."""
    gen = torch.Generator().manual_seed(5)
    cases = []
    q, k, v = _qkv(gen, (2, 2, 4, 8), 6)
    lengths = torch.tensor([6, 3])
    keep = (torch.arange(6) < lengths[:, None])[:, None, None, :]  # (B, 1, 1, Tk) padding mask
    cases.append(Case("padding mask, lengths [6, 3]", (q, k, v, keep),
                      expected=scaled_dot_product_attention(q, k, v, keep)))
    keep = torch.ones(4, 6, dtype=torch.bool).tril(diagonal=2)
    cases.append(Case("causal-like (4, 6) mask", (q, k, v, keep),
                      expected=scaled_dot_product_attention(q, k, v, keep)))
    keep = torch.ones(2, 2, 4, 6, dtype=torch.bool)
    keep[0, 1, 2] = False
    keep[1, :, 0] = False
    cases.append(Case("fully masked rows give zeros, not NaN", (q, k, v, keep),
                      expected=scaled_dot_product_attention(q, k, v, keep)))
    q16, k16, v16 = (x.to(torch.float16) for x in (q, k, v))
    cases.append(Case("float16 with a fully masked row", (q16, k16, v16, keep),
                      expected=scaled_dot_product_attention(q16, k16, v16, keep), rtol=2e-3, atol=2e-3))
    # real scores can sit anywhere: a fill that is only "very negative" (-1e4 in float16, -1e9 in float32) lends
    # the blocked keys the weight when the allowed scores of a row lie below it
    for dtype, (big_q, big_k), fill in ((torch.float16, (200.0, -200.0), "-1e4"),
                                         (torch.float32, (2e5, -2e4), "-1e9")):
        qf, kf, vf = (x.clone() for x in (q, k, v))
        qf[0, 0, :, 0] = big_q  # head 0 of sequence 0: every query's scores near big_q * big_k / sqrt(8)
        kf[0, 0, :, 0] = big_k + torch.randn(6, generator=gen, dtype=torch.float64) * abs(big_k) / 400
        qf, kf, vf = (x.to(dtype) for x in (qf, kf, vf))
        keep = torch.ones(2, 2, 4, 6, dtype=torch.bool)
        keep[0, 0, :, 3:] = False
        keep[1, 1, 3] = False
        lowest = float((qf[0, 0].float() @ kf[0, 0].float().mT).max() / 8**0.5)
        cases.append(Case(f"{str(dtype).split('.')[1]}: one head's allowed scores all below {lowest:.3g} "
                          f"(a fill of {fill} is not below them)", (qf, kf, vf, keep),
                          expected=scaled_dot_product_attention(qf, kf, vf, keep),
                          rtol=2e-3 if dtype == torch.float16 else 1e-5, atol=2e-3 if dtype == torch.float16 else 1e-6))
    # float16 scores past 65,504 even after scaling: a float16 product or softmax gives NaN (the tolerance is
    # float32's rounding near 1e5: scaling q before the product is 1.6e-2 off). Scores near 400 * 700 / sqrt(8):
    qf, kf, vf, keep = q.to(torch.float16), k.to(torch.float16), v.to(torch.float16), torch.ones(2, 2, 4, 6).bool()
    qf[0, 1, :, 0], kf[0, 1, :, 0], keep[0, 1, :, 4:], keep[1, 0, 2] = 400.0, 700.0, False, False  # copies of q, k
    top = float((qf[0, 1].float() @ kf[0, 1].float().mT).max() / 8**0.5)
    cases.append(Case(f"float16: one head's scores near {top:,.0f}, above float16's largest finite number (65,504)",
                      (qf, kf, vf, keep), expected=scaled_dot_product_attention(qf, kf, vf, keep), rtol=3e-2, atol=3e-2))
    # training runs the backward pass too: a fully masked row must give finite gradients (zeros), not NaN, and
    # the others PyTorch's. The check hands in q, k, v that require gradients and back-propagates one fixed
    # upstream gradient through the answer (forbidden.with_gradients), inside the guard.
    keep = torch.ones(2, 2, 4, 6, dtype=torch.bool)
    keep[0, 1, 2] = False
    keep[1, :, 0] = False
    keep[1, 0, 1, 4:] = False
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    cases.append(Case("the backward pass: gradients of q, k and v with fully masked rows (float64)",
                      (q, k, v, keep), kwargs={forbidden.BACKWARD: True},
                      expected=forbidden.with_gradients(scaled_dot_product_attention(qg, kg, vg, keep), [qg, kg, vg])))
    return cases


# ----------------------------------------------------------------------------- 5. experiment: Var(q . k)


def measure_dot_variance(d_k: int, std: float, n: int, seed: int) -> float:
    """The reference measurement: Var(q . k) over n pairs with N(0, std^2) entries, drawn from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d_k, generator=gen, dtype=torch.float64) * std
    k = torch.randn(n, d_k, generator=gen, dtype=torch.float64) * std
    return float((q * k).sum(-1).var())


def _within_sampling_error(args):
    d_k, std, n, _ = args
    theory = d_k * std**4
    rel_se = math.sqrt((2 + 6 / d_k) / n)  # relative standard error of a sample variance of q.k

    def rule(got, expected) -> str | None:
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
            return f"expected a finite float (the measured variance), got {type(got).__name__}"
        # the reference measured `expected` from its own draws; yours comes from your draws: both are estimates
        if abs(got - theory) > 6 * rel_se * theory or abs(got - expected) > 8 * rel_se * theory:
            return (f"d_k={d_k}, std={std}, n={n}: your measured variance is further from the reference "
                    f"measurement than sampling noise allows (about {100 * rel_se:.1f}% per estimate): check what "
                    "you draw and what you take the variance of")
        return None

    return rule


def _same_draws(args):
    """A small sample: the value depends on the very numbers drawn, so it must equal the check's own measurement
    from the same seed (no law predicts it; only measuring does)."""
    d_k, std, n, seed = args

    def rule(got, expected) -> str | None:
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
            return f"expected a finite float (the measured variance), got {type(got).__name__}"
        rel = abs(got - expected) / abs(expected)
        if rel > 1e-7:
            return (f"d_k={d_k}, std={std}, n={n}, seed={seed}: with so few pairs the variance is whatever these "
                    f"draws give, and yours is off by about {rel:.0%} from the check's own measurement of the same "
                    "draws: draw exactly as the exercise says (queries first, then keys, float64, from a generator "
                    "seeded with seed) and take the unbiased sample variance")
        return None

    return rule


SMALL = ((4, 1.5, 40, 5), (8, 0.7, 30, 6), (2, 3.0, 60, 7), (16, 1.0, 25, 8))  # no law gets these within 15%


@exercise("03-variance-experiment", "dot_product_variance", points=1, category="experiment", allow=(),
          hint="draw n queries and n keys with the given standard deviation from a generator seeded with seed, "
               "take each pair's dot product, and return the variance of those n numbers as a float")
def _variance():
    """Measure Var(q . k) for entries of standard deviation std, and see how it depends on d_k and std."""
    cases = []
    for args in ((16, 1.0, 20_000, 0), (64, 1.0, 20_000, 1), (256, 0.5, 20_000, 2), (8, 2.0, 20_000, 3)):
        cases.append(Case(f"d_k={args[0]}, std={args[1]}, n={args[2]}, seed={args[3]}", args,
                          expected=measure_dot_variance(*args), compare=_within_sampling_error(args)))
    for args in SMALL:
        cases.append(Case(f"a small sample: d_k={args[0]}, std={args[1]}, n={args[2]}, seed={args[3]}", args,
                          expected=measure_dot_variance(*args), compare=_same_draws(args)))
    return cases


FIT_STDS, FIT_WIDTHS, FIT_N = (0.25, 0.5, 1.0, 2.0, 4.0), (16, 64, 256, 1024), 4_000


def reference_exponents(seed: int) -> tuple[float, float]:
    """The check's own fit: least-squares slopes of log Var(q . k) against log std (at d_k = 64) and against log d_k
    (at std 1), the i-th point of each measured with seed + i and seed + 50 + i."""
    def slope(xs, ys):
        lx, ly = torch.tensor(xs, dtype=torch.float64).log(), torch.tensor(ys, dtype=torch.float64).log()
        return float(((lx - lx.mean()) * (ly - ly.mean())).sum() / (lx - lx.mean()).pow(2).sum())
    by_std = [measure_dot_variance(64, s, FIT_N, seed + i) for i, s in enumerate(FIT_STDS)]
    return slope(FIT_STDS, by_std), slope(FIT_WIDTHS, [measure_dot_variance(w, 1.0, FIT_N, seed + 50 + i)
                                                       for i, w in enumerate(FIT_WIDTHS)])


def _same_fit(seed):
    def rule(got, expected) -> str | None:
        if not (isinstance(got, (tuple, list)) and len(got) == 2
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in got)):
            return f"expected two finite floats (std_exponent, dk_exponent), got {type(got).__name__}"
        if max(abs(g - e) for g, e in zip(got, expected)) > 1e-6:
            return (f"seed={seed}: these are not the exponents the draws of this seed give: measure every point with "
                    "your dot_product_variance and its own seed (seed + i for the i-th std, seed + 50 + i for the "
                    "i-th d_k, n = 4000) and fit log(variance) against log(std) and log(d_k) by least squares")
        return None
    return rule


@exercise("03-variance-fit", "fit_exponents", points=1, category="experiment", allow=(),
          hint="which seed does each of the nine points get, and what straight line through the log-log points "
               "gives the exponent?")
def _variance_fit():
    """Fit the exponents of std and d_k from seeded measurements: typed exponents are not this seed's fit."""
    return [Case(f"seed={seed}", (seed,), expected=reference_exponents(seed), compare=_same_fit(seed))
            for seed in (0, 300, 1234)]
