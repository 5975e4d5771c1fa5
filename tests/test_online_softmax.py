"""Online softmax and one-pass attention against torch.softmax, torch.logsumexp and both SDPAs."""

import functools
import math
import random

import pytest
import torch
import torch.nn.functional as F

from attncourse import (AttentionState, SoftmaxState, finalize_attention_state, logsumexp_from_state,
                        merge_attention_states, merge_softmax_states, naive_softmax, one_pass_softmax,
                        online_attention, online_attention_update, online_softmax_state, online_softmax_trace,
                        scaled_dot_product_attention, softmax_state, three_pass_softmax, two_pass_softmax)

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6),
       torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
SOFTMAXES = [three_pass_softmax, two_pass_softmax, one_pass_softmax]
NEG_INF = float("-inf")


def rand(*shape, dtype=torch.float64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def torch_softmax_zero_rows(x, dim):
    """torch.softmax, with the NaN of fully -inf rows replaced by the zeros the course returns."""
    return torch.nan_to_num(torch.softmax(x.double(), dim=dim), nan=0.0)


# ----------------------------------------------------------------------------- naive softmax


def test_naive_softmax_is_softmax_for_small_inputs():
    x = rand(4, 9)
    torch.testing.assert_close(naive_softmax(x), torch.softmax(x, -1), **TOL[torch.float64])
    torch.testing.assert_close(naive_softmax(x, dim=0), torch.softmax(x, 0), **TOL[torch.float64])


@pytest.mark.parametrize("dtype, big", [(torch.float32, 100.0), (torch.float16, 12.0)])
def test_naive_softmax_overflows_where_safe_softmax_does_not(dtype, big):
    x = torch.tensor([1.0, 2.0, big], dtype=dtype)
    assert torch.isnan(naive_softmax(x)).any()
    for f in SOFTMAXES:
        out = f(x)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, torch.softmax(x.double(), 0).to(dtype), **TOL[dtype])


# ----------------------------------------------------------------------------- 3-, 2-, 1-pass softmax


@pytest.mark.parametrize("f", SOFTMAXES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape, dim", [((1,), 0), ((7,), -1), ((3, 1), -1), ((4, 13), -1), ((4, 13), 0),
                                        ((2, 3, 17), 1), ((2, 31, 3), -2), ((5, 2, 3, 64), 3)])
@pytest.mark.parametrize("chunk_size", [None, 1, 3, 7, 64, 1000])
def test_softmaxes_match_torch(f, shape, dim, chunk_size):
    x = rand(*shape, scale=3.0)
    out = f(x, dim=dim, chunk_size=chunk_size)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, torch.softmax(x, dim=dim), **TOL[torch.float64])


@pytest.mark.parametrize("f", SOFTMAXES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_softmaxes_dtypes_and_large_values(f, dtype):
    x = (rand(6, 50, scale=30.0) + 500).to(dtype)  # exp(500) overflows every dtype
    out = f(x, chunk_size=7)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), torch.softmax(x.double(), -1), **TOL[dtype])


