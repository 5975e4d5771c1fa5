"""Checks for chapter 08, online softmax (solutions/08_online_softmax.ipynb).

Expected values come from the package (:mod:`attncourse.online_softmax`) or from PyTorch's own reductions in
float64, never from a copy of the solution.
"""

from __future__ import annotations

import functools
import math
import re

import torch

from attncourse.online_softmax import (AttentionState, SoftmaxState, finalize_attention_state, merge_attention_states,
                                       merge_softmax_states, online_softmax_trace, softmax_state)
from . import Case, edits, exercise
from .ch08_routes import (_shortcut_merge_fold, _shortcut_merge_lse, _breaker_merge_pairwise, _shortcut_log_softmax, _shortcut_logsumexp, _breaker_buffer_three_pass, _breaker_rewrite_at_each_chunk, _breaker_buffer_unit_axis, _breaker_buffer_two_pass, FIX_MERGE, _breaker_rewrite_merge, _REDUCTIONS, _statistics)  # noqa: F401

NEG_INF = float("-inf")
PREDICT_ROW = (2.0, 1.0, 4.0, 4.0, 3.0)  # the row of exercise 4, one entry per step


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0, dtype=torch.float64) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


# ----------------------------------------------------------------------------- 1. merge many states at once


_VIEWS = re.compile(r"^(view|_unsafe_view|reshape|expand|permute|transpose|t|slice|select|unsqueeze|squeeze|alias|"
                    r"detach|lift_fresh|as_strided|split|split_with_sizes|unbind|chunk|narrow|diagonal|unfold|"
                    r"empty|empty_like|empty_strided|zeros|zeros_like|ones|ones_like|full|full_like|new_empty|"
                    r"new_zeros|new_full|new_ones|arange|scalar_tensor|_local_scalar_dense|item|is_nonzero|"
                    r"sym_size|sym_stride|sym_numel|sym_storage_offset|_has_compatible_shallow_copy_type)$")


def _op(name: str) -> str:
    return name.split("::")[-1].split(".")[0]


def _work(ops) -> int:
    """The operators that compute (views, allocations and the guard's own stream bookkeeping aside)."""
    return sum(not _VIEWS.match(_op(name)) and _op(name) != "fill_" for name, *_ in ops)


def _elements(ops) -> int:
    """The tensor entries the computing operators read (views, allocations and the stream's NaN fill aside)."""
    total = 0
    for name, _launch, _helper, tensors in ops:
        if not _VIEWS.match(_op(name)) and _op(name) != "fill_":
            for _label, _offset, shape, _stride in tensors:
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total


def _merge_in_one_step(runs) -> str | None:
    by_k = {}
    for run in runs:
        by_k.setdefault(int(run.case.args[0].shape[0]), []).append(_work(run.trace["ops"]))
    small, large = min(by_k), max(by_k)
    if max(by_k[large]) > max(by_k[small]) + 2:
        return (f"your code runs {max(by_k[large])} operators for {large} chunk states and {max(by_k[small])} for "
                f"{small}: it merges the states one after another; merge all K of them in one step")
    return None


@exercise("08-merge-many", "merge_many", points=2, category="implement",
          forbid=("torch.logsumexp", "torch.logaddexp", "attncourse.online_softmax.merge_softmax_states",
                  "attncourse.online_softmax.merge_attention_states"),
          shortcuts=(_shortcut_merge_fold, _shortcut_merge_lse), allow=(), ops=("logsumexp", "softmax"),
          prop=_merge_in_one_step, breakers=(_breaker_merge_pairwise,),
          prop_doc="the K states are merged in one step: the operator count does not grow with K (K = 1 to 6)",
          title="Merge K chunk states in one step",
          hint="the merged maximum is the largest of the K maxima; each chunk's sum was taken relative to its own "
               "maximum, so bring every one to the merged maximum before adding. Chunks that are empty must drop "
               "out, and a row where every chunk is empty must come out as the empty state, without NaN: what can "
               "you subtract where the merged maximum is minus infinity?")
