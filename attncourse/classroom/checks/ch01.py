"""Checks for chapter 01, additive (Bahdanau) attention (solutions/01_additive_attention.ipynb).

Expected values come from the package's modules (``AdditiveAttention``, ``LuongAttention``) or from the definitions
written out here in float64, never from a copy of a solution.
"""

from __future__ import annotations

import torch

from attncourse.rnn_attention import AdditiveAttention, LuongAttention, attend
from attncourse.sdpa import safe_softmax
from . import Case, edits, exercise, forbidden, graphs
from .ch01_padding import far_padding_cases
from .predictions import whole


def _additive(gen: torch.Generator, b: int, t: int, dq: int, dk: int, a: int):
    """Random query, keys and additive weights, plus the reference module holding those weights."""
    q = torch.randn(b, dq, generator=gen, dtype=torch.float64)
    k = torch.randn(b, t, dk, generator=gen, dtype=torch.float64)
    w_q = torch.randn(a, dq, generator=gen, dtype=torch.float64) / dq**0.5
    w_k = torch.randn(a, dk, generator=gen, dtype=torch.float64) / dk**0.5
    v = torch.randn(a, generator=gen, dtype=torch.float64)
    return (q, k, w_q, w_k, v), _held(w_q, w_k, v)


def _held(w_q, w_k, v) -> AdditiveAttention:
    """An AdditiveAttention (float64) holding these very tensors (not copies), so that gradients reach them."""
    with torch.random.fork_rng(devices=[]):  # building a module draws from the global generator: keep the learner's
        blank = AdditiveAttention(w_q.shape[1], w_k.shape[1], w_q.shape[0]).double()
    return graphs.holding(blank, {"query_proj": w_q, "key_proj": w_k, "v": v[None]})


SIZES = {  # name: (B, T, Dq, Dk, A)
    "B=2, T=5, Dq=Dk=4, A=3": (2, 5, 4, 4, 3),
    "query and key sizes differ (Dq=6, Dk=10)": (3, 7, 6, 10, 8),
    "a single source position (T=1)": (2, 1, 5, 5, 4),
}


# ----------------------------------------------------------------------------- 1. implement: the batched score


def _shortcut_module(query, keys, W_q, W_k, v):
    """The package's module holding the same weights: must be refused."""
    return _held(W_q, W_k, v).score(query, keys)


def _shortcut_concat(query, keys, W_q, W_k, v):
    """Luong's concat score with the two matrices side by side: the same function, must be refused."""
    concat = LuongAttention(W_q.shape[1], W_k.shape[1], "concat", hidden_size=W_q.shape[0]).double()
    return graphs.holding(concat, {"W": torch.cat([W_q, W_k], dim=1), "v": v[None]}).score(query, keys)


def arithmetic(trace) -> int:
    """How many operators that compute (not only move data) the answer ran."""
    return sum(n for op, n in trace["counts"].items() if not forbidden.DATA_OPS.match(forbidden.normalise(op)))


def _no_loop(runs) -> str | None:
    """The operator count may not grow with the number of sequences or of source positions."""
    counted = sorted((arithmetic(r.trace), r.case.args[1].shape[0], r.case.args[1].shape[1]) for r in runs)
    (low, b_low, t_low), (high, b_high, t_high) = counted[0], counted[-1]
    if high > low + 4:
        return (f"your code runs {low} arithmetic operations for a batch of {b_low} x {t_low} positions but {high} for "
                f"{b_high} x {t_high}: the work is split into one piece per sequence or per position (a Python "
                "loop); score every pair in one go")
    return None


def _breaker_double_loop(query, keys, W_q, W_k, v):
    """The lesson's loop over positions, inside a loop over the batch: right scores, not batched."""
    rows = []
    for b in range(keys.shape[0]):
        rows.append(torch.stack([v @ torch.tanh(W_q @ query[b] + W_k @ keys[b, j]) for j in range(keys.shape[1])]))
    return torch.stack(rows)


def _breaker_position_loop(query, keys, W_q, W_k, v):
    """Batched over sequences, but one position at a time."""
    q = query @ W_q.T  # (B, A)
    return torch.stack([torch.tanh(q + keys[:, j] @ W_k.T) @ v for j in range(keys.shape[1])], dim=1)


def _breaker_batch_loop(query, keys, W_q, W_k, v):
    """Every position at once, but one sequence at a time."""
    return torch.stack([torch.tanh(W_q @ query[b] + keys[b] @ W_k.T) @ v for b in range(keys.shape[0])])