@pytest.mark.parametrize("f", SOFTMAXES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("chunk_size", [None, 1, 4, 5])
def test_softmaxes_with_neg_inf_and_fully_masked_rows(f, chunk_size):
    x = rand(5, 2, 11, scale=2.0)
    g = torch.Generator().manual_seed(1)
    x[torch.rand(x.shape, generator=g) < 0.4] = NEG_INF
    x[..., 3] = 1.0  # every row keeps one entry...
    x[1, 0] = NEG_INF  # ...except these fully masked rows
    x[4, 1] = NEG_INF
    x[2, 0, :8] = NEG_INF  # a first chunk (of 4 or 5) entirely masked in a live row
    x[2, 0, 9] = 2.0
    out = f(x, chunk_size=chunk_size)
    assert not torch.isnan(out).any()
    assert (out[1, 0] == 0).all() and (out[4, 1] == 0).all()
    assert (out[x == NEG_INF] == 0).all()
    torch.testing.assert_close(out, torch_softmax_zero_rows(x, -1), **TOL[torch.float64])


def test_softmaxes_keep_autograd():
    x = rand(3, 10, scale=2.0).requires_grad_()
    for f in SOFTMAXES:
        w = torch.arange(10, dtype=torch.float64)
        (g,) = torch.autograd.grad((f(x, chunk_size=3) * w).sum(), x)
        (ref,) = torch.autograd.grad((torch.softmax(x, -1) * w).sum(), x)
        torch.testing.assert_close(g, ref, **TOL[torch.float64])


# ----------------------------------------------------------------------------- states and merging


@pytest.mark.parametrize("chunk_size", [None, 1, 2, 7, 10, 64])
@pytest.mark.parametrize("dim", [-1, 0])
def test_online_state_is_max_and_sum(chunk_size, dim):
    x = rand(10, 10, scale=5.0)
    m, l = online_softmax_state(x, dim=dim, chunk_size=chunk_size)
    torch.testing.assert_close(m, x.amax(dim=dim), rtol=0, atol=0)
    torch.testing.assert_close(l, torch.exp(x - x.amax(dim=dim, keepdim=True)).sum(dim=dim), **TOL[torch.float64])
    torch.testing.assert_close(logsumexp_from_state((m, l)), torch.logsumexp(x, dim=dim), **TOL[torch.float64])


def test_state_of_fully_masked_row_and_logsumexp():
    x = rand(3, 6)
    x[1] = NEG_INF
    x[2, :4] = NEG_INF
    for state in (softmax_state(x), online_softmax_state(x, chunk_size=4)):
        assert state.m[1] == NEG_INF and state.l[1] == 0
        lse = logsumexp_from_state(state)
        assert not torch.isnan(lse).any()
        torch.testing.assert_close(lse, torch.logsumexp(x, -1), **TOL[torch.float64])


def test_half_precision_states_are_float32():
    x = rand(4, 33, dtype=torch.float16, scale=4.0)
    state = online_softmax_state(x, chunk_size=8)
    assert state.m.dtype == torch.float32
    torch.testing.assert_close(logsumexp_from_state(state), torch.logsumexp(x.float(), -1), rtol=1e-5, atol=1e-5)


def _random_tree(states, rng):
    """Merge a list of states by a random binary tree: repeatedly merge a random adjacent pair."""
    states = list(states)
    while len(states) > 1:
        i = rng.randrange(len(states) - 1)
        states[i:i + 2] = [merge_softmax_states(states[i], states[i + 1])]
    return states[0]


@pytest.mark.parametrize("seed", range(5))
def test_merge_in_random_orders_and_trees_equals_the_whole(seed):
    x = rand(3, 4, 200, seed=seed, scale=10.0)
    x[0, 0, 50:120] = NEG_INF  # chunks that are fully masked
    x[2, 3] = NEG_INF  # a fully masked row
    whole = softmax_state(x)
    chunks = [softmax_state(c) for c in x.split(23, dim=-1)]  # 23 does not divide 200
    rng = random.Random(seed)
    shuffled = rng.sample(chunks, len(chunks))
    ordered = functools.reduce(merge_softmax_states, shuffled)
    tree = _random_tree(rng.sample(chunks, len(chunks)), rng)
    for got in (ordered, tree):
        torch.testing.assert_close(got.m, whole.m, rtol=0, atol=0)
        torch.testing.assert_close(got.l, whole.l, **TOL[torch.float64])
        torch.testing.assert_close(logsumexp_from_state(got), torch.logsumexp(x, -1), **TOL[torch.float64])


def test_merge_is_associative_and_commutative_with_identity():
    a, b, c = (softmax_state(rand(5, 9, seed=s, scale=20.0)) for s in range(3))
    empty = SoftmaxState(torch.full((5,), NEG_INF, dtype=torch.float64), torch.zeros(5, dtype=torch.float64))
    left = merge_softmax_states(merge_softmax_states(a, b), c)
    right = merge_softmax_states(a, merge_softmax_states(b, c))
    for x, y in ((left, right), (merge_softmax_states(a, b), merge_softmax_states(b, a)),
                 (merge_softmax_states(a, empty), a), (merge_softmax_states(empty, a), a)):
        torch.testing.assert_close(x.m, y.m, **TOL[torch.float64])
        torch.testing.assert_close(x.l, y.l, **TOL[torch.float64])
    both_empty = merge_softmax_states(empty, empty)
    assert (both_empty.m == NEG_INF).all() and (both_empty.l == 0).all()


def test_merge_does_not_overflow():
    a = SoftmaxState(torch.tensor([1e4, -1e4]), torch.tensor([2.0, 3.0]))
    b = SoftmaxState(torch.tensor([1e4 + 1, -1e4 - 50]), torch.tensor([1.0, 1.0]))
    m, l = merge_softmax_states(a, b)
    torch.testing.assert_close(m, torch.tensor([1e4 + 1, -1e4]))
    torch.testing.assert_close(l, torch.tensor([2 * math.exp(-1) + 1, 3 + math.exp(-50)]))


def test_trace_of_a_short_row():
    t = online_softmax_trace(torch.tensor([1.0, 3.0, 2.0, 5.0], dtype=torch.float64))
    e2 = math.exp(-2)
    torch.testing.assert_close(t["running_max"], torch.tensor([1.0, 3.0, 3.0, 5.0], dtype=torch.float64))
    torch.testing.assert_close(t["rescale"], torch.tensor([0.0, e2, 1.0, e2], dtype=torch.float64))
    l1 = 1.0
    l2 = l1 * e2 + 1
    l3 = l2 + math.exp(-1)
    l4 = l3 * e2 + 1
    torch.testing.assert_close(t["running_sum"], torch.tensor([l1, l2, l3, l4], dtype=torch.float64))
    t2 = online_softmax_trace(torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0]), chunk_size=2)
    assert t2["running_max"].tolist() == [3.0, 5.0, 5.0]  # chunks [1, 3], [2, 5], [4]
    torch.testing.assert_close(t2["rescale"], torch.tensor([0.0, math.exp(-2), 1.0]))