def _merge_many():
    """Merge K stacked (max, sum) states (K, ...) into the state of all K chunks together."""
    gen = torch.Generator().manual_seed(8)
    cases = []

    def add(name, xs, **tol):
        states = [softmax_state(x) for x in xs]  # each (m, l) of shape (R,)
        m_all, l_all = torch.stack([s.m for s in states]), torch.stack([s.l for s in states])  # (K, R)
        whole = softmax_state(torch.cat(xs, dim=-1))  # the state of the concatenated row: the definition
        cases.append(Case(name, (m_all, l_all), expected=(whole.m, whole.l), **tol))

    add("3 chunks of a (5, .) block", [_randn(gen, 5, n, scale=3) for n in (7, 4, 9)])
    add("one chunk (K = 1) is returned unchanged", [_randn(gen, 4, 6)])
    xs = [_randn(gen, 4, 5) for _ in range(6)]
    xs[2][:] = NEG_INF  # a fully masked chunk
    xs[0][1] = NEG_INF  # row 1 empty in chunk 0 ...
    add("a fully masked chunk and a row empty in some chunks", xs)
    add("every chunk empty in every row: (-inf, 0), not NaN", [torch.full((3, 4), NEG_INF, dtype=torch.float64)] * 4)
    add("maxima near 1e4 in float32 (exp(m) would overflow)",
        [_randn(gen, 3, 5, dtype=torch.float32) * 100 + 1e4 for _ in range(5)], rtol=1e-5, atol=1e-5)
    # 2 x 4 x 160 = 1,280 numbers in: more than the guard lets an answer read out into plain Python
    add("4 chunks of a (160, .) block: too many states to read out and loop over",
        [_randn(gen, 160, n, scale=3) for n in (5, 8, 3, 6)])
    return cases


# ----------------------------------------------------------------------------- 2. one-pass log-softmax


def _log_softmax_reference(x: torch.Tensor) -> torch.Tensor:
    out = torch.log_softmax(x, dim=-1)
    return torch.where(torch.isneginf(x).all(dim=-1, keepdim=True), torch.full_like(x, NEG_INF), out)


_ENTRIES_PER_ELEMENT = 40  # one pass reads about 10-25 entries per entry of x (measured: tests/test_ch08_checks.py)