# The skill of 01-additive-score and 02-general-score is arranging the shapes so that one batched expression scores
# every pair: a batching transform applied to the one-position formula does that arranging for the learner, so both
# exercises refuse it under either of its names (torch.vmap, torch.func.vmap: both enter vmap_impl).
BATCHING_TRANSFORMS = ("torch.vmap", "torch.func.vmap", "torch._functorch.vmap.vmap_impl")
NO_TRANSFORM_DOC = ("and torch.vmap / torch.func.vmap (which would batch the one-position formula without the shape "
                    "arranging this exercise teaches) is refused")


def _shortcut_vmap(query, keys, W_q, W_k, v):
    """The lesson's per-position formula batched by torch.vmap: the broadcast the exercise teaches is left to
    PyTorch's batching transform, so it is refused."""
    one = lambda s, h: v @ torch.tanh(W_q @ s + W_k @ h)  # noqa: E731  (Dq,), (Dk,) -> ()
    return torch.vmap(torch.vmap(one, in_dims=(None, 0)), in_dims=(0, 0))(query, keys)


@exercise("01-additive-score", "additive_scores", points=2, category="implement",
          forbid=("attncourse.rnn_attention.AdditiveAttention", "attncourse.rnn_attention.LuongAttention",
                  *BATCHING_TRANSFORMS, *graphs.NO_CUSTOM_GRADIENT),
          allow=(), ops=("attention",), shortcuts=(_shortcut_module, _shortcut_concat, _shortcut_vmap),
          prop=graphs.apart(_no_loop),
          prop_doc="no Python loop and no batching transform: the number of operations does not grow "
                   "with the batch or the number of source positions, " + NO_TRANSFORM_DOC + "; and two cases ask "
                   "for the gradients of all five inputs, which must match autograd's on the reference (an output "
                   "computed outside PyTorch, from numbers read out of the tensors, carries no gradient)",
          breakers=(_breaker_double_loop, _breaker_position_loop, _breaker_batch_loop),
          hint="project the query once and every key once, then let broadcasting pair each query projection with "
               "all T key projections (give the query a length-one axis where the keys have T); squash, then read "
               "each pair out with v. The result has one number per source position")
def _additive_score():
    """The additive score v^T tanh(W_q s + W_k h_j) for every source position, for a batch, without a loop."""
    gen = torch.Generator().manual_seed(11)
    cases = []
    for name, size in {**SIZES, "long sequences (B=2, T=48)": (2, 48, 4, 4, 3),
                       "a larger batch (B=16, T=5)": (16, 5, 4, 6, 3)}.items():
        args, ref = _additive(gen, *size)
        with torch.no_grad():
            cases.append(Case(name, args, expected=ref.score(args[0], args[1]), rtol=1e-8, atol=1e-10))
    for at, size in ((3, (2, 5, 4, 6, 3)), (None, (6, 16, 4, 6, 3))):  # training differentiates the scores (graphs)
        args, _ = _additive(gen, *size)
        cases.insert(len(cases) if at is None else at, graphs.backward_case(
            f"the backward pass: gradients of query, keys, W_q, W_k and v (B={size[0]}, T={size[1]})", args,
            lambda q, k, w_q, w_k, v: _held(w_q, w_k, v).score(q, k)))
    return cases


# ----------------------------------------------------------------------------- 2. bug: a module that never focuses


def _shortcut_bug_module(query, keys, W_q, W_k, v):
    """The package's module with the weights copied in: the fix without finding the bug, refused."""
    with torch.no_grad():
        return _held(W_q, W_k, v)(query, keys)


# The given function exactly as the exercise notebook shows it (tests/test_edits.py compares the two).
BUGGY_ADDITIVE = '''\
def additive_attention_buggy(query, keys, W_q, W_k, v):
    q = (query @ W_q.T).unsqueeze(1)                       # (B, 1, A)
    k = keys @ W_k.T                                       # (B, T, A)
    scores = torch.tanh((q + k) @ v)                       # (B, T)
    weights = torch.softmax(scores, dim=-1)                # (B, T): one distribution per sequence
    context = (weights.unsqueeze(-1) * keys).sum(dim=1)    # (B, T, 1) * (B, T, Dk) -> (B, Dk)
    return context, weights
'''
FIX_ADDITIVE = edits.SmallEdit(BUGGY_ADDITIVE, most=6, lines=(4,), names=("matmul",))


