"""Checks for chapter 06, positions: sinusoidal, ALiBi, RoPE (solutions/06_positions_alibi.ipynb)."""

from __future__ import annotations

import math

import torch

from attncourse.masks import causal_bottom_right, materialize
from attncourse.positions import (alibi_bias, alibi_bias_at, alibi_slopes, apply_rope, grouped_alibi_bias,
                                  rope_permutation)
from . import Case, edits, exercise
from .predictions import NOT_RIGHT


def _slopes_reference(n_heads: int, max_bias: float) -> torch.Tensor:
    """Press et al.'s rule with the 8 replaced by `max_bias`, in MPT's form (``gen_slopes``): the slopes of the next
    power of two, even-numbered ones first (those are the power-of-two slopes), then odd-numbered ones."""
    n = 2 ** math.ceil(math.log2(n_heads))
    slopes = 2.0 ** (-torch.arange(1, n + 1, dtype=torch.float64) * max_bias / n)  # (n,)
    if n != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[0::2]])[:n_heads]
    return slopes.float()


def _slopes_from_bias(n_heads, max_bias=8.0):  # read back off the course's bias: entry (h, 1, 0) is minus slope h
    return -alibi_bias(n_heads, 2)[:, 1, 0]


def _slopes_by_library_rescaled(n_heads, max_bias=8.0):  # the course's slopes raised to max_bias / 8: the right
    return alibi_slopes(n_heads) ** (max_bias / 8.0)       # numbers, reached through the library


# The given functions exactly as the exercise notebook shows them (tests/test_edits.py compares the two).
BUGGY_SLOPES = '''\
def slopes_buggy(n_heads, max_bias=8.0):
    p = 2 ** round(math.log2(n_heads))                        # the closest power of two to n_heads
    base = 2 ** (-max_bias / p)
    slopes = [base ** k for k in range(1, p + 1)][:n_heads]   # the slopes of p heads, one per head
    if p < n_heads:
        extra_base = 2 ** (-max_bias / (2 * p))               # the slopes of 2p heads are powers of this one
        slopes += [extra_base ** k for k in range(1, 2 * (n_heads - p), 2)]  # odd powers fall between the p
    return torch.tensor(slopes)
'''
# 12 tokens: a floor-log2 by bit_length, `1 << (n_heads.bit_length() - 1)`, is a correct fix of line 2; a rewrite (Press
# et al.'s get_slopes, MPT's gen_slopes transcribed) is 100+ tokens away and changes lines other than 2
FIX_SLOPES = edits.SmallEdit(BUGGY_SLOPES, most=12, lines=(2,), names=("floor", "int", "trunc", "bit_length"))

BUGGY_ENCODER = '''\
def encoder_alibi_buggy(n_heads, seq_len):
    pos = torch.arange(seq_len)
    signed = (pos[None, :] - pos[:, None]).float()                  # (T, T): j - i
    before = alibi_slopes(n_heads)[:, None, None] * signed           # (H, T, T): m_h (j - i), right for j <= i
    return torch.where(signed <= 0, before, before.flip(-1))
'''
# the fix may negate `before` or transpose its last two axes (m_h (i - j) for j > i): the names those spellings need;
# or put the stated distance -|j - i| on line 3 (review 13), which leaves the flip unused
FIX_ENCODER = edits.SmallEdit(BUGGY_ENCODER, most=8, lines=(3, 5),
                              names=("abs", "neg", "mT", "transpose", "swapaxes", "swapdims", "movedim", "permute"))


def _breaker_rewrite_slopes(n_heads, max_bias=8.0):
    """Press et al.'s get_slopes with 8 replaced by max_bias, written afresh: right values, refused as no edit of
    the given function."""
    def power_of_two(n):
        return [2 ** (-max_bias * (k + 1) / n) for k in range(n)]

    below = 2 ** math.floor(math.log2(n_heads))
    extra = power_of_two(2 * below)[0::2][:n_heads - below] if below < n_heads else []
    return torch.tensor(power_of_two(below) + extra)


def _breaker_rewrite_encoder(n_heads, seq_len):
    """The bidirectional bias written from its formula without reading the given code: right values, refused."""
    from attncourse.positions import alibi_slopes as slopes_of
    distance = (torch.arange(seq_len)[None, :] - torch.arange(seq_len)[:, None]).abs().float()  # (T, T)
    return -slopes_of(n_heads)[:, None, None] * distance


