"""Checks for chapter 07, causal masks and the KV cache (solutions/07_causal_masks_kv_cache.ipynb)."""

from __future__ import annotations

import math
import re

import torch

from attncourse.kv_cache import KVCache, SinkWindowCache
from attncourse.masks import attention_sink, causal_bottom_right, materialize, materialize_at, sliding_window
from attncourse.masks import causal as masks_causal
from attncourse.positions import alibi_bias_at
from attncourse.sdpa import scaled_dot_product_attention
from attncourse.mha import MultiHeadAttention
from attncourse.positions import sinusoidal_positions
from . import Case, edits, exercise
from .ch07_routes import (_shortcut_cache_mask_tril, _shortcut_cache_mask_aten, _shortcut_cache_mask_numpy, _shortcut_cache_mask_masks, _shortcut_update_kvcache, _shortcut_update_cat, _breaker_update_new_tensors, _breaker_unbounded_cache, _breaker_full_forward, _breaker_recompute_prefix, _breaker_rewrite_decode, _shortcut_dropped_mass_fsdpa)  # noqa: F401

_MASK_FUNCTIONS = ("attncourse.masks.causal_bottom_right", "attncourse.masks.sliding_window",
                   "attncourse.masks.attention_sink", "attncourse.masks.materialize",
                   "attncourse.masks.materialize_at", "attncourse.mha.causal_mask_bottom_right")


# ----------------------------------------------------------------------------- 1. the mask of a cached chunk


def _reference_cache_mask(q_len: int, k_len: int, window: int | None) -> torch.Tensor:
    mod = causal_bottom_right(q_len, k_len)
    if window is not None:  # bottom-right aligned window: shift the queries to their absolute positions
        q_pos = torch.arange(q_len) + (k_len - q_len)  # (Tq,)
        return materialize_at(sliding_window(window), q_pos, torch.arange(k_len))  # (Tq, Tk)
    return materialize(mod, q_len, k_len)  # (Tq, Tk)


@exercise("07-cache-mask", "cache_mask", points=2, category="implement",
          forbid=_MASK_FUNCTIONS + ("torch.tril", "torch.triu", "torch.tril_indices", "torch.triu_indices",
                                    "torch.nn.attention.bias.causal_lower_right", "numpy.tril", "numpy.triu",
                                    "numpy.tri", "numpy.tril_indices", "numpy.triu_indices", "numpy.ma.mask_rowcols"),
          shortcuts=(_shortcut_cache_mask_tril, _shortcut_cache_mask_masks, _shortcut_cache_mask_aten,
                     _shortcut_cache_mask_numpy), allow=(),
          ops=("aten::tril", "aten::triu", "aten::tril_", "aten::triu_", "aten::tril_indices", "aten::triu_indices",
               # a running sum or product of an identity draws the same triangle (review 11: eye().cumsum(0))
               "aten::cumsum", "aten::cumsum_", "aten::cumprod", "aten::cumprod_", "aten::cummax", "aten::cummin",
               "aten::_cummax_helper", "aten::_cummin_helper", "aten::logcumsumexp"),
          prop_doc="a mask is its entries: equality on every alignment and window (wider than Tk, of 1, none) is the "
                   "property",
          hint="the lesson's section 2 shows where the new queries sit among the keys; a window adds one more "
               "condition on the same query-key distances")
def _cache_mask_cases():
    """The (Tq, Tk) mask of a chunk of new queries after a KV cache, with an optional sliding window."""
    gen = torch.Generator().manual_seed(76)  # three more alignments, drawn (a salted grader draws others)
    drawn = []
    for _ in range(3):
        tk = int(torch.randint(2, 24, (1,), generator=gen))
        tq = int(torch.randint(1, tk + 1, (1,), generator=gen))
        drawn.append((tq, tk, int(torch.randint(1, tk + 2, (1,), generator=gen))))
    cases = []
    for tq, tk, w in ((1, 1, None), (1, 7, None), (3, 8, None), (5, 5, None), (2, 13, None), (4, 6, 3),
                      (1, 9, 4), (6, 6, 2), (3, 10, 1), (2, 5, 50), *drawn):
        cases.append(Case(f"Tq={tq}, Tk={tk}, window={w}", (tq, tk, w), expected=_reference_cache_mask(tq, tk, w),
                          compare="equal"))
    return cases