def _reduction_widths(run) -> list[int]:
    """The width of every reduction the answer ran on one case: its input's last axis, or the entries of a row it
    holds, whichever is larger (a whole row hidden behind a trailing unit axis, or in another axis, is still a
    whole row read at once)."""
    x = run.case.args[0]
    rows = max(x.numel() // max(x.shape[-1], 1), 1)
    return [max((max(shape[-1], math.prod(shape) // rows) for _l, _o, shape, _s in tensors if len(shape)), default=0)
            for name, _launch, _helper, tensors in run.trace["ops"] if _REDUCTIONS.match(_op(name).lstrip("_"))]


def _reads_once(runs) -> str | None:
    """One pass over a one-shot stream with a state of fixed size per row: no reduction over more than a chunk's
    entries (a state kept per chunk and merged at the end is told so), and, once the stream is exhausted, the row's
    normaliser is finished from that fixed state: the operators that compute statistics (reductions, exp, log,
    max) after the last chunk do not grow with the number of chunks. Applying the finished log-sum-exp to what was
    kept may take one operator per chunk or one over the concatenation: the same data flow, both pass."""
    for run in runs:  # a reduction over one value per chunk (fewer than the entries): per-chunk states, merged
        x, chunk_size = run.case.args
        n_chunks = -(-x.shape[-1] // chunk_size)
        if run.trace.get("chunks", 0) == n_chunks and any(
                chunk_size < wide <= n_chunks < x.shape[-1] for wide in _reduction_widths(run)):
            return (f"case '{run.case.name}': your code reduces over {n_chunks} values of a row at once, one per "
                    "chunk: it kept a state per chunk and merged them after the stream. That reads each entry once "
                    "(it is exercise 1's merge, the split-K form), but the state grows with the number of chunks; "
                    "this exercise asks for a state of fixed size per row, folded into as each chunk arrives")
    tails = {}
    for run in runs:
        x, chunk_size = run.case.args
        n = x.shape[-1]
        expected_chunks = -(-n // chunk_size)
        if run.trace.get("chunks", 0) != expected_chunks:
            return f"case '{run.case.name}': your code took {run.trace.get('chunks', 0)} of the {expected_chunks} chunks"
        ops = run.trace["ops"]
        wide = max(_reduction_widths(run), default=0)
        if wide > chunk_size:
            return (f"case '{run.case.name}': your code reduces over {wide} values of a row at once, more than a "
                    f"chunk ({chunk_size}): it kept the chunks (or a value per entry or per chunk) and went over "
                    "them again after the stream; keep a state of fixed size per row and fold each chunk into it "
                    "while you hold it")
        # the stream ends where the guard overwrites its last chunk with NaN (the first fill_ of that chunk: a label
        # follows a storage, and freed memory can come back under a new tensor)
        final = f"chunk {expected_chunks - 1}"
        end = next((i for i, (name, _l, _h, tensors) in enumerate(ops)
                    if _op(name) == "fill_" and tensors and tensors[0][0] == final), None)
        if end is None:
            end = max((i for i, (_n, _l, _h, tensors) in enumerate(ops) if any(t[0] == final for t in tensors)),
                      default=len(ops) - 1)
        tails[run.case.name] = (expected_chunks, _statistics(ops[end + 1:]))
        # what is already written is not rewritten at each growth of the max: on a row whose max grows at every
        # chunk, rewriting it reads about N^2 / (2C) entries per rewrite, against a few per entry for one pass
        per_entry = _elements(ops) / max(x.numel(), 1)
        if per_entry > _ENTRIES_PER_ELEMENT:
            return (f"case '{run.case.name}': your operators read {per_entry:.0f} tensor entries per entry of x "
                    f"({x.shape[-1]} entries a row in chunks of {chunk_size}), where one pass reads a few: what you "
                    "already wrote is rewritten (or copied) again as the stream goes on, about N^2/C entries; "
                    "write each chunk once and apply the row's correction once, after the stream")
    few = min(tails.values())
    many = max(tails.values())
    if many[1] > few[1] + 4:
        return (f"after the last chunk your code still computes statistics of the row ({many[1]} reductions, "
                f"exponentials, logarithms or maxima for {many[0]} chunks, {few[1]} for {few[0]}): it goes back "
                "over what it kept per chunk (the chunks themselves, or a state per chunk) to find the row's "
                "normaliser, a second pass; keep a state of fixed size per row, folded into as each chunk arrives, "
                "so that the normaliser is known when the stream ends")
    return None


@exercise("08-one-pass-log-softmax", "log_softmax_one_pass", points=3, category="implement",
          forbid=("torch.log_softmax", "torch.softmax", "torch.logsumexp",
                  "attncourse.online_softmax.one_pass_softmax", "attncourse.online_softmax.two_pass_softmax",
                  "attncourse.online_softmax.online_softmax_state"),
          shortcuts=(_shortcut_log_softmax, _shortcut_logsumexp), allow=(), ops=("softmax", "logsumexp"),
          stream=(0, -1, "arg1"), prop=_reads_once, breakers=(_breaker_buffer_three_pass, _breaker_buffer_unit_axis, _breaker_buffer_two_pass,
                                                               _breaker_rewrite_at_each_chunk),
          prop_doc="one pass over a one-shot stream of chunks with a state of fixed size per row: no reduction "
                   "wider than a chunk (a state kept per chunk and merged at the end is refused as such), the row's "
                   "normaliser finished from that state when the stream ends (the reductions, exponentials, "
                   "logarithms and maxima after the last chunk do not grow with the number of chunks; the final "
                   "subtraction may be one per chunk or one over the row), and a bounded number of entries read per "
                   "entry of the input (nothing already written is rewritten as the stream goes on)",
          title="A log-softmax that reads its input once",
          hint="keep the running maximum and sum as in the lesson; in log space the correction for a grown maximum "
               "is not a product but a subtraction, the same for every entry of the row, so corrections add up and "
               "can wait: write each chunk as you read it and apply the row's correction after the stream. A fully "
               "masked row gives minus infinity everywhere, never NaN")
def _one_pass_log():
    """Log-softmax over the last dim of a one-shot stream of chunks, read once."""
    gen = torch.Generator().manual_seed(9)
    cases = []

    def add(name, x, chunk_size, **tol):
        cases.append(Case(name, (x, chunk_size), expected=_log_softmax_reference(x), **tol))

    add("(3, 10) in chunks of 4 (4 does not divide 10)", _randn(gen, 3, 10, scale=2), 4)
    add("an increasing row in chunks of 1: the max grows at every step",
        torch.linspace(-3, 6, 10, dtype=torch.float64), 1)
    add("large entries (around 300) in float32: exp overflows unless shifted",
        _randn(gen, 2, 9, scale=50, dtype=torch.float32) + 300, 3, rtol=1e-5, atol=1e-4)
    add("a spread of 2000 within a row: tiny probabilities keep a finite log", _randn(gen, 2, 12, scale=600), 5)
    x = _randn(gen, 4, 8)
    x[0, :5] = NEG_INF
    x[1, ::2] = NEG_INF
    x[2] = NEG_INF
    add("-inf entries, a first chunk fully masked, and a fully masked row (-inf, not NaN)", x, 2)
    add("one chunk bigger than the row", _randn(gen, 2, 5), 50)
    rising = torch.linspace(-4.0, 20.0, 800, dtype=torch.float64).repeat(2, 1)
    rising[1] += _randn(gen, 800, scale=0.01).sort().values  # still increasing: the max grows at every chunk
    add("rows of 800 whose max grows at every chunk of 4", rising, 4)
    return cases


# ----------------------------------------------------------------------------- 3. find the bug: the split-KV merge


@exercise("08-find-the-bug-1", "merge_partial_fixed", points=2, category="bug", aliases=("08-merge-bug",),
          forbid=("attncourse.online_softmax.merge_attention_states", "torch.nn.functional.scaled_dot_product_attention"),
          allow=(), ops=("attention", "softmax", "logsumexp"),
          prop=edits.prop(FIX_MERGE, "`merge_partial_fixed`"), trace=False, breakers=(_breaker_rewrite_merge,),
          prop_doc="the diagnosis: equality of (m, l, acc) on every row (halves of several keys, one half dominant, "
                   "rows with no key in a half or in both), from the given merge with a small edit where it is wrong "
                   "(a merge written afresh from the lesson does not show the bug was found)",
          bug_words=("normalised output", "normalized output", "times l_a", "multiplied by l", "multiplies acc by l",
                     "weights acc by l", "extra factor of l", "factor of l", "l counted twice", "counts l twice",
                     "acc by l_a", "acc_a by l_a", "l_a * acc", "l_a*acc", "w_a * l_a", "weighted by l",
                     "the sum twice", "sum counted twice", "should not include l", "not include l"),
          title="Fix the merge of two partial attention results",
          hint="write out what acc_a holds in terms of the scores and values of its keys, relative to which maximum, "
               "then what the merged acc must hold relative to the merged maximum: which factor turns one into the "
               "other? Try it on two halves of one key each, then of two keys each")
def _merge_bug():
    """Fix a merge of two (m, l, acc) attention states (split-KV decoding) that is right only when each half's sum is 1."""
    gen = torch.Generator().manual_seed(10)
    cases = []

    def state(scores, value):
        m0 = torch.full(scores.shape[:-1], NEG_INF, dtype=torch.float64)
        from attncourse.online_softmax import online_attention_update

        return online_attention_update(AttentionState(m0, torch.zeros_like(m0),
                                                      torch.zeros(*m0.shape, value.shape[-1], dtype=torch.float64)),
                                       scores, value)

    def add(name, s_a, v_a, s_b, v_b):
        a, b = state(s_a, v_a), state(s_b, v_b)
        expected = tuple(merge_attention_states(a, b))
        whole = finalize_attention_state(state(torch.cat([s_a, s_b], -1), torch.cat([v_a, v_b], -2)))[0]
        merged = finalize_attention_state(merge_attention_states(a, b))[0]
        assert torch.allclose(merged, whole)  # the reference itself: merged halves = attention over all keys
        cases.append(Case(name, (*a, *b), expected=expected))

    tq, dv = 3, 5
    add("two halves of 4 keys, similar scores", _randn(gen, tq, 4), _randn(gen, 4, dv), _randn(gen, tq, 4),
        _randn(gen, 4, dv))
    add("the second half scores much higher (its max wins)", _randn(gen, tq, 4), _randn(gen, 4, dv),
        _randn(gen, tq, 6) + 5, _randn(gen, 6, dv))
    add("batched (2, 3) rows, the first half higher", _randn(gen, 2, tq, 5) + 3, _randn(gen, 2, 5, dv),
        _randn(gen, 2, tq, 2), _randn(gen, 2, 2, dv))
    s_b = _randn(gen, tq, 4)
    s_b[1] = NEG_INF  # row 1 sees nothing in the second half
    add("a row that sees no key in one half (no NaN)", _randn(gen, tq, 3), _randn(gen, 3, dv), s_b, _randn(gen, 4, dv))
    s_a, s_b = _randn(gen, 2, tq, 5), _randn(gen, 2, tq, 4)
    s_b[0, 1] = NEG_INF  # row 1 of batch 0 sees nothing in the second half ...
    s_a[1, 2] = s_b[1, 2] = NEG_INF  # ... row 2 of batch 1 sees no key at all: the empty state (-inf, 0, 0)
    add("a row that sees no key in either half: (-inf, 0, 0), not NaN", s_a, _randn(gen, 2, 5, dv), s_b,
        _randn(gen, 2, 4, dv))
    # (4, 16) rows, 2 x (2 + 16) numbers each = 2,304 in: more than the guard lets an answer read out
    add("batched (4, 16) rows of 16-wide values: too many to read out and loop over", _randn(gen, 4, 16, 6),
        _randn(gen, 4, 6, 16), _randn(gen, 4, 16, 5) + 1, _randn(gen, 4, 5, 16))
    return cases


# ----------------------------------------------------------------------------- 4. predict the trace


def rescale_trace_reference(row: tuple, chunk_size: int) -> tuple[list, list, list]:
    """The checker's reference, from the package's trace: (running_max, rescale, running_sum) after each chunk of
    `chunk_size` entries of `row` (a tuple of floats)."""
    t = online_softmax_trace(torch.tensor(row, dtype=torch.float64), chunk_size=chunk_size)
    return t["running_max"].tolist(), t["rescale"].tolist(), t["running_sum"].tolist()


@exercise("08-predict-rescale", "predicted", points=1, category="predict",
          parts=("running_max", "rescale", "running_sum"),
          forbid=("attncourse.online_softmax.online_softmax_trace", "attncourse.online_softmax.softmax_state",
                  "attncourse.online_softmax.online_softmax_state", "attncourse.online_softmax.merge_softmax_states"),
          allow=(), ops=("torch",),
          prop_doc="the prediction is the recurrence's values in plain Python floats, written as a function of the row "
                   "and the chunk size so that no package call (the package's trace, the checker's reference) can "
                   "stand in for it: equal traces (to 1e-3) on every row, the exercise's and drawn ones with ties, "
                   "drops and chunks of several entries, are the skill",
          hint="go one chunk at a time: the running maximum only ever grows; the factor applied to the old sum is "
               "1 whenever the maximum stays put (and 0 at the first step, where there is nothing to rescale); the "
               "sum shrinks by that factor, then gains every new entry's exponential relative to the current maximum")
def _predict():
    """Predict the running max, the rescale factors and the running sum of the online softmax, as a function of
    (row, chunk_size)."""
    gen = torch.Generator().manual_seed(84)  # three more rows, drawn (a salted grader draws others)
    configs = [(PREDICT_ROW, 1)]
    for chunk in (1, 2, 3):
        n = int(torch.randint(5, 10, (1,), generator=gen))
        row = tuple(float(v) for v in torch.randint(-2, 7, (n,), generator=gen).tolist())  # small ints: ties, drops
        configs.append((row, chunk))
    return [Case(f"(running_max, rescale, running_sum) over {row} in chunks of {chunk}", (row, chunk),
                 expected=rescale_trace_reference(row, chunk), rtol=1e-3, atol=1e-3) for row, chunk in configs]


# ----------------------------------------------------------------------------- 5. experiment: what rescaling costs


def rescale_cost(row: torch.Tensor, chunk_size: int) -> tuple[int, int]:
    """Reference: (chunks after the first where the running max grows, elements already written that the one-pass
    softmax rescales then) for a 1-D `row` read in chunks of `chunk_size`.

    Read off the course's trace of the online recurrence, which the answer may not call: a transcription of this
    reference is refused, so the running maximum has to be the learner's own (review 11 passed a hand-edited copy of
    the earlier 10-line loop)."""
    running = online_softmax_trace(row.double(), chunk_size)["running_max"]  # (chunks,) max after each chunk
    grew = running[1:] > running[:-1]  # (chunks - 1,) chunk j >= 1 raised it (a tie does not)
    starts = torch.arange(1, running.shape[0]) * chunk_size  # (chunks - 1,) elements written before chunk j
    return int(grew.sum()), int(starts[grew].sum())


def _rescale_rows():
    """Rows the check draws: i.i.d. scores, scores drifting upwards, a falling row, rows of small integers (ties with
    the running max, which do not rescale), float32 and float64; lengths not multiples of the chunk."""
    gen = torch.Generator().manual_seed(48)
    rows = []
    for n, chunk in ((4096, 64), (1000, 7), (777, 16)):
        rows.append((f"i.i.d. normal scores, n={n}, chunk_size={chunk}", torch.randn(n, generator=gen,
                                                                                   dtype=torch.float64), chunk))
    drift = float(torch.empty(1).uniform_(0.005, 0.02, generator=gen))
    rows.append((f"scores drifting upwards by {drift:.4f} per position, n=4096, chunk_size=64",
                 torch.randn(4096, generator=gen, dtype=torch.float64) + drift * torch.arange(4096), 64))
    rows.append(("a falling row, n=500, chunk_size=8", -torch.arange(500, dtype=torch.float64)
                 + 0.1 * torch.randn(500, generator=gen, dtype=torch.float64), 8))
    rows.append(("small integers (ties), n=300, chunk_size=5", torch.randint(-3, 4, (300,), generator=gen).double(), 5))
    rows.append(("float32 scores of scale 8, n=2048, chunk_size=32", 8 * torch.randn(2048, generator=gen), 32))
    return rows


@exercise("08-rescale-cost", "rescale_cost_measured", points=2, category="experiment",
          hint="walk over the row chunk by chunk keeping the running maximum, as the one-pass softmax does; whenever "
               "a chunk after the first raises it (a tie does not), everything written so far is rescaled: count "
               "the event and the entries touched")
def _rescale_cost():
    """Count the rescaling events and the elements they touch, on rows the check draws."""
    return [Case(name, (row, chunk), expected=rescale_cost(row, chunk), compare="equal")
            for name, row, chunk in _rescale_rows()]


# ----------------------------------------------------------------------------- 5b. experiment: the study itself


def rescale_study_reference(n: int, chunk_size: int, drifts: tuple[float, ...], seeds: tuple[int, ...]):
    """Reference: the study of exercise 5 over `drifts` x `seeds`, each row drawn as the exercise says
    (``torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + drift * arange(n)``):
    (runs, an int64 tensor (drifts, seeds, 2) of (rescales, elements rescaled), and their mean over seeds, float64
    (drifts, 2))."""
    ramp = torch.arange(n, dtype=torch.float64)
    counts = []
    for drift in drifts:
        rows = (torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + drift * ramp
                for seed in seeds)
        counts.append([rescale_cost(row, chunk_size) for row in rows])
    counts = torch.tensor(counts, dtype=torch.int64)  # (drifts, seeds, 2)
    return counts, counts.to(torch.float64).mean(dim=1)


def _rescale_study_close(got, expected):
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, torch.Tensor) for x in got)):
        return f"expected (runs, mean), two tensors, got {type(got).__name__}"
    runs, mean = got
    if tuple(runs.shape) != tuple(expected[0].shape):
        return (f"runs has shape {tuple(runs.shape)}, expected (drifts, seeds, 2) = {tuple(expected[0].shape)}: one "
                "row per drift, one column per seed, in the order given")
    if not torch.equal(runs.long(), expected[0]):
        return ("some (rescales, elements rescaled) are not what the same measurement gives here: draw each row "
                "exactly as the exercise says, with its own generator per seed")
    if tuple(mean.shape) != tuple(expected[1].shape) or not torch.allclose(mean.double(), expected[1]):
        return "the mean over seeds is not the mean of your own runs"
    return None


@exercise("08-rescale-study", "rescale_study", points=1, category="experiment", allow=(),
          hint="for each drift, for each seed, draw the row as the exercise says, count with your "
               "rescale_cost_measured, and stack the counts; the mean is over the seeds")
def _rescale_study():
    """The measurement of exercise 5 as a function of its design: every run's counts and their mean over seeds."""
    return [Case(f"n={n}, chunk_size={c}, drifts {d}, seeds {s}", (n, c, d, s),
                 expected=rescale_study_reference(n, c, d, s), compare=_rescale_study_close)
            for n, c, d, s in ((4096, 64, (0.0, 0.01), (0, 1, 2)), (1500, 16, (0.0, 0.002, 0.05), (3, 4, 5, 6)))]