@exercise("06-find-the-bug-1", "alibi_slopes_fixed", points=2, category="bug", aliases=("06-slopes-bug",),
          forbid=("attncourse.positions.alibi_slopes",), allow=(), ops=(),
          shortcuts=(_slopes_by_library_rescaled, _slopes_from_bias),
          prop=edits.prop(FIX_SLOPES, "`alibi_slopes_fixed`"), trace=False, breakers=(_breaker_rewrite_slopes,),
          prop_doc="the diagnosis: the right slopes for every head count and max_bias, from the engine's function "
                   "with a small edit where it is wrong (Press et al.'s get_slopes written afresh does not show the "
                   "bug was found); every course function that holds the slopes is refused",
          bug_words=("nearest power", "rounds to", "rounded to", "rounds up", "rounded up", "round up",
                     "rounding up", "math.floor", "instead of floor", "floor instead", "log2 rounded",
                     "closest power of two above", "larger power of two"),
          hint="the engine is right at some head counts and wrong at others: list which of 1..40 heads come out "
               "right and look for what those counts share. Press et al.'s get_slopes "
               "(ofirpress/attention_with_linear_biases) and MPT's gen_slopes are the references")
def _slopes():
    """Fix an engine's ALiBi slope function so that it works for every head count and max_bias."""
    configs = [(1, 8.0), (6, 8.0), (12, 8.0), (8, 4.0), (12, 4.0), (20, 16.0), (24, 6.0), (33, 8.0)]
    gen = torch.Generator().manual_seed(64)  # two more, drawn (a salted grader draws others)
    configs += [(int(torch.randint(3, 49, (1,), generator=gen)), float(torch.randint(2, 17, (1,), generator=gen)))
                for _ in range(2)]
    return [Case(f"{h} heads, max_bias {b:g}", (h, b), expected=_slopes_reference(h, b), rtol=1e-6, atol=1e-8)
            for h, b in configs]


def _shortcut_decode_bias(n_heads, q_len, k_len):
    keep = materialize(causal_bottom_right(q_len, k_len), q_len, k_len)
    return alibi_bias(n_heads, q_len, k_len).masked_fill(~keep, float("-inf"))


@exercise("06-decode-bias", "decode_alibi_bias", points=2, category="implement",
          forbid=("attncourse.positions.alibi_bias", "attncourse.positions.alibi_bias_at",
                  "attncourse.positions.materialize_bias", "attncourse.positions.alibi_score_mod"),
          shortcuts=(_shortcut_decode_bias,), allow=("attncourse.positions.alibi_slopes",), ops=(),
          prop_doc="output equality is the property: the bias is a tensor formula given the slopes (which the "
                   "learner may use); every course function that builds a bias or a mask of positions is refused",
          hint="the queries are the newest q_len of the k_len positions: what is the absolute position of query "
               "i? Then the bias is the head's slope times the signed distance, and keys in the query's future get "
               "minus infinity")
def _decode_bias():
    """ALiBi bias plus causal mask for Tq queries at the end of Tk cached positions, as (H, Tq, Tk)."""
    configs = [(4, 1, 6), (8, 3, 7), (6, 5, 5), (12, 2, 9)]
    gen = torch.Generator().manual_seed(65)  # two more, drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    for _ in range(2):
        tq = pick(1, 6)
        configs.append((pick(1, 16), tq, tq + pick(0, 10)))
    cases = []
    for h, tq, tk in configs:
        keep = materialize(causal_bottom_right(tq, tk), tq, tk)
        expected = alibi_bias(h, tq, tk).masked_fill(~keep, float("-inf"))
        cases.append(Case(f"H={h}, Tq={tq}, Tk={tk}", (h, tq, tk), expected=expected, rtol=1e-6, atol=1e-7))
    return cases


def _shortcut_grouped_alibi(scores, n_heads):
    b, hkv, g, tq, tk = scores.shape
    return scores + grouped_alibi_bias(n_heads, hkv, tq, tk).to(scores.dtype)


@exercise("06-grouped-alibi", "add_grouped_alibi", points=2, category="implement",
          forbid=("attncourse.positions.grouped_alibi_bias",), shortcuts=(_shortcut_grouped_alibi,),
          allow=("attncourse.positions.alibi_slopes",), ops=(),
          prop_doc="output equality is the property: which query head gets which slope is all there is to get "
                   "right, and every course function that builds a bias is refused (the slopes are allowed)",
          hint="query heads of one group are consecutive (the order of repeat_kv): which query head is member r of "
               "group g, and so which slope must its scores get?")