# ----------------------------------------------------------------------------- 2. the cache update


def _cache_cases(gen: torch.Generator) -> list[Case]:
    cases = []
    for name, (b, h, cap, d, filled, t_new) in {"empty cache, prefill of 4": (2, 2, 8, 4, 0, 4),
                                                "3 cached, decode 1": (1, 3, 6, 2, 3, 1),
                                                "5 cached, append 3 to fill it": (2, 1, 8, 4, 5, 3),
                                                "empty cache, a single token": (1, 1, 1, 3, 0, 1)}.items():
        cache = KVCache(b, h, d, cap, dtype=torch.float64)
        old_k, old_v = (torch.randn(b, h, filled, d, generator=gen, dtype=torch.float64) for _ in range(2))
        if filled:
            cache.update(old_k, old_v)
        buf_k, buf_v = cache.k.clone(), cache.v.clone()  # (B, Hkv, capacity, D): what the learner receives
        k_new, v_new = (torch.randn(b, h, t_new, d, generator=gen, dtype=torch.float64) for _ in range(2))
        expected = tuple(t.clone() for t in cache.update(k_new, v_new))  # (B, Hkv, filled + T_new, D) each
        cases.append(Case(name, (buf_k, buf_v, filled, k_new, v_new), expected=expected, compare="equal"))
    return cases


_READS_NOT_WRITES = ("copy_", "index_put_", "index_copy_", "slice_scatter", "select_scatter", "scatter_",
                     "masked_scatter_", "index_fill_", "put_")


def _writes_into(run, label: str) -> bool:
    """Whether the answer wrote into the input `label` in place (an in-place operator whose target is a view of it)."""
    for name, _launch, _helper, tensors in run.trace["ops"]:
        op = name.split("::")[-1].split(".")[0]
        if op.endswith("_") and op in _READS_NOT_WRITES and tensors and tensors[0][0] == label:
            return True
    return False


_VIEWS = re.compile(r"^(view|_unsafe_view|reshape|expand|permute|transpose|t|slice|select|unsqueeze|squeeze|alias|"
                    r"detach|lift_fresh|as_strided|split|split_with_sizes|unbind|chunk|narrow|diagonal|unfold|"
                    r"empty|empty_like|empty_strided|zeros_like|ones_like|full_like|new_empty|new_zeros|new_full|"
                    r"new_ones|sym_size|sym_stride|sym_numel|sym_storage_offset|is_same_size|"
                    r"_has_compatible_shallow_copy_type)$")


def _copies(run, label: str) -> bool:
    """Whether the answer computed anything from (a view of) the input `label` other than writing into it: a clone,
    a product by 1, an addition of 0 all make a new tensor of the cached values, where views are asked for."""
    for name, _launch, _helper, tensors in run.trace["ops"]:
        op = name.split("::")[-1].split(".")[0]
        if _VIEWS.match(op):
            continue
        read = tensors[1:] if op.endswith("_") and op in _READS_NOT_WRITES else tensors  # the write's target aside
        if any(t[0] == label for t in read):
            return True
    return False


def _cache_update_in_place(runs) -> str | None:
    for run in runs:
        copied = [which for which, label in (("keys", "arg0"), ("values", "arg1")) if _copies(run, label)]
        if copied:
            return (f"case '{run.case.name}': your code copies the cache's {' and '.join(copied)}: return views of the "
                    "filled part of the buffers, not copies")
        missing = [which for which, label in (("keys", "arg0"), ("values", "arg1")) if not _writes_into(run, label)]
        if missing:
            return (f"case '{run.case.name}': nothing was written into the cache's own {' and '.join(missing)} buffer: "
                    "a cache allocated once must receive the new entries in place, and what you return must be the "
                    "filled part of those buffers, not new tensors")
    return None