# ----------------------------------------------------------------------------- one-pass attention


def make_qkv(lead, tq, tk, d, dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*lead, t, w, generator=g, dtype=torch.float64).to(dtype)
                 for t, w in ((tq, d), (tk, d), (tk, dv)))


def lse_reference(q, k, mask=None, is_causal=False, scale=None):
    s = (q.double() @ k.double().transpose(-2, -1)) * (scale or q.shape[-1] ** -0.5)
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF) if mask.dtype == torch.bool else s + mask.double()
    if is_causal:
        s = s.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), NEG_INF)
    return torch.logsumexp(s, -1)


SHAPES = [  # (lead dims, Tq, Tk, D, Dv)
    ((2, 3), 5, 5, 8, 8),
    ((2, 3), 5, 37, 8, 4),     # Tq != Tk, Dv != D
    ((1, 1), 1, 13, 16, 16),   # one query
    ((3,), 11, 2, 4, 6),       # more queries than keys
    ((), 7, 1, 5, 3),          # one key
    ((2, 2, 2), 3, 130, 8, 8),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 128])
@pytest.mark.parametrize("is_causal", [False, True])
def test_online_attention_matches_both_sdpas(shape, chunk_size, is_causal):
    q, k, v = make_qkv(*shape)
    out, lse = online_attention(q, k, v, is_causal=is_causal, chunk_size=chunk_size)
    assert out.shape == (*shape[0], shape[1], shape[4]) and lse.shape == (*shape[0], shape[1])
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, is_causal=is_causal), **TOL[torch.float64])
    if not (is_causal and shape[1] > shape[2]):  # PyTorch gives NaN on the rows with no key there
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal),
                                   **TOL[torch.float64])
    torch.testing.assert_close(lse, lse_reference(q, k, is_causal=is_causal), **TOL[torch.float64])