def _rewrite_from_formula(query, keys, W_q, W_k, v):
    """Attention written from the lesson's formula without reading the given code: right values, refused."""
    scores = torch.tanh((query @ W_q.T).unsqueeze(1) + keys @ W_k.T) @ v  # (B, T)
    weights = torch.softmax(scores, dim=-1)
    return (weights.unsqueeze(1) @ keys).squeeze(1), weights


@exercise("01-find-the-bug", "additive_attention_fixed", points=2, category="bug",
          bug_words=("tanh after", "tanh outside", "outside the tanh", "after the read-out", "after the readout",
                     "before the tanh", "read out first", "read-out first", "bounded", "between -1 and 1",
                     "squashes the score", "squash the score", "squashed score", "e^2", "e²", "7.4", "wrong order",
                     "order of the", "inside the tanh", "cannot exceed", "range of the scores"),
          allow=(), ops=("attention",), shortcuts=(_shortcut_bug_module,),
          prop=edits.prop(FIX_ADDITIVE, "`additive_attention_fixed`"), trace=False, breakers=(_rewrite_from_formula,),
          prop_doc="the diagnosis: the right weights and contexts, from the given function with a small edit where "
                   "it is wrong (a rewrite from the formula does not show the bug was found)",
          hint="multiply v by 10, then by 100, and watch the largest weight of one sequence of 16 positions: with "
               "the lesson's score larger scores make sharper weights. Do they here? Find what caps the scores "
               "by following one score through the code, operation by operation, next to the formula")
def _find_the_bug():
    """Fix an attention module: it runs, its weights sum to one, and it never puts much weight on any position."""
    gen = torch.Generator().manual_seed(12)
    cases = []
    for name, size in SIZES.items():
        args, ref = _additive(gen, *size)
        with torch.no_grad():
            context, weights = ref(args[0], args[1])
        cases.append(Case(name, args, expected=(context, weights), rtol=1e-8, atol=1e-10))
    return cases


# ----------------------------------------------------------------------------- 3. implement: padding


def _shortcut_attend(scores, lengths):
    """The package's masked softmax: must be refused."""
    mask = torch.arange(scores.shape[1]) < lengths[:, None]  # (B, T)
    return attend(scores, torch.zeros(*scores.shape, 1, dtype=scores.dtype), mask)[1]


def _shortcut_safe_softmax(scores, lengths):
    """The course's NaN-free softmax on the filled scores: must be refused."""
    mask = torch.arange(scores.shape[1]) < lengths[:, None]  # (B, T)
    return safe_softmax(scores.masked_fill(~mask, float("-inf")))


def _shortcut_aten_safe_softmax(scores, lengths):
    """PyTorch's own NaN-free softmax, under its ATen name: refused."""
    mask = torch.arange(scores.shape[1]) < lengths[:, None]  # (B, T)
    return torch.ops.aten._safe_softmax(scores.masked_fill(~mask, float("-inf")), -1)


def _shortcut_masked_api(scores, lengths):
    """PyTorch's public masked softmax, torch.masked.softmax (True marks what is kept): refused."""
    mask = torch.arange(scores.shape[1]) < lengths[:, None]  # (B, T)
    return torch.masked.softmax(scores, -1, mask=mask).nan_to_num(0.0)


def _shortcut_masked_softmax(scores, lengths):
    """PyTorch's private masked softmax (True marks what is masked): refused."""
    mask = torch.arange(scores.shape[1]) < lengths[:, None]  # (B, T)
    return torch._masked_softmax(scores, ~mask, 1, 0).nan_to_num(0.0)


def _shortcut_sparse(scores, lengths):
    """A sparse softmax over the real positions only: refused."""
    mask = torch.arange(scores.shape[1]) < lengths[:, None]  # (B, T)
    sparse = torch.sparse_coo_tensor(mask.nonzero().T, scores[mask], scores.shape)
    return torch.sparse.softmax(sparse, 1).to_dense()


def _shortcut_fused(scores, lengths):
    """PyTorch's fused attention with the scores as a float mask and the identity as values: refused."""
    b, t = scores.shape
    mask = torch.arange(t) < lengths[:, None]  # (B, T)
    zeros = torch.zeros(b, 1, 1, dtype=scores.dtype)
    eye = torch.eye(t, dtype=scores.dtype).expand(b, t, t).contiguous()
    return torch.nn.functional.scaled_dot_product_attention(
        zeros, torch.zeros(b, t, 1, dtype=scores.dtype), eye,
        attn_mask=scores.masked_fill(~mask, float("-inf"))[:, None]).squeeze(1)