@exercise("07-cache-update", "cache_update", points=2, category="implement",
          forbid=("attncourse.kv_cache.KVCache", "attncourse.kv_cache.SinkWindowCache", "torch.cat", "torch.concat",
                  "torch.concatenate", "torch.stack", "torch.hstack", "torch.dstack"),
          shortcuts=(_shortcut_update_kvcache, _shortcut_update_cat), allow=(), ops=(),
          gradient=False,  # the answer writes into its argument buffers in place: autograd refuses that on leaves
          prop=_cache_update_in_place, breakers=(_breaker_update_new_tensors,),
          prop_doc="the new keys and values are written into the preallocated buffers in place (seen in the trace)",
          hint="the buffers already have room: write the new entries into the slice of the sequence axis that "
               "starts where the filled part ends, then hand back views of the filled part of each buffer "
               "(slicing makes views, not copies)")
def _update():
    """Append new keys and values to preallocated buffers and return everything cached so far."""
    return _cache_cases(torch.Generator().manual_seed(70))


# ----------------------------------------------------------------------------- 3. find the bug


def _decode_reference(state: dict, x: torch.Tensor, n_sink: int, window: int) -> torch.Tensor:
    mha = MultiHeadAttention(16, 4)
    mha.load_state_dict(state)
    t = x.shape[1]
    pe = sinusoidal_positions(t, 16)  # (T, d)
    keep = materialize(attention_sink(n_sink, window), t, t)  # (T, T): sinks + the last `window` keys
    with torch.no_grad():
        return mha(x + pe, attn_mask=keep)  # (B, T, d): the full forward the decode must reproduce


_PRODUCTS = ("mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "mv", "dot", "addmv", "addbmm", "einsum",
             "tensordot", "_scaled_dot_product", "scaled_dot_product")


def _is_product(name: str) -> bool:
    op = name.split("::")[-1].split(".")[0]
    return op.lstrip("_") in _PRODUCTS or "scaled_dot_product" in op or "attention" in op


def _one_token_per_step(runs) -> str | None:
    """Every matrix product with a projection weight that the answer (or the model it calls) runs sees one token per
    sequence: the other operand, with its model-wide axis (d_model = 16), holds at most B rows. Products inside
    attention (scores, weights times values) hold the cached keys and are not counted."""
    for run in runs:
        state, x = run.case.args[:2]
        b, t, d = x.shape
        if t == 1:
            continue
        weights = {tuple(v.shape) for v in state.values()} | {tuple(v.shape[::-1]) for v in state.values()}
        for name, _launch, _helper, tensors in run.trace["ops"]:
            if not _is_product(name) or not any(tuple(shape) in weights for _l, _o, shape, _s in tensors):
                continue
            for _label, _offset, shape, _stride in tensors:
                if tuple(shape) in weights or d not in shape[-2:]:
                    continue
                rows = math.prod(shape) // d
                if rows > b:
                    return (f"case '{run.case.name}': a matrix product ran on {rows // b} tokens of each sequence at "
                            "once; a decode step sees only its own new token (the earlier ones are in the cache)")
    return None


_HEADS = 4  # the exercise's MultiHeadAttention(16, 4): head_dim 4