@pytest.mark.parametrize("mask_shape", [(5, 9), (1, 1, 5, 9), (2, 1, 1, 9), (2, 3, 5, 9), (5, 1)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_online_attention_masks_with_neg_inf_and_fully_masked_rows(mask_shape, kind):
    q, k, v = make_qkv((2, 3), 5, 9, 8, 6)
    g = torch.Generator().manual_seed(2)
    keep = torch.rand(mask_shape, generator=g) > 0.4
    keep[..., 0, :] = False  # query 0 is fully masked (every mask shape covers it)
    mask = keep if kind == "bool" else torch.zeros(mask_shape, dtype=torch.float64).masked_fill(~keep, NEG_INF)
    if kind == "float":
        mask = mask + 0.5 * torch.randn(mask_shape, generator=g, dtype=torch.float64)  # a bias too
    out, lse = online_attention(q, k, v, mask, chunk_size=4)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[..., 0, :] == 0).all() and (lse[..., 0] == NEG_INF).all()
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, mask), **TOL[torch.float64])
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, mask), **TOL[torch.float64])
    torch.testing.assert_close(lse, lse_reference(q, k, mask), **TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_online_attention_dtypes(dtype):
    q, k, v = make_qkv((2, 4), 9, 70, 16, 16, dtype=dtype)
    keep = torch.ones(9, 70, dtype=torch.bool)
    keep[3] = False
    out, lse = online_attention(q, k, v, keep, chunk_size=16)
    assert out.dtype == dtype and lse.dtype == torch.float32  # half precision is computed in float32
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), keep)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, keep), **TOL[dtype])
    torch.testing.assert_close(lse.double(), lse_reference(q, k, keep), **TOL[dtype])


def test_online_attention_scale_and_broadcast_heads():
    q, _, _ = make_qkv((2, 4), 6, 6, 8, 8)
    _, k, v = make_qkv((2, 1), 6, 10, 8, 8, seed=1)  # one key/value head shared by 4 query heads
    out, lse = online_attention(q, k, v, scale=0.3, chunk_size=3)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k.expand(2, 4, 10, 8), v.expand(2, 4, 10, 8),
                                                                   scale=0.3), **TOL[torch.float64])
    torch.testing.assert_close(lse, lse_reference(q, k, scale=0.3), **TOL[torch.float64])


def test_online_attention_gradients_match_sdpa():
    q, k, v = (t.requires_grad_() for t in make_qkv((2, 2), 5, 11, 4, 3))
    keep = torch.ones(5, 11, dtype=torch.bool).tril(diagonal=3)
    out, lse = online_attention(q, k, v, keep, chunk_size=4)
    w_out, w_lse = torch.randn_like(out), torch.randn_like(lse)
    ours = torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), (q, k, v))
    s = (q @ k.transpose(-2, -1) / 2).masked_fill(~keep, NEG_INF)
    ref_out = F.scaled_dot_product_attention(q, k, v, keep)
    ref = torch.autograd.grad((ref_out * w_out).sum() + (torch.logsumexp(s, -1) * w_lse).sum(), (q, k, v))
    for g, r in zip(ours, ref):
        torch.testing.assert_close(g, r, **TOL[torch.float64])


def _empty_state(lead, tq, dv):
    return AttentionState(torch.full((*lead, tq), NEG_INF, dtype=torch.float64),
                          torch.zeros(*lead, tq, dtype=torch.float64), torch.zeros(*lead, tq, dv, dtype=torch.float64))


def test_update_and_merge_of_attention_states():
    q, k, v = make_qkv((2,), 4, 12, 8, 5)
    s = q @ k.transpose(-2, -1) / math.sqrt(8)  # (2, 4, 12)
    s[:, 1] = NEG_INF  # query 1 sees nothing
    whole = online_attention_update(_empty_state((2,), 4, 5), s, v)
    ref_out = scaled_dot_product_attention(q, k, v, torch.isfinite(s))
    out, lse = finalize_attention_state(whole)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float64])
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), **TOL[torch.float64])
    parts = [online_attention_update(_empty_state((2,), 4, 5), s[..., i:i + 5], v[..., i:i + 5, :])
             for i in range(0, 12, 5)]
    for merged in (functools.reduce(merge_attention_states, parts),
                   merge_attention_states(parts[2], merge_attention_states(parts[0], parts[1]))):
        got_out, got_lse = finalize_attention_state(merged)
        torch.testing.assert_close(got_out, ref_out, **TOL[torch.float64])
        torch.testing.assert_close(got_lse, lse, **TOL[torch.float64])


