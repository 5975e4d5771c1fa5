"""Checks for chapter 02, Luong attention (solutions/02_luong_attention.ipynb).

Expected values come from the package's modules (``LuongAttention``, ``AdditiveAttention``) and the course's oracle
(``attncourse.sdpa.scaled_dot_product_attention``), or from definitions written out here in float64.
"""

from __future__ import annotations

import torch

from attncourse.rnn_attention import AdditiveAttention, LuongAttention, score_parameter_count
from attncourse.sdpa import scaled_dot_product_attention
from . import Case, edits, exercise, graphs
from .ch01 import BATCHING_TRANSFORMS, NO_TRANSFORM_DOC, _no_loop
from .predictions import whole


def _qk(gen: torch.Generator, b: int, t: int, dq: int, dk: int):
    q = torch.randn(b, dq, generator=gen, dtype=torch.float64)
    k = torch.randn(b, t, dk, generator=gen, dtype=torch.float64)
    return q, k


# ----------------------------------------------------------------------------- 1. implement: the general score


def _general_module(w: torch.Tensor) -> LuongAttention:
    """A general-score LuongAttention (float64) holding `w` itself, so that gradients reach it."""
    with torch.random.fork_rng(devices=[]):  # building a module draws from the global generator: keep the learner's
        blank = LuongAttention(w.shape[0], w.shape[1], "general").double()
    return graphs.holding(blank, {"W": w})


def _shortcut_module(query, keys, W):
    """The package's general score holding the same W: must be refused."""
    return _general_module(W).score(query, keys)


def _shortcut_bilinear(query, keys, W):
    """PyTorch's bilinear form x1^T A x2, one query copied per key: must be refused."""
    b, t, _ = keys.shape
    q = query[:, None].expand(b, t, query.shape[1])  # (B, T, Dq)
    return torch.nn.functional.bilinear(q, keys, W[None]).squeeze(-1)  # (B, T, 1) -> (B, T)


def _shortcut_aten_bilinear(query, keys, W):
    """The same bilinear form under its ATen name: must be refused."""
    b, t, _ = keys.shape
    q = query[:, None].expand(b, t, query.shape[1]).contiguous()  # (B, T, Dq)
    return torch.ops.aten.bilinear(q, keys, W[None], None).squeeze(-1)


def _shortcut_vmap(query, keys, W):
    """The one-position formula s^T W h batched by torch.vmap: refused, as in 01-additive-score (the shapes are the
    skill)."""
    return torch.vmap(torch.vmap(lambda s, h: s @ W @ h, in_dims=(None, 0)), in_dims=(0, 0))(query, keys)


def _breaker_double_loop(query, keys, W):
    """One score at a time, stacked again: right values and gradients, not a batched score."""
    return torch.stack([torch.stack([query[b] @ W @ keys[b, j] for j in range(keys.shape[1])])
                        for b in range(keys.shape[0])])


def _breaker_batch_loop(query, keys, W):
    """Every position at once, but one sequence at a time."""
    return torch.stack([keys[b] @ (W.T @ query[b]) for b in range(keys.shape[0])])


def _breaker_position_loop(query, keys, W):
    """Batched over sequences, one position at a time."""
    q = query @ W  # (B, Dk)
    return torch.stack([(q * keys[:, j]).sum(-1) for j in range(keys.shape[1])], dim=1)


@exercise("02-general-score", "general_scores", points=2, category="implement",
          forbid=("attncourse.rnn_attention.LuongAttention", "attncourse.rnn_attention.AdditiveAttention",
                  "torch.nn.functional.bilinear", "torch.bilinear", "torch.nn.Bilinear", *BATCHING_TRANSFORMS,
                  *graphs.NO_CUSTOM_GRADIENT),
          allow=(), ops=("attention", "aten::bilinear", "aten::_trilinear"),
          shortcuts=(_shortcut_module, _shortcut_bilinear, _shortcut_aten_bilinear, _shortcut_vmap),
          prop=graphs.apart(_no_loop), breakers=(_breaker_double_loop, _breaker_batch_loop, _breaker_position_loop),
          prop_doc="no Python loop: s^T W h_j for every sequence and position as batched products (in whichever "
                   "order they run), so the number of operations does not grow with the batch or the number of "
                   "source positions, " + NO_TRANSFORM_DOC + "; and two cases ask for the gradients of query, keys "
                   "and W, which must match autograd's on the reference (a score computed outside PyTorch, from "
                   "numbers read out of the tensors, carries no gradient)",
          hint="the matrix sits between the query and each key: it can be applied to the one query per sequence "
               "instead of to the T keys (which is cheaper?), after which each score is a plain dot product. Keep "
               "the batch axis apart from the positions")