def _keys_held(shape, head_dim: int = 16 // _HEADS) -> int:
    """Keys per head in a (B, H, S, head_dim) tensor, or its transpose (B, H, head_dim, S); 0 for other shapes."""
    if len(shape) < 4 or shape[-3] != _HEADS:
        return 0
    if shape[-1] == head_dim:
        return shape[-2]
    if shape[-2] == head_dim:
        return shape[-1]
    return 0


def _bounded_cache(runs) -> str | None:
    """The decode's memory stays bounded: no per-head key/value tensor the answer (or the model and cache it calls)
    touches holds more than n_sink + window positions, however long the stream (seen in the trace)."""
    for run in runs:
        state, x, n_sink, window = run.case.args
        bound = n_sink + window
        for name, _launch, _helper, tensors in run.trace["ops"]:
            held = max((_keys_held(shape) for _l, _o, shape, _s in tensors), default=0)
            if held > bound:
                return (f"case '{run.case.name}': a key/value tensor of {held} positions per head ran through "
                        f"{name}, where a sink + window cache holds at most n_sink + window = {bound}: the memory "
                        "of the decode must stay bounded however long the stream is")
    return None


def _calls_no_helper(runs) -> str | None:
    """The answer's own text holds the fix: it calls no function defined in the notebook. Without this, the given
    decode left unchanged and the helper it calls redefined elsewhere would pass with 0 tokens edited (review 11),
    the edit judge never seeing the fix."""
    trace = runs[0].trace if runs else None
    source = trace.get("source") if isinstance(trace, dict) else None
    if isinstance(source, str) and "decode_step" in {t for t, _ in edits.tokens(source)}:
        return ("`decode_fixed` calls decode_step, a function written elsewhere in the notebook: the check judges "
                "decode_fixed's own text, so it must call no code written elsewhere; put the step's line in the "
                "loop, as a small edit of the given decode")
    return None


def _decode_props(runs) -> str | None:
    return _one_token_per_step(runs) or _bounded_cache(runs) or _calls_no_helper(runs)


# The given function exactly as the exercise notebook shows it (tests/test_edits.py compares the two). Its mistake is
# in the one-line helper it calls; the fix in decode_fixed is the loop line, the helper's line written there (a
# redefined decode_step is refused: the fix would be in code the edit judge does not read).
BUGGY_DECODE = '''\
def decode_buggy(state, x, n_sink, window):
    B, T, d = x.shape
    mha = MultiHeadAttention(d, 4)
    mha.load_state_dict(state)
    cache = SinkWindowCache(B, 4, d // 4, window=window, n_sink=n_sink)
    with torch.no_grad():
        return torch.cat([decode_step(mha, x[:, t:t + 1], cache) for t in range(T)], dim=1)
'''
FIX_DECODE = edits.SmallEdit(BUGGY_DECODE, most=12, lines=(7,),
                             names=("PE", "kv_cache", "seen", "sinusoidal_positions"))


@exercise("07-find-the-bug-1", "decode_fixed", points=2, category="bug", aliases=("07-decode-bug",),
          allow=("attncourse.mha.MultiHeadAttention", "attncourse.kv_cache.SinkWindowCache",
                 "attncourse.kv_cache.KVCache", "attncourse.positions.sinusoidal_positions"),
          ops=("attention",), prop=edits.prop(FIX_DECODE, "`decode_fixed`", also=_decode_props),
          breakers=(_breaker_full_forward, _breaker_recompute_prefix, _breaker_unbounded_cache,
                    _breaker_rewrite_decode),
          prop_doc="a decode step is fed one new token per sequence (every matrix product sees B rows, seen in the "
                   "trace); the cache holds the rest, and never more than n_sink + window positions per head (no "
                   "key/value tensor in the trace is longer), so memory stays bounded however long the stream; and "
                   "the diagnosis: the answer is the given decode with a small edit where it goes wrong (a decode "
                   "written afresh does not show the bug was found)",
          bug_words=("live keys instead", "keys it holds", "keys held", "keys the cache holds",
                     "number of keys in the cache", "stops counting", "stays at n_sink",
                     "frozen position", "position freezes", "position stops", "same position once",
                     "tokens held", "held, not", "not the number of tokens", "tokens seen so far", "cache.seen",
                     "len(cache) is not", "len(cache) counts", "len(cache) stops", "len(cache) caps",
                     "evicted tokens", "once it evicts", "counts only the"),
          title="Fix a token-by-token decode that passes its author's test",
          hint="its author tested a stream shorter than the cache's bound: try longer ones, and compare, step by step, "
               "what the loop adds to each token's input with what the full forward adds to the same token")
def _decode_bug():
    """Fix a token-by-token decode through a sink + window cache that disagrees with the full forward."""
    gen = torch.Generator().manual_seed(71)
    cases = []
    for b, n_sink, window, extra in ((1, 2, 4, 0), (2, 2, 4, 7), (3, 0, 3, 5), (1, 4, 2, 9), (2, 1, 1, 3)):
        t = n_sink + window + extra + (int(torch.randint(0, 3, (1,), generator=gen)) if extra else 0)  # 0: no eviction
        with torch.random.fork_rng():  # fresh weights without touching the notebook's global RNG
            torch.manual_seed(int(torch.randint(0, 10_000, (1,), generator=gen)))
            state = {k: v.clone() for k, v in MultiHeadAttention(16, 4).state_dict().items()}
        x = torch.randn(b, t, 16, generator=gen)
        cases.append(Case(f"B={b}, T={t}, n_sink={n_sink}, window={window}", (state, x, n_sink, window),
                          expected=_decode_reference(state, x, n_sink, window), rtol=1e-4, atol=1e-5))
    return cases


# ----------------------------------------------------------------------------- 4. sink + window eviction


def _visible_to_next(pos: torch.Tensor, n_sink: int, window: int) -> torch.Tensor:
    """(S,) bool: may the next query (at position max(pos) + 1) attend to each key position in `pos`?"""
    nxt = (pos.max() + 1).view(1)  # (1,) the next query's absolute position
    return materialize_at(attention_sink(n_sink, window), nxt, pos)[0]  # (S,)


@exercise("07-sink-eviction", "sink_window_keep", points=2, category="implement",
          forbid=_MASK_FUNCTIONS + ("attncourse.kv_cache.SinkWindowCache",),
          shortcuts=(_visible_to_next,), allow=(), ops=(),
          prop_doc="a keep mask is its entries: equality on windows, sinks, gaps and more sinks than keys is the property",
          hint="work out from the lesson's section 5 which keys the next query may attend to, then ask whether any "
               "later query could see a key that the next one cannot")
def _evict():
    """Which cached positions a sink + window cache must keep after an update (bool (S,) mask)."""
    gen = torch.Generator().manual_seed(77)  # three more caches, drawn (a salted grader draws others)
    drawn = []
    for _ in range(3):
        n_sink, window = int(torch.randint(0, 5, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
        newest = int(torch.randint(n_sink + window, 200, (1,), generator=gen))
        older = torch.randperm(newest, generator=gen)[:int(torch.randint(3, 12, (1,), generator=gen))]
        recent = range(max(newest - window - int(torch.randint(0, 4, (1,), generator=gen)), 0), newest + 1)
        drawn.append((sorted({*older.tolist(), *range(n_sink), *recent}), n_sink, window))
    cases = []
    for positions, n_sink, window in (([0, 1, 2, 3, 4, 5], 0, 3), ([0, 1, 2, 3, 4, 5, 6, 7, 8], 2, 4),
                                      ([0, 1, 5, 6, 7, 8], 2, 4), ([0, 3, 4, 5], 1, 1), ([0, 1, 2], 4, 2),
                                      ([0, 1, 2, 3, 96, 97, 98, 99, 100], 4, 5), *drawn):
        pos = torch.tensor(positions)
        # a key is kept iff the next query (hence every later one) may still attend to it
        cases.append(Case(f"positions {positions}, n_sink={n_sink}, window={window}", (pos, n_sink, window),
                          expected=_visible_to_next(pos, n_sink, window), compare="equal"))
    return cases


# exercise 5 (predict the sizes): ch07_predict.py


# ----------------------------------------------------------------------------- 6. experiment


def window_dropped_mass(q: torch.Tensor, k: torch.Tensor, window: int, slope: float) -> float:
    """Reference: the mean over the queries `q` (T, D) of the full-causal attention weight over the keys `k`
    (T, D), with the ALiBi bias of slope `slope`, that a sliding window of `window` keys would drop.

    Built from the course's attention, ALiBi bias and masks, which the answer may not call: a transcription of this
    reference is refused (review 11)."""
    pos = torch.arange(q.shape[0])  # (T,)
    bias = alibi_bias_at(torch.tensor([float(slope)], dtype=q.dtype), pos, pos)[0]  # (T, T): slope * (j - i)
    causal = materialize(masks_causal, q.shape[0], q.shape[0])  # (T, T)
    _, weights = scaled_dot_product_attention(q, k, q, bias.masked_fill(~causal, float("-inf")), return_weights=True)
    inside = materialize(sliding_window(window), q.shape[0], q.shape[0])  # (T, T): what the window keeps
    return float(weights.masked_fill(inside, 0.0).sum(-1).mean())


def _dropped_mass_cases():
    cases = []
    for seed in (0, 1, 2):
        gen = torch.Generator().manual_seed(700 + seed)
        for t, w, m in ((64, 8, 0.0), (64, 8, 0.25), (64, 16, 1 / 64), (40, 4, 1 / 16)):
            q, k = (torch.randn(t, 16, generator=gen, dtype=torch.float64) for _ in range(2))  # (T, 16) each
            cases.append(Case(f"seed={seed}, T={t}, window={w}, slope={m:g}", (q, k, w, m),
                              expected=window_dropped_mass(q, k, w, m), rtol=1e-6, atol=1e-9))
    gen = torch.Generator().manual_seed(710)
    q, k = (torch.randn(48, 16, generator=gen, dtype=torch.float64) ** 3 for _ in range(2))  # heavy tails
    cases.append(Case("cubed normal queries and keys, T=48, window=6, slope=0.125", (q, k, 6, 0.125),
                      expected=window_dropped_mass(q, k, 6, 0.125), rtol=1e-6, atol=1e-9))
    return cases


@exercise("07-window-dropped-mass", "dropped_mass", points=2, category="experiment", allow=(),
          forbid=("torch.nn.functional.scaled_dot_product_attention",), ops=("attention",),
          shortcuts=(_shortcut_dropped_mass_fsdpa,),
          hint="chapter 06 gives the ALiBi bias and the lesson's section 5 the window; the weights to add up are "
               "those of full causal attention, on the keys the window would not let the query see")
def _dropped_mass():
    """Measure how much full-causal attention a sliding window throws away, per ALiBi slope, over seeds."""
    return _dropped_mass_cases()


# ----------------------------------------------------------------------------- 6b. experiment: the study itself


def dropped_mass_study_reference(seq_len: int, slopes: tuple[float, ...], windows: tuple[int, ...],
                                 seeds: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the study of exercise 6, inputs drawn as the exercise says (per seed,
    ``q, k = torch.randn(2, seq_len, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)``):
    (the dropped weight, float64 (slopes, seeds, windows); its mean over seeds, (slopes, windows))."""
    draws = {}
    for seed in seeds:  # one generator per seed, q then k
        draws[seed] = torch.randn(2, seq_len, 16, generator=torch.Generator().manual_seed(seed),
                                  dtype=torch.float64).unbind(0)
    per_slope = [[[window_dropped_mass(*draws[seed], w, slope) for w in windows] for seed in seeds] for slope in slopes]
    dropped = torch.tensor(per_slope, dtype=torch.float64)  # (slopes, seeds, windows)
    return dropped, dropped.mean(dim=1)


def _dropped_study_close(got, expected):
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, torch.Tensor) for x in got)):
        return f"expected (table, mean), two tensors, got {type(got).__name__}"
    table, mean = got
    if tuple(table.shape) != tuple(expected[0].shape):
        return (f"table has shape {tuple(table.shape)}, expected (slopes, seeds, windows) = "
                f"{tuple(expected[0].shape)}, in the order given")
    if not torch.allclose(table.double(), expected[0], rtol=1e-6, atol=1e-9):
        return ("some dropped weights are not what the same measurement gives here: draw q and k exactly as the "
                "exercise says, one generator per seed")
    if tuple(mean.shape) != tuple(expected[1].shape) or not torch.allclose(mean.double(), expected[1], rtol=1e-6,
                                                                            atol=1e-9):
        return "the mean over seeds is not the mean of your own table"
    return None


@exercise("07-window-dropped-study", "dropped_mass_study", points=1, category="experiment", allow=(),
          hint="one generator per seed, q and k drawn together as the exercise says; your dropped_mass for every "
               "slope, seed and window, stacked in that order; the mean is over the seeds")
def _dropped_study():
    """The measurement of exercise 6 as a function of its design: the dropped weight per slope, seed and window."""
    return [Case(f"T={t}, slopes {m}, windows {w}, seeds {s}", (t, m, w, s),
                 expected=dropped_mass_study_reference(t, m, w, s), compare=_dropped_study_close)
            for t, m, w, s in ((64, (0.25, 0.0625), (4, 16), (0, 1, 2)),
                               (48, (0.5, 0.125, 1 / 32), (2, 8, 24), (3, 4, 5, 6)))]