def test_forgetting_to_rescale_the_accumulator_is_caught():
    """The comparisons above can fail: an update that skips alpha * acc gives a different output."""

    def buggy_update(state, s, v):
        m, l, acc = state
        m_new = torch.maximum(m, s.amax(-1))
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[..., None])
        return AttentionState(m_new, alpha * l + p.sum(-1), acc + p @ v)  # acc is not rescaled

    q, k, v = make_qkv((), 3, 8, 4, 4)
    s = q @ k.transpose(-2, -1) / 2
    s[:, 4:] += 5.0  # the max grows in the second chunk, so the rescale matters
    first = online_attention_update(_empty_state((), 3, 4), s[:, :4], v[:4])
    good = finalize_attention_state(online_attention_update(first, s[:, 4:], v[4:]))[0]
    bad = finalize_attention_state(buggy_update(first, s[:, 4:], v[4:]))[0]
    torch.testing.assert_close(good, torch.softmax(s, -1) @ v, **TOL[torch.float64])
    assert not torch.allclose(bad, good, atol=1e-3)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("f", [naive_softmax, *SOFTMAXES, softmax_state, online_softmax_state],
                         ids=lambda f: f.__name__)
def test_softmax_bad_input(f):
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        f([1.0, 2.0])
    with pytest.raises(TypeError, match="floating-point.*torch.int64"):
        f(torch.arange(4))
    with pytest.raises(ValueError, match=r"dim=2 is out of range for x of shape \(3, 4\)"):
        f(torch.zeros(3, 4), dim=2)
    with pytest.raises(TypeError, match="dim must be an int"):
        f(torch.zeros(3, 4), dim=1.0)
    if f is not naive_softmax:
        with pytest.raises(ValueError, match=r"no entries along dim=-1: shape \(3, 0\)"):
            f(torch.zeros(3, 0))