def _grouped():
    """Add ALiBi to grouped GQA scores (B, Hkv, G, Tq, Tk) so each query head keeps its own slope."""
    gen = torch.Generator().manual_seed(60)
    cases = []
    for b, h, hkv, tq, tk in ((2, 8, 2, 5, 5), (1, 12, 4, 1, 7), (2, 6, 1, 3, 6)):
        scores = torch.randn(b, hkv, h // hkv, tq, tk, generator=gen, dtype=torch.float64)
        expected = scores + grouped_alibi_bias(h, hkv, tq, tk).double()
        cases.append(Case(f"H={h}, Hkv={hkv}, Tq={tq}, Tk={tk}", (scores, h), expected=expected))
    return cases


def weight_entry_reference(n_heads: int, head: int, query: int, key: int) -> float:
    """Weight head `head` of `n_heads` puts on `key` from `query` under the causal ALiBi bias alone (every content
    score equal): softmax of row `query` of alibi_bias(n_heads, query + 1), at `key`. The checker's reference."""
    row = alibi_bias(n_heads, query + 1)[head, query].double()  # (query + 1,): keys 0..query
    return torch.softmax(row, dim=-1)[key].item()


def _close_whole(got, expected) -> str | None:
    """Right or not for a rule returning a number (to 1e-4 relative: the package's slopes are float32)."""
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return f"expected a number (the attention weight), got {type(got).__name__}"
    return None if math.isclose(got, expected, rel_tol=1e-4, abs_tol=1e-7) else NOT_RIGHT


@exercise("06-predict-bias", "predicted_weight", points=1, category="predict",
          forbid=("attncourse.positions.alibi_slopes", "attncourse.positions.alibi_bias",
                  "attncourse.positions.alibi_bias_at", "attncourse.positions.grouped_alibi_bias"),
          allow=(), ops=("torch",),
          prop_doc="the prediction is written as a rule of (n_heads, head, query, key) in plain numbers, judged on "
                   "the three weights the exercise names and on weights drawn from a seed (head counts that are not "
                   "powers of two among them; the grader draws others), with no tensor operator and no course code "
                   "allowed: the package's slopes and bias, the checker's reference and a table of the three named "
                   "weights cannot stand in for it. One drawn query is a billion tokens in, so a softmax of the bias "
                   "row computed key by key in plain Python (a measurement, not a rule) cannot finish",
          hint="the weights of one row come from the biases of that row alone, and those biases are the slope "
               "times a whole number of steps back: how does the weight of a key compare with the weight of the key "
               "one step closer, and what must the weights of a row add up to?")
def _predict():
    """Predict an ALiBi attention weight on equal content scores, as a rule of (n_heads, head, query, key)."""
    configs = [(8, 0, 3, 3), (8, 7, 5, 2), (12, 8, 4, 0)]
    gen = torch.Generator().manual_seed(63)  # four more entries, drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    for k in range(4):
        n_heads = pick(3, 40)
        while k < 3 and n_heads & (n_heads - 1) == 0:  # three of them not a power of two
            n_heads = pick(3, 40)
        closest = 2 ** int(math.log2(n_heads))
        head = pick(closest, n_heads - 1) if k < 2 else pick(0, n_heads - 1)  # two past the closest power of two
        query = pick(1, 40)
        configs.append((n_heads, head, query, pick(max(0, query - 8), query)))  # keys near the query: weights > 1e-7
    def by_series(h, hd, q, k):  # the same weight without the row: a geometric series, in local names only
        r = math.exp(-float(alibi_slopes(h)[hd]))
        return r ** (q - k) * (1 - r) / (1 - r ** (q + 1))

    cases = []
    for i, (h, hd, q, k) in enumerate(configs):
        expected = weight_entry_reference(h, hd, q, k)
        assert math.isclose(expected, by_series(h, hd, q, k), rel_tol=1e-6), (h, hd, q, k)
        cases.append(Case(f"{'drawn: ' if i >= 3 else ''}{h} heads: head {hd}, query {q}, key {k}", (h, hd, q, k),
                          expected=expected, compare=_close_whole))
    n_heads = pick(3, 40)  # a query a billion tokens in: no row can be built or summed key by key, a rule still works
    head, query = pick(0, n_heads - 1), pick(10 ** 9, 2 * 10 ** 9)
    key = query - pick(0, 6)
    cases.append(Case(f"drawn: {n_heads} heads: head {head}, query {query:,}, key {key:,}", (n_heads, head, query, key),
                      expected=by_series(n_heads, head, query, key), compare=_close_whole))
    return cases


def _shortcut_rope_pairs(x, positions, base):
    return apply_rope(x, positions[:, None], base=base, interleaved=True)  # (B, T) -> (B, 1, T): one row per sequence


def _shortcut_rope_complex(x, positions, base):
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    rot = torch.polar(torch.ones_like(theta), positions.double()[:, None, :, None] * theta)
    return torch.view_as_real(z * rot).flatten(-2).to(x.dtype)


def _shortcut_rope_complex_scalar(x, positions, base):  # complex numbers without view_as_complex
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.exp(1j * positions.double()[:, None, :, None] * theta)  # (B, 1, T, D/2) complex
    z = (x[..., 0::2].double() + 1j * x[..., 1::2].double()) * rot
    return torch.stack([z.real, z.imag], dim=-1).flatten(-2).to(x.dtype)


# The guard's family "complex": any operator on a complex tensor, number or dtype, a dtype view included
# (test_rope_pairs_refuses_complex_dtype_view).


def _rope_pairs_reference(x, positions, base):
    """Sequence by sequence with the course's pairs layout: no broadcasting to get wrong."""
    return torch.stack([apply_rope(x[b], positions[b], base=base, interleaved=True) for b in range(x.shape[0])])


@exercise("06-rope-pairs", "rope_pairs", points=3, category="implement",
          forbid=("attncourse.positions.apply_rope", "torch.view_as_complex", "torch.polar", "torch.complex"),
          shortcuts=(_shortcut_rope_pairs, _shortcut_rope_complex, _shortcut_rope_complex_scalar), allow=(),
          ops=("complex",),
          prop_doc="output equality with real arithmetic is the property: every way into or out of complex numbers "
                   "(view_as_complex, polar, complex, view_as_real behind .real, a dtype view to a complex dtype, any "
                   "operator on a complex tensor) is refused as an operator. What passing proves: the pairs layout "
                   "(dims 2i, 2i+1 at base^(-2i/D)) and per-sequence position ids (B, T) broadcast over the heads of "
                   "x (B, H, T, D); the course's apply_rope takes one row of positions for every head as written, "
                   "and a batch with as many sequences as heads catches positions broadcast over the heads instead. "
                   "A renamed copy of the course's halves rotation on permuted dims, its positions broadcast per "
                   "sequence, also passes: it needs the same two facts",
          hint="dims 2i and 2i+1 form pair i. Which frequency does pair i turn at, what does a 2-D rotation by an angle "
               "do to the two numbers of a pair, and which axis of x must a sequence's positions line up with?")
def _rope_pairs():
    """RoPE in the paper's (and Meta LLaMA's) layout, pairs of neighbouring dims in real arithmetic, for a batch
    whose sequences have their own position ids (left padding, packed documents, a cache at different lengths)."""
    gen = torch.Generator().manual_seed(61)
    cases = []
    for name, (shape, rows, base) in {
            "(2, 3, 7, 8): a plain row and a left-padded one, base 10000":
                ((2, 3, 7, 8), [list(range(7)), [1, 1, 1, 0, 1, 2, 3]], 10000.0),
            "(3, 2, 5, 16) at 100..104, two packed documents, left padding; base 500000":
                ((3, 2, 5, 16), [list(range(100, 105)), [0, 1, 2, 0, 1], [1, 1, 0, 1, 2]], 500000.0),
            "(4, 4, 6, 8): as many sequences as heads, each at its own offset":
                ((4, 4, 6, 8), [list(range(o, o + 6)) for o in (0, 9, 30, 2)], 10000.0),
            "(1, 2, 1, 4): one token at position 41": ((1, 2, 1, 4), [[41]], 10000.0)}.items():
        x = torch.randn(*shape, generator=gen, dtype=torch.float64)
        pos = torch.tensor(rows)
        cases.append(Case(name, (x, pos, base), expected=_rope_pairs_reference(x, pos, base), rtol=1e-7, atol=1e-9))
    return cases


def _shortcut_convert(w, n_heads):
    d = w.shape[0] // n_heads
    return w.view(n_heads, d, -1)[:, rope_permutation(d)].reshape(w.shape)


@exercise("06-rope-convert", "pairs_to_halves_weight", points=2, category="implement",
          forbid=("attncourse.positions.rope_permutation",), shortcuts=(_shortcut_convert,), allow=(), ops=(),
          prop_doc="output equality is the property: a row permutation judged exactly; the course's permutation is "
                   "refused",
          hint="a row of W_q is one output dim of one head; in the halves layout, where must the two dims of pair i "
               "of a head go? Permute rows within each head, never across heads")
def _rope_convert():
    """Turn a pairs-layout W_q (or W_k) into a halves-layout one giving the same attention scores."""
    gen = torch.Generator().manual_seed(62)
    cases = []
    for h, d, d_model in ((4, 8, 32), (2, 16, 12), (1, 4, 4)):
        w = torch.randn(h * d, d_model, generator=gen, dtype=torch.float64)
        cases.append(Case(f"{h} heads of {d}, d_model {d_model}", (w, h), expected=_shortcut_convert(w, h),
                          compare="equal"))
    return cases


def _encoder_bias_reference(n_heads: int, seq_len: int) -> torch.Tensor:
    pos = torch.arange(seq_len)
    return -alibi_bias_at(alibi_slopes(n_heads), pos, pos).abs()  # (H, T, T)


def _encoder_by_abs(n_heads, seq_len):  # the course's decoder bias, its sign folded
    return -alibi_bias(n_heads, seq_len).abs()


def _encoder_by_bias_at(n_heads, seq_len):
    return _encoder_bias_reference(n_heads, seq_len)


@exercise("06-find-the-bug-2", "encoder_alibi_bias", points=2, category="bug", aliases=("06-encoder-alibi",),
          allow=("attncourse.positions.alibi_slopes",), ops=(), shortcuts=(_encoder_by_abs, _encoder_by_bias_at),
          prop=edits.prop(FIX_ENCODER, "`encoder_alibi_bias`"), trace=False, breakers=(_breaker_rewrite_encoder,),
          prop_doc="the diagnosis: the right bias for every query of several lengths, from the notes' function with "
                   "a small edit where it is wrong (the bias written afresh from its formula does not show the bug "
                   "was found); every course function that builds a bias is refused",
          bug_words=("flipped", "flips the", "mirror", "reversed", "reverses", "reverse the", "wrong axis", "wrong dim",
                     "only the middle", "middle row only", "seq_len - 1", "T - 1 - j", "T-1-j"),
          hint="printing one row of one head proves little: the bias should depend on the distance from the query "
               "to the key and on nothing else; test that on every query of a few sentence lengths")
def _encoder_alibi():
    """Fix the notes' bidirectional ALiBi bias for an encoder's self-attention (every query sees every key)."""
    gen = torch.Generator().manual_seed(66)  # two more, drawn (a salted grader draws others)
    configs = [(8, 6), (12, 5), (1, 3), (4, 9)]
    configs += [(int(torch.randint(1, 17, (1,), generator=gen)), int(torch.randint(2, 13, (1,), generator=gen)))
                for _ in range(2)]
    return [Case(f"{h} heads, {t} tokens", (h, t), expected=_encoder_bias_reference(h, t), rtol=1e-6, atol=1e-7)
            for h, t in configs]


ROPE_DISTANCES = (0, 1, 4, 16, 64, 256, 1024)


def rope_similarity_reference(seed: int, base: float) -> torch.Tensor:
    """Mean over 512 seeded vectors of q_m . q_0 / |q|^2 (RoPE, halves layout, D = 64) at each distance m."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(512, 64, generator=gen, dtype=torch.float64)  # (N, D)
    out = []
    for m in ROPE_DISTANCES:
        rotated = apply_rope(q[:, None], torch.tensor([m]), base=base)[:, 0]  # (N, 1, D) -> (N, D)
        out.append(((rotated * q).sum(-1) / (q * q).sum(-1)).mean())
    return torch.stack(out)


@exercise("06-rope-decay", "rope_similarity", points=2, category="experiment",
          allow=("attncourse.positions.apply_rope",),
          hint="draw the vectors once from a generator seeded with the seed; a key equal to the query sits at "
               "position 0 and the query at position m, so only the query is rotated; average the normalised score")
def _rope_decay():
    """How fast does RoPE's score between a query and a key with the same content fall with their distance?"""
    return [Case(f"seed {seed}, base {base:g}", (seed, base), expected=rope_similarity_reference(seed, base),
                 rtol=1e-6, atol=1e-9) for seed in (0, 1, 2) for base in (10000.0, 100.0)]