def _breaker_row_loop(scores, lengths):
    """One softmax per sequence over its real scores, no mask at all: right weights, not a batched masked softmax."""
    out = torch.zeros_like(scores)
    for b in range(scores.shape[0]):
        n = int(lengths[b])
        if n > 0:
            out[b, :n] = torch.softmax(scores[b, :n], dim=-1)
    return out


def _breaker_length_loop(scores, lengths):
    """One softmax per distinct length (the rows sharing it, sliced to it): fewer pieces than rows, still a loop."""
    out = torch.zeros_like(scores)
    for n in sorted(set(int(n) for n in lengths)):
        if n > 0:
            rows = lengths == n
            out[rows, :n] = torch.softmax(scores[rows, :n], dim=-1)
    return out


# nested (ragged) tensors do the ragged part for the learner (tests/test_ch01_checks.py tries the route: the guard
# refuses it before the trace, which cannot record a nested tensor's sizes, would fail on it)
NESTED_OPS = ("aten::_nested_tensor_from_tensor_list", "aten::_nested_view_from_jagged", "aten::_nested_from_padded",
              "aten::_nested_from_padded_and_nested_example", "aten::_nested_tensor_from_mask",
              "aten::_nested_view_from_buffer", "aten::to_padded_tensor", "aten::_jagged_to_padded_dense_forward",
              "aten::_padded_dense_to_jagged_forward")


def _one_masked_softmax(runs) -> str | None:
    """One softmax over the whole (B, T) score matrix: the operator count may not grow with the batch, the number of
    distinct lengths or the number of positions (the cases run from 2 x 4 to 16 x 12)."""
    counted = sorted((arithmetic(r.trace), tuple(r.case.args[0].shape)) for r in runs)
    (low, small), (high, large) = counted[0], counted[-1]
    if high > low + 4:
        return (f"your code runs {low} arithmetic operations for {small[0]} x {small[1]} scores but {high} for "
                f"{large[0]} x {large[1]}: the rows are handled in pieces (a Python loop over sequences, lengths or "
                "positions). Mask the padded scores of every row at once and take one softmax over the whole batch")
    return None


@exercise("01-padding-mask", "masked_softmax", points=2, category="implement",
          forbid=("attncourse.sdpa.safe_softmax", "attncourse.rnn_attention.attend",
                  "attncourse.rnn_attention.AdditiveAttention", "attncourse.rnn_attention.LuongAttention",
                  "torch.nn.functional.scaled_dot_product_attention", "attncourse.sdpa.scaled_dot_product_attention",
                  *graphs.NO_CUSTOM_GRADIENT),
          allow=(), ops=("attention", "aten::_safe_softmax", "aten::_masked_softmax", "aten::_sparse_softmax",
                         "aten::_sparse_log_softmax",  # and torch.masked's softmax family, judged by name:
                         "aten::masked_log_softmax", "aten::masked_softmin", *NESTED_OPS),
          shortcuts=(_shortcut_attend, _shortcut_safe_softmax, _shortcut_aten_safe_softmax, _shortcut_masked_softmax,
                     _shortcut_masked_api, _shortcut_sparse, _shortcut_fused),
          prop=graphs.apart(_one_masked_softmax), breakers=(_breaker_row_loop, _breaker_length_loop),
          prop_doc="a batched masked softmax (the operator count does not grow with the batch, the number of "
                   "distinct lengths or the positions: a loop taking one softmax per row's real scores, which needs no "
                   "mask, is refused; so are nested (ragged) tensors, which do the ragged part for you), and output "
                   "equality: exact zeros past each length and on empty rows, a distribution "
                   "over the real positions, wherever the real scores lie (one case puts them near -5000 and one near "
                   "-3e9, so a fill that is only large next to scores near 0 fails, -1e9 included; one puts the padding's "
                   "1000 above the real ones, so softmax-then-zero-and-renormalise fails); a plain softmax is "
                   "allowed, the masking and the empty row are the skill. A finite fill far below every score "
                   "(-1e30) followed by zeroing the empty rows is a right answer in float64: it decides the empty "
                   "row, which is the point. Two cases ask for the gradient of the scores too (autograd's on the "
                   "reference, zero at the padding): weights computed outside PyTorch carry none",
          hint="compare a row of positions with each sequence's length to know which scores are real; give the "
               "others a score no exponential can lift above zero, wherever the real scores of the row lie. Then ask "
               "what a softmax does to a row in which "
               "every score is like that, and decide that row's weights yourself")