@pytest.mark.parametrize("f", [*SOFTMAXES, online_softmax_state], ids=lambda f: f.__name__)
def test_bad_chunk_size(f):
    with pytest.raises(ValueError, match="chunk_size must be positive, got 0"):
        f(torch.zeros(3, 4), chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        f(torch.zeros(3, 4), chunk_size=2.5)


def test_merge_and_state_bad_input():
    a = SoftmaxState(torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match=r"a and b must have the same shape, got \(3,\) and \(4,\)"):
        merge_softmax_states(a, SoftmaxState(torch.zeros(4), torch.ones(4)))
    with pytest.raises(ValueError, match=r"b.m and b.l must have the same shape, got \(3,\) and \(2,\)"):
        merge_softmax_states(a, (torch.zeros(3), torch.ones(2)))
    with pytest.raises(TypeError, match="b must be a SoftmaxState"):
        merge_softmax_states(a, torch.zeros(3))
    with pytest.raises(TypeError, match="state.l must be a torch.Tensor"):
        logsumexp_from_state((torch.zeros(3), 1.0))
    with pytest.raises(ValueError, match=r"x must be a 1-D row, got shape \(2, 3\)"):
        online_softmax_trace(torch.zeros(2, 3))


def test_attention_bad_input():
    q, k, v = make_qkv((2,), 4, 6, 8, 8)
    with pytest.raises(ValueError, match=r"query and key must share the last \(head\) dim"):
        online_attention(q, k[..., :5], v)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(4, 5\) does not broadcast to scores \(2, 4, 6\)"):
        online_attention(q, k, v, torch.ones(4, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be bool or floating point, got dtype torch.int64"):
        online_attention(q, k, v, torch.ones(4, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size must be positive, got -1"):
        online_attention(q, k, v, chunk_size=-1)
    with pytest.raises(TypeError, match="query, key and value must share a dtype"):
        online_attention(q, k.float(), v)
    state = _empty_state((2,), 4, 8)
    with pytest.raises(ValueError, match=r"shapes do not fit: m \(2, 4\).*scores \(2, 4, 6\), value \(2, 5, 8\)"):
        online_attention_update(state, torch.zeros(2, 4, 6, dtype=torch.float64), v[:, :5])
    with pytest.raises(TypeError, match="state must be an AttentionState"):
        online_attention_update(state[:2], torch.zeros(2, 4, 6, dtype=torch.float64), v)
    with pytest.raises(ValueError, match=r"a.acc \(2, 4, 8\) and b.acc \(2, 4, 3\)"):
        merge_attention_states(state, _empty_state((2,), 4, 3))


def test_sink_logit_folded_into_the_online_softmax():
    """gpt-oss's sink logit folded once into the running (max, sum), at the start or at finalisation, over chunks
    of keys: the dense reference (sink_softmax_attention) and PyTorch's kernel with one more zero-valued key."""
    import math

    import torch.nn.functional as F

    from attncourse import fold_sink_logit, online_attention
    from attncourse.sink_variants import sink_softmax_attention

    g = torch.Generator().manual_seed(31)
    q = torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64)  # (B, H, Tq, D)
    k, v = (torch.randn(2, 3, 11, 8, generator=g, dtype=torch.float64) for _ in range(2))  # (B, H, Tk, D)
    sinks = torch.tensor([-1.0, 0.5, 30.0], dtype=torch.float64)  # (H,): 30 dominates every score of its head
    for causal in (False, True):
        ref = sink_softmax_attention(q, k, v, sinks, is_causal=causal)
        for at in ("start", "end"):
            for chunk in (1, 4, 11):
                out, lse = online_attention(q, k, v, is_causal=causal, chunk_size=chunk, sink_logits=sinks, sink_at=at)
                torch.testing.assert_close(out, ref)
                scores = (q @ k.transpose(-2, -1)) / math.sqrt(8)  # (B, H, Tq, Tk)
                if causal:
                    scores = scores.masked_fill(~torch.ones(7, 11, dtype=torch.bool).tril(), float("-inf"))
                full = torch.cat([scores, sinks.view(1, 3, 1, 1).expand(2, 3, 7, 1)], -1)  # the sink's column
                torch.testing.assert_close(lse, torch.logsumexp(full, -1))
    zero = torch.zeros(2, 3, 1, 8, dtype=torch.float64)  # (B, H, 1, D): the sink as a key with value 0
    bias = torch.zeros(3, 7, 12, dtype=torch.float64)
    bias[..., 11] = sinks[:, None]
    torch.testing.assert_close(online_attention(q, k, v, chunk_size=3, sink_logits=sinks)[0],
                               F.scaled_dot_product_attention(q, torch.cat([k, zero], 2), torch.cat([v, zero], 2),
                                                              attn_mask=bias))
    start = online_attention(q[..., :0, :], k, v, sink_logits=sinks)[0]  # no queries: shapes only
    assert start.shape == (2, 3, 0, 8)
    m = torch.full((2, 3, 7), float("-inf"), dtype=torch.float64)
    state = fold_sink_logit((m, torch.zeros_like(m), torch.zeros(2, 3, 7, 8, dtype=torch.float64)), sinks[:, None])
    torch.testing.assert_close(state[0], sinks[:, None].expand(2, 3, 7))  # the start state (s, 1, 0)
    torch.testing.assert_close(state[1], torch.ones_like(m))
    with pytest.raises(ValueError, match="sink_logits"):
        online_attention(q, k, v, sink_logits=sinks[:2])
    with pytest.raises(ValueError, match="sink_at"):
        online_attention(q, k, v, sink_logits=sinks, sink_at="middle")