def _general():
    """Luong's general score s^T W h_j, with W of shape (Dq, Dk)."""
    gen = torch.Generator().manual_seed(21)
    cases = []
    for name, (b, t, dq, dk) in {
        "B=2, T=5, Dq=Dk=4": (2, 5, 4, 4),
        "query and key sizes differ (Dq=3, Dk=7)": (3, 6, 3, 7),
        "a single source position (T=1)": (2, 1, 5, 2),
        "long sequences (B=2, T=40)": (2, 40, 4, 6),
        "a larger batch (B=16, T=5)": (16, 5, 6, 4),
    }.items():
        q, k = _qk(gen, b, t, dq, dk)
        w = torch.randn(dq, dk, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            cases.append(Case(name, (q, k, w), expected=_general_module(w).score(q, k), rtol=1e-8, atol=1e-10))
    for b, t, dq, dk in ((2, 5, 3, 7), (6, 16, 3, 7)):  # training differentiates the scores: two sizes (see graphs)
        args = (*_qk(gen, b, t, dq, dk), torch.randn(dq, dk, generator=gen, dtype=torch.float64))
        cases.insert(3 if b == 2 else len(cases), graphs.backward_case(
            f"the backward pass: gradients of query, keys and W (B={b}, T={t})", args,
            lambda q, k, w: _general_module(w).score(q, k)))
    return cases


# ----------------------------------------------------------------------------- 2. predict: parameter counts

SIZES = dict(query_size=64, key_size=48, hidden_size=32, rank=16)
SCORE_KEYS = ("dot", "general", "concat", "additive", "factored")


def count_with_biases(module: torch.nn.Module) -> int:
    """Parameters of `module` if every one of its nn.Linear layers had a bias (one per output feature)."""
    return sum(layer.weight.numel() + layer.out_features for layer in module.modules()
               if isinstance(layer, torch.nn.Linear))


def counted_parameters(query_size: int, key_size: int, hidden_size: int, rank: int) -> dict:
    """Parameters of each score at these sizes, every nn.Linear layer with a bias, counted on the package's modules
    (None where a score cannot be built), and on a Transformer head's two projections to `rank` for "factored"
    ((W_q s + b_q)^T (W_k h + b_k), the general score with a factored W: no package module has it)."""
    with torch.random.fork_rng():
        factored = torch.nn.ModuleList([torch.nn.Linear(query_size, rank), torch.nn.Linear(key_size, rank)])
    counted = {
        "dot": count_with_biases(LuongAttention(query_size, key_size, "dot")) if query_size == key_size else None,
        "general": count_with_biases(LuongAttention(query_size, key_size, "general")),
        "concat": count_with_biases(LuongAttention(query_size, key_size, "concat", hidden_size=hidden_size)),
        "additive": count_with_biases(AdditiveAttention(query_size, key_size, hidden_size)),
        "factored": count_with_biases(factored),
    }
    assert counted["general"] == score_parameter_count("general", query_size, key_size) + query_size  # W h + b
    assert counted["additive"] == counted["concat"] + hidden_size  # one more bias vector of size A
    return counted


@exercise("02-parameter-counts", "parameter_counts", points=1, category="predict",
          forbid=("attncourse.rnn_attention.LuongAttention", "attncourse.rnn_attention.AdditiveAttention",
                  "attncourse.rnn_attention.score_parameter_count"),
          allow=(), ops=("torch",),
          prop_doc="the prediction is a count in plain integers, written as a function of the four sizes so that "
                   "no module or package call can stand in for it (building a layer runs tensor operations, which "
                   "are refused): equal counts on the exercise's sizes and on sizes drawn from a seed (the grader "
                   "draws others, one of them with equal query and key sizes) are the skill; the factored score "
                   "has no module in the package, so counts read off the lesson's modules cannot give it",
          hint="count every entry of every matrix and vector each score owns, then one bias entry per output of each "
               "of its layers: how many layers does each score have, and how many outputs each? Concat and additive "
               "own the same weights arranged differently, but not the same layers. And can every score be built "
               "when the query and the keys have different sizes, and what does it own when they are equal?")
def _counts():
    """Parameters of each score, every layer with a bias, as a function of (query_size, key_size, hidden_size,
    rank)."""
    gen = torch.Generator().manual_seed(22)  # two more size triples, drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    sizes = [("the exercise's: a query of 64, keys of 48", tuple(SIZES.values()))]
    same = 4 * pick(1, 32)
    sizes.append((f"equal query and key sizes ({same})", (same, same, 4 * pick(1, 24), 4 * pick(1, 8))))
    dq, dk = 4 * pick(1, 32), 4 * pick(1, 32)
    dk = dk if dk != dq else dq + 4
    sizes.append((f"a query of {dq}, keys of {dk}", (dq, dk, 4 * pick(1, 24), 4 * pick(1, 8))))
    return [Case(f"parameter counts by score, with biases, for {name}, a tanh layer of {args[2]}, rank {args[3]}", args,
                 expected=counted_parameters(*args),
                 compare=whole("a dict with an int (or None) for each of " + ", ".join(map(repr, SCORE_KEYS)),
                               kind="dict"))
            for name, args in sizes]


# ----------------------------------------------------------------------------- 3. bug: a padded batch


def reference_dot_attention(query, keys, values, lengths):
    """Luong's dot attention (unscaled) of one query per sequence over its first `lengths[b]` positions."""
    t = keys.shape[1]
    valid = torch.arange(t) < lengths[:, None]  # (B, T): True where the position holds a token
    context, _ = LuongAttention(query.shape[1], keys.shape[2], "dot")(query, keys, values, mask=valid)
    oracle = scaled_dot_product_attention(query[:, None], keys, values, valid[:, None], scale=1.0)  # (B, 1, Dv)
    torch.testing.assert_close(context, oracle.squeeze(1))
    return context


def _shortcut_luong_module(query, keys, values, lengths):
    """The package's dot attention with the right mask: the fix without finding the bug, refused."""
    valid = torch.arange(keys.shape[1]) < lengths[:, None]
    return LuongAttention(query.shape[1], keys.shape[2], "dot")(query, keys, values, mask=valid)[0]


def _shortcut_course_sdpa(query, keys, values, lengths):
    """The course's attention with the right mask: refused."""
    valid = torch.arange(keys.shape[1]) < lengths[:, None]
    return scaled_dot_product_attention(query[:, None], keys, values, valid[:, None], scale=1.0).squeeze(1)


def _shortcut_aten_sdpa(query, keys, values, lengths):
    """PyTorch's attention kernel under its ATen name: refused."""
    valid = torch.arange(keys.shape[1]) < lengths[:, None]
    return torch.ops.aten.scaled_dot_product_attention(query[:, None], keys, values, valid[:, None],
                                                       scale=1.0).squeeze(1)


def _shortcut_aten_safe_softmax(query, keys, values, lengths):
    """PyTorch's masked-row-safe softmax under its ATen name (the fused kernel's softmax): refused."""
    valid = torch.arange(keys.shape[1]) < lengths[:, None]
    scores = torch.einsum("bd,btd->bt", query, keys).masked_fill(~valid, float("-inf"))
    return torch.einsum("bt,btv->bv", torch.ops.aten._safe_softmax(scores, -1), values)


# The given function exactly as the exercise notebook shows it (tests/test_edits.py compares the two).
BUGGY_LUONG = '''\
def luong_dot_attention_buggy(query, keys, values, lengths):
    T = keys.shape[1]
    mask = torch.arange(T) >= T - lengths[:, None]                   # (T,) vs (B, 1) -> (B, T)
    scores = (keys @ query.unsqueeze(-1)).squeeze(-1)               # (B, T, D) @ (B, D, 1) -> (B, T)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)          # (B, T); a row with no score left gives zeros
    return (weights.unsqueeze(1) @ values).squeeze(1)                # (B, 1, T) @ (B, T, Dv) -> (B, Dv)
'''
FIX_LUONG = edits.SmallEdit(BUGGY_LUONG, most=4, lines=(3, 5))


def _rewrite_masked_dot(query, keys, values, lengths):
    """A masked dot attention written from scratch without reading the given code: right values, refused."""
    valid = torch.arange(keys.shape[1]) < lengths[:, None]  # (B, T)
    scores = torch.einsum("btd,bd->bt", keys, query).masked_fill(~valid, float("-inf"))
    return torch.einsum("bt,btv->bv", torch.softmax(scores, dim=-1), values)


@exercise("02-find-the-bug", "luong_dot_attention", points=2, category="bug",
          forbid=("torch.nn.functional.scaled_dot_product_attention",),
          # the given mask keeps each row's last lengths[b] positions, where the encoder left its tokens first
          # (cold review 15: the earlier bug, a one-token flip of the mask's sense, fell to a 12-edit search)
          bug_words=("left-pad", "left pad", "padded on the left", "padding on the left", "padding at the front",
                     "padding first", "front of the row", "right-pad", "right pad", "right-align", "left-align",
                     "aligned to the right", "aligned to the end", "the last lengths", "end of each row",
                     "from the end", "the wrong end", "wrong side", "the wrong positions", "attends to the padding"),
          allow=(), ops=("attention", "aten::_safe_softmax", "aten::_masked_softmax", "aten::_sparse_softmax",
                         "aten::_sparse_log_softmax"),
          shortcuts=(_shortcut_luong_module, _shortcut_course_sdpa, _shortcut_aten_sdpa,
                     _shortcut_aten_safe_softmax),
          prop=edits.prop(FIX_LUONG, "`luong_dot_attention`"), trace=False, breakers=(_rewrite_masked_dot,),
          prop_doc="the diagnosis: each context mixes exactly the first lengths[b] values of its row, from the given "
                   "function with a small edit where it is wrong (a rewrite does not show the bug was found)",
          hint="run the given function on a batch whose rows have different lengths, with zeros at the padded "
               "positions, and look at each row's context: what comes out for a short row, and what for a row that "
               "has no padding at all? Which positions did each row's query actually read?")
def _find_the_bug():
    """Fix a dot attention over a padded batch: it runs, its shapes are right, its contexts are wrong."""
    gen = torch.Generator().manual_seed(22)
    cases = []
    for name, (b, t, d, dv, lengths) in {
        "B=2, T=5, D=8, lengths [5, 3]": (2, 5, 8, 8, [5, 3]),
        "padding, lengths [6, 2, 4], Dv=3": (3, 6, 8, 3, [6, 2, 4]),
        "length 1 and no padding, D=64 (large unscaled scores)": (2, 7, 64, 4, [1, 7]),
    }.items():
        q, k = _qk(gen, b, t, d, d)
        v = torch.randn(b, t, dv, generator=gen, dtype=torch.float64)
        lengths_t = torch.tensor(lengths)
        with torch.no_grad():
            expected = reference_dot_attention(q, k, v, lengths_t)
        cases.append(Case(name, (q, k, v, lengths_t), expected=expected, rtol=1e-8, atol=1e-10))
    return cases


# ----------------------------------------------------------------------------- 4. experiment: initialisation width


def _tanh_input_rms(W: torch.Tensor, query_size: int, queries: torch.Tensor, keys: torch.Tensor) -> float:
    """Root mean square of the tanh layer's input W [s; h] = W_s s + W_h h over every (query, key) pair."""
    w_s, w_h = W[:, :query_size], W[:, query_size:]  # (A, Dq), (A, Dk)
    hidden = (queries @ w_s.T)[:, None] + keys @ w_h.T  # (N, 1, A) + (N, T, A) -> (N, T, A)
    return float(hidden.pow(2).mean().sqrt())


def initial_weights(score: str, seed: int, query_size: int, key_size: int, hidden: int) -> torch.Tensor:
    """The (A, Dq + Dk) tanh-layer matrix of a concat or additive score built right after torch.manual_seed(seed)."""
    with torch.random.fork_rng():  # leave the caller's generator alone
        torch.manual_seed(seed)
        if score == "concat":
            return LuongAttention(query_size, key_size, "concat", hidden_size=hidden).W.weight.detach().double()
        additive = AdditiveAttention(query_size, key_size, hidden)
        return torch.cat([additive.query_proj.weight, additive.key_proj.weight], dim=1).detach().double()


def init_width_ratio_reference(queries, keys, hidden_size, seed):
    """RMS of additive's tanh input over RMS of concat's, both freshly initialised from `seed`."""
    dq, dk = queries.shape[1], keys.shape[2]
    rms = {score: _tanh_input_rms(initial_weights(score, seed, dq, dk, hidden_size), dq, queries, keys)
           for score in ("additive", "concat")}
    return rms["additive"] / rms["concat"]


def width_ratio_measured(query_size: int, key_size: int, query_spread: float, key_spread: float) -> float:
    """Additive's tanh-input RMS over concat's, measured on freshly initialised modules (4 seeds of each, 1024
    hidden units, so the estimate is within about 0.5% of its expectation): the tanh input's mean square, averaged
    over independent zero-mean inputs of these spreads, read off the weights each module really starts with."""
    mean_square = {}
    for score in ("additive", "concat"):
        rows = torch.cat([initial_weights(score, seed, query_size, key_size, 1024) for seed in range(4)])
        w_s, w_h = rows[:, :query_size], rows[:, query_size:]  # (4 A, Dq), (4 A, Dk)
        mean_square[score] = float(query_spread**2 * w_s.square().sum(1).mean()
                                   + key_spread**2 * w_h.square().sum(1).mean())
    return (mean_square["additive"] / mean_square["concat"]) ** 0.5


@exercise("02-init-width-predict", "predicted_width_ratio", points=1, category="predict", parts=("ratio",),
          allow=(), ops=("torch", "numpy"),
          prop_doc="the prediction is the expected ratio as a rule in plain Python, a function of the two sizes and "
                   "the two spreads, judged on the exercise's three settings and on drawn ones (the grader draws "
                   "others) against a measurement on freshly initialised modules within 2% (the checker holds no "
                   "formula to copy): no module can be built or run inside it, so it must come from the initialisation's "
                   "variance, before the experiment measures it",
          hint="write the variance of one weight drawn uniformly between minus and plus one over the square root of "
               "its layer's fan-in; then the variance of one tanh input as a sum of independent products (weight "
               "times input), for each module: "
               "how many terms, and which fan-in divides each? The ratio of root mean squares is the square root of "
               "the ratio of variances")
def _init_width_predict():
    """Predict, as a function of (query_size, key_size, query_spread, key_spread), how much wider additive's tanh
    input starts than concat's."""
    gen = torch.Generator().manual_seed(23)  # three more settings, drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    settings = [(64, 64, 1.0, 1.0), (64, 16, 1.0, 0.2), (64, 16, 0.2, 1.0)]
    settings += [(4 * pick(1, 32), 4 * pick(1, 32), pick(1, 20) / 10, pick(1, 20) / 10) for _ in range(3)]
    return [Case(f"Dq={dq}, Dk={dk}, query spread {sq}, key spread {sk}", (dq, dk, sq, sk),
                 expected=width_ratio_measured(dq, dk, sq, sk), rtol=0.02, atol=0.0)
            for dq, dk, sq, sk in settings]


@exercise("02-init-width", "init_width_ratio", points=2, category="experiment",
          allow=("attncourse.rnn_attention.AdditiveAttention", "attncourse.rnn_attention.LuongAttention"),
          hint="seed, build one module, read its weights; seed again, build the other. Each tanh input is the "
               "query's part plus the key's part: pair every query with each of its T keys by broadcasting, take "
               "the root mean square over every entry for each module, and divide")
def _init_width():
    """Concat and additive are one function: how much wider does additive's tanh input start, freshly initialised?"""
    cases = []
    for dq, dk, sq, sk in ((64, 64, 1.0, 1.0), (64, 16, 1.0, 0.2), (64, 16, 0.2, 1.0)):
        for seed in (0, 1, 2):
            gen = torch.Generator().manual_seed(200 + seed)
            queries = torch.randn(64, dq, generator=gen, dtype=torch.float64) * sq  # (N, Dq)
            keys = torch.randn(64, 9, dk, generator=gen, dtype=torch.float64) * sk  # (N, T, Dk)
            args = (queries, keys, 32, seed)
            cases.append(Case(f"Dq={dq}, Dk={dk}, query spread {sq}, key spread {sk}, seed {seed}", args,
                              expected=init_width_ratio_reference(*args), rtol=1e-6, atol=1e-9))
    return cases