def _masked_softmax():
    """Softmax over the first `lengths[b]` positions of each row; zeros elsewhere, zeros for length 0."""
    gen = torch.Generator().manual_seed(13)
    cases = []
    for name, (b, t, lengths, shift) in {
        "lengths [5, 2, 3]": (3, 5, [5, 2, 3], 0.0),
        "length 1 keeps a single weight of 1": (2, 4, [1, 4], 0.0),
        "length 0 gives a row of zeros, not NaN": (3, 6, [6, 0, 2], 0.0),
        # a softmax ignores a constant added to a row, so real scores can sit anywhere: a fill that is only
        # "very negative" next to scores near 0 (say -30 or -1000) lends the padding weight here
        "the first row's real scores all near -5000 (its padding must still get exactly 0)": (2, 5, [3, 2],
                                                                                             [-5000.0, 0.0]),
        # -1e9 (the fill chapter 03 calls a silent bug) is only "very negative" next to scores above it
        "the second row's real scores all near -3e9 (a fill of -1e9 is above them)": (2, 5, [4, 3], [0.0, -3e9]),
        "a batch of 16 with lengths 0 to 12": (16, 12, [12, 0, 7, 3, 12, 1, 9, 5, 11, 2, 8, 4, 10, 6, 12, 3], 0.0),
    }.items():
        scores = torch.randn(b, t, generator=gen, dtype=torch.float64) * 3 + torch.tensor(shift)[..., None]
        lengths_t = torch.tensor(lengths)
        mask = torch.arange(t) < lengths_t[:, None]  # (B, T)
        expected = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
        # near -3e9 float64 numbers are 4.8e-7 apart, so a right softmax spelled exp(s - logsumexp(s)) rounds the
        # logsumexp by up to half of that and is off by ~2.4e-7 relative (tests/test_ch01_checks.py tries it): the
        # tolerance there admits every standard spelling, and a wrong fill is still off by a factor, not by 1e-6
        rtol = 2e-6 if isinstance(shift, list) and min(shift) < -1e6 else 1e-8
        cases.append(Case(name, (scores, lengths_t), expected=expected, rtol=rtol, atol=1e-10))
    for b, t in ((3, 5), (16, 12)):  # training differentiates the weights: two sizes (see graphs), no empty row
        args = torch.randn(b, t, generator=gen, dtype=torch.float64) * 3, torch.randint(1, t + 1, (b,), generator=gen)
        pad = torch.arange(t) >= args[1][:, None]  # (B, T)
        cases.insert(3 if b == 3 else len(cases), graphs.backward_case(
            f"the backward pass: the gradient of the scores ({b} x {t}, lengths {args[1].tolist()})", args,
            lambda s, _, pad=pad: torch.softmax(s.masked_fill(pad, float("-inf")), -1)))
    cases += far_padding_cases(gen)  # the padding's scores far above the real ones, float64 and float32
    return cases


# ----------------------------------------------------------------------------- 4. predict: a teacher-forced step

SHAPE_PARTS = ("annotations", "weights", "context", "output layer input")
# the exercise's own configuration: the lesson's Seq2SeqConfig() sizes, a batch of 8, 13 source digits, 13 targets;
# `directions` 2 is the lesson's bidirectional encoder, 1 an encoder that reads one way (no lesson model has it)
SHAPE_CONFIG = dict(batch=8, source_len=13, target_len=13, embed_size=32, encoder_size=32, decoder_size=64,
                    attention_size=32, directions=2)


def measured_shapes(batch, source_len, target_len, embed_size, encoder_size, decoder_size, attention_size,
                    directions=2):
    """The four shapes of one teacher-forced step (source and target lengths may differ, as in translation),
    measured: on the lesson's additive model built at these sizes for a bidirectional encoder, and on the same
    parts (a GRU encoder reading one way, a GRU decoder, AdditiveAttention) wired alike for `directions` = 1."""
    from attncourse.seq2seq import Seq2SeqConfig, build_model

    config = Seq2SeqConfig(embed_size=embed_size, encoder_size=encoder_size, decoder_size=decoder_size,
                           attention_size=attention_size)
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(2, config.vocab_size, (batch, source_len), generator=gen)  # (B, S), no padding
    tgt = torch.randint(2, config.vocab_size, (batch, target_len), generator=gen)  # (B, T)
    if directions == 1:
        with torch.random.fork_rng(), torch.no_grad():
            embed = torch.nn.Embedding(config.vocab_size, embed_size)
            annotations, _ = torch.nn.GRU(embed_size, encoder_size, batch_first=True)(embed(src))  # (B, S, E)
            states, _ = torch.nn.GRU(embed_size, decoder_size, batch_first=True)(embed(tgt))  # (B, T, Dd)
            context, weights = AdditiveAttention(decoder_size, encoder_size, attention_size)(states, annotations)
            readout = torch.cat([states, context], dim=-1)  # what the output layer reads
        return tuple(tuple(x.shape) for x in (annotations, weights, context, readout))
    with torch.random.fork_rng():  # building a model seeds the global generator: keep the learner's
        model = build_model("additive", config)
    seen = {}
    model.out.register_forward_hook(lambda mod, inputs, output: seen.update(out=tuple(inputs[0].shape)))
    model.attention.register_forward_hook(  # (a hook that returns something would replace the output)
        lambda mod, inputs, output: seen.update(attention=tuple(tuple(o.shape) for o in output)))
    with torch.no_grad():
        annotations, _ = model.encode(src, torch.full((batch,), source_len))  # (B, S, 2E)
        model(src, torch.full((batch,), source_len), tgt)  # teacher forcing: one attention call on all T queries
    context, weights = seen["attention"]
    return tuple(annotations.shape), weights, context, seen["out"]


@exercise("01-predict-shapes", "predicted_shapes", points=1, category="predict", parts=SHAPE_PARTS,
          forbid=("attncourse.seq2seq.build_model", "attncourse.seq2seq.Seq2Seq", "attncourse.seq2seq.Seq2SeqConfig",
                  "attncourse.rnn_attention.AdditiveAttention"),
          allow=(), ops=("torch",),
          prop_doc="the prediction is a rule in plain integers, a function of the batch, the two lengths, the "
                   "model's widths and the encoder's directions, judged on the exercise's configuration and on "
                   "configurations drawn from a seed (the grader draws others), one with an encoder that reads one "
                   "way, which no lesson model has: a rule read off measurements of the lesson's model fails it; "
                   "building or running a model inside the rule is refused (no tensor operation may run), and a "
                   "table of one configuration's shapes fails the drawn ones",
          hint="work from the lesson's model description, one tensor at a time, and say what each axis of "
               "a shape counts: what does the encoder hand over for each source position, and how wide is it (which "
               "width sets it, and how many directions does the encoder read)? How many queries does one teacher-forced "
               "call ask, and what does each get back? What does the output layer read? Some of the arguments "
               "may not appear in any shape")
def _predict_shapes():
    """Predict, as a function of (batch, source_len, target_len, embed_size, encoder_size, decoder_size,
    attention_size, directions), the shapes in one teacher-forced step of the lesson's additive model."""
    gen = torch.Generator().manual_seed(14)  # three more configurations, drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    configs = [("the exercise's: batch 8, 13 digits in and out, Seq2SeqConfig()", SHAPE_CONFIG)]
    for directions in (1, 2, 1):  # an encoder reading one way: no lesson model to measure
        source_len = pick(3, 20)
        cfg = dict(batch=pick(1, 9), source_len=source_len, target_len=source_len + pick(1, 6) * (-1) ** pick(0, 1),
                   embed_size=4 * pick(2, 9), encoder_size=4 * pick(2, 12), decoder_size=4 * pick(2, 20),
                   attention_size=4 * pick(2, 10), directions=directions)
        cfg["target_len"] = max(cfg["target_len"], 1)
        configs.append((", ".join(f"{k}={v}" for k, v in cfg.items()), cfg))
    return [Case(f"shapes of (annotations, weights, context, output layer input) for {name}", tuple(cfg.values()),
                 expected=measured_shapes(**cfg),
                 compare=whole("a tuple of four shapes (annotations, weights, context, output layer input)"))
            for name, cfg in configs]


# exercise 5 (predict, then measure, which score variants let the query move the weights): ch01_influence.py
