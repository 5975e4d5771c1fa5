"""AdditiveAttention and LuongAttention against PyTorch's kernel and each other: masks, gradients, bad input."""

import pytest
import torch
import torch.nn.functional as F

from attncourse import AdditiveAttention, LuongAttention, scaled_dot_product_attention
from attncourse.rnn_attention import attend, score_parameter_count

TOL = dict(rtol=1e-10, atol=1e-12)  # float64 throughout unless a test says otherwise
SHAPES = [  # (B, T, Dq, Dk, Dv)
    (4, 7, 8, 8, 8),
    (3, 5, 6, 10, 10),   # query and key sizes differ
    (2, 13, 5, 7, 3),    # primes, Dv != Dk
    (1, 1, 4, 4, 2),     # a single source position
]
MODULES = ["additive", "dot", "general", "concat"]


def make(b, t, dq, dk, dv, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, dq, generator=g, dtype=dtype)
    k = torch.randn(b, t, dk, generator=g, dtype=dtype)
    v = torch.randn(b, t, dv, generator=g, dtype=dtype)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t) < lengths[:, None]  # (B, T) padding mask, at least one valid position
    return q, k, v, mask


def module(kind, dq, dk, hidden=6, seed=0):
    torch.manual_seed(seed)
    m = AdditiveAttention(dq, dk, hidden) if kind == "additive" else LuongAttention(dq, dk, kind, hidden_size=hidden)
    return m.double()


def scores_by_hand(m, q, k):
    """Each score written out from its formula (einsum), independent of the module's code path."""
    if isinstance(m, AdditiveAttention):
        hidden = torch.tanh(torch.einsum("ad,bd->ba", m.query_proj.weight, q)[:, None]
                            + torch.einsum("ad,btd->bta", m.key_proj.weight, k))
        return torch.einsum("a,bta->bt", m.v.weight[0], hidden)
    if m.score_name == "dot":
        return torch.einsum("bd,btd->bt", q, k)
    if m.score_name == "general":
        return torch.einsum("bi,ij,btj->bt", q, m.W.weight, k)
    both = torch.cat([q[:, None].expand(-1, k.shape[1], -1), k], dim=-1)  # (B, T, Dq + Dk)
    return torch.einsum("a,bta->bt", m.v.weight[0], torch.tanh(both @ m.W.weight.T))


def pytorch_attention(scores, v, mask):
    """softmax(scores) @ v by F.scaled_dot_product_attention: zero queries and keys, scores as a float mask."""
    b, t = scores.shape
    bias = scores.masked_fill(~mask, float("-inf"))[:, None, :]  # (B, 1, T)
    zeros_q, zeros_k = scores.new_zeros(b, 1, 1), scores.new_zeros(b, t, 1)
    return F.scaled_dot_product_attention(zeros_q, zeros_k, v, attn_mask=bias).squeeze(1)  # (B, Dv)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MODULES)
def test_matches_formula_and_pytorch(kind, shape):
    b, t, dq, dk, dv = shape
    if kind == "dot" and dq != dk:
        pytest.skip("dot needs Dq == Dk (tested in test_dot_rejects_different_sizes)")
    q, k, v, mask = make(*shape)
    m = module(kind, dq, dk)
    context, weights = m(q, k, v, mask=mask)
    assert context.shape == (b, dv) and weights.shape == (b, t)
    expected_w = torch.softmax(scores_by_hand(m, q, k).masked_fill(~mask, float("-inf")), dim=-1)
    torch.testing.assert_close(weights, expected_w, **TOL)
    torch.testing.assert_close(context, pytorch_attention(scores_by_hand(m, q, k), v, mask), **TOL)


@pytest.mark.parametrize("shape", SHAPES)
def test_dot_is_sdpa_with_scale_one(shape):
    b, t, d, _, dv = shape
    q, k, v, mask = make(b, t, d, d, dv)
    context, _ = LuongAttention(d, d, "dot")(q, k, v, mask=mask)
    ref = F.scaled_dot_product_attention(q[:, None], k, v, attn_mask=mask[:, None], scale=1.0)  # (B, 1, Dv)
    torch.testing.assert_close(context, ref.squeeze(1), **TOL)
    ours = scaled_dot_product_attention(q[:, None], k, v, mask[:, None], scale=1.0)
    torch.testing.assert_close(context, ours.squeeze(1), **TOL)


def test_general_is_sdpa_on_projected_query():
    q, k, v, mask = make(3, 9, 5, 7, 4)
    m = module("general", 5, 7)
    context, _ = m(q, k, v, mask=mask)
    q_proj = (q @ m.W.weight)[:, None]  # (B, 1, Dk): s^T W
    ref = F.scaled_dot_product_attention(q_proj, k, v, attn_mask=mask[:, None], scale=1.0).squeeze(1)
    torch.testing.assert_close(context, ref, **TOL)


def test_concat_equals_additive_with_split_weights():
    q, k, v, mask = make(4, 6, 5, 7, 7)
    concat = module("concat", 5, 7, hidden=9)
    additive = AdditiveAttention(5, 7, 9).double()
    with torch.no_grad():
        additive.query_proj.weight.copy_(concat.W.weight[:, :5])
        additive.key_proj.weight.copy_(concat.W.weight[:, 5:])
        additive.v.weight.copy_(concat.v.weight)
    for a, b in zip(concat(q, k, v, mask=mask), additive(q, k, v, mask=mask)):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("kind", MODULES)
def test_values_default_to_keys_and_projected_keys_change_nothing(kind):
    q, k, _, mask = make(3, 5, 6, 6, 6)
    m = module(kind, 6, 6)
    plain = m(q, k, mask=mask)
    explicit = m(q, k, k, mask=mask)
    cached = m(q, k, mask=mask, projected_keys=m.project_keys(k))
    for other in (explicit, cached):
        for a, b in zip(plain, other):
            torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("kind", MODULES)
def test_many_queries_at_once_equal_one_call_per_query(kind):
    """A (B, Tq, Dq) query gives what Tq separate (B, Dq) calls give, masks and gradients included."""
    b, tq, t, d, dv = 3, 5, 7, 6, 4
    g = torch.Generator().manual_seed(4)
    q = torch.randn(b, tq, d, generator=g, dtype=torch.float64, requires_grad=True)
    _, k, v, mask = make(b, t, d, d, dv, seed=4)
    mask[2] = False  # one sequence with nothing to attend to
    m = module(kind, d, d)
    context, weights = m(q, k, v, mask=mask)
    assert context.shape == (b, tq, dv) and weights.shape == (b, tq, t)
    assert m.score(q, k).shape == (b, tq, t)
    singles = [m(q[:, i], k, v, mask=mask) for i in range(tq)]
    torch.testing.assert_close(context, torch.stack([c for c, _ in singles], dim=1), **TOL)
    torch.testing.assert_close(weights, torch.stack([w for _, w in singles], dim=1), **TOL)
    assert torch.all(weights[2] == 0) and torch.all(context[2] == 0)
    # against PyTorch's kernel: the (B, Tq, T) scores as a float mask over zero queries and keys
    bias = m.score(q, k).masked_fill(~mask[:, None], float("-inf"))  # (B, Tq, T)
    ref = F.scaled_dot_product_attention(q.new_zeros(b, tq, 1), k.new_zeros(b, t, 1), v, attn_mask=bias)
    torch.testing.assert_close(context[:2], ref[:2], **TOL)  # PyTorch gives NaN on the fully masked row
    grad = torch.autograd.grad(context.square().sum(), q)[0]
    grad_singles = torch.autograd.grad(sum(c.square().sum() for c, _ in singles), q)[0]
    torch.testing.assert_close(grad, grad_singles, **TOL)


@pytest.mark.parametrize("kind", MODULES)
def test_mask_weights_sum_to_one_and_padding_is_ignored(kind):
    q, k, v, mask = make(5, 8, 4, 4, 3, seed=1)
    m = module(kind, 4, 4)
    context, weights = m(q, k, v, mask=mask)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5, dtype=torch.float64), **TOL)
    assert torch.all(weights[~mask] == 0)
    k2, v2 = k.clone(), v.clone()
    k2[~mask], v2[~mask] = 1e3, -1e3  # garbage at padded positions must not leak in
    context2, weights2 = m(q, k2, v2, mask=mask)
    torch.testing.assert_close(context2, context, **TOL)
    torch.testing.assert_close(weights2, weights, **TOL)


@pytest.mark.parametrize("kind", MODULES)
def test_fully_masked_row_gives_zeros_not_nan(kind):
    q, k, v, mask = make(3, 4, 4, 4, 2)
    mask[1] = False
    context, weights = module(kind, 4, 4)(q, k, v, mask=mask)
    assert torch.isfinite(context).all() and torch.isfinite(weights).all()
    assert torch.all(weights[1] == 0) and torch.all(context[1] == 0)
    torch.testing.assert_close(weights[[0, 2]].sum(-1), torch.ones(2, dtype=torch.float64), **TOL)


@pytest.mark.parametrize("kind", MODULES)
def test_gradients(kind):
    q, k, v, mask = make(2, 5, 3, 3, 2, seed=2)
    m = module(kind, 3, 3, hidden=4)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: m(q, k, v, mask=mask), (q, k, v))
    m(q, k, v, mask=mask)[0].sum().backward()
    assert torch.all(k.grad[~mask] == 0) and torch.all(v.grad[~mask] == 0)  # padding gets no gradient
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_dot_gradients_match_pytorch():
    q, k, v, mask = make(3, 6, 4, 4, 5, seed=3)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    ours = torch.autograd.grad(LuongAttention(4, 4, "dot")(q, k, v, mask=mask)[0].square().sum(), (q, k, v))
    ref_out = F.scaled_dot_product_attention(q[:, None], k, v, attn_mask=mask[:, None], scale=1.0)
    ref = torch.autograd.grad(ref_out.square().sum(), (q, k, v))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, **TOL)


def test_float32_keeps_dtype():
    q, k, v, mask = make(2, 5, 4, 6, 3, dtype=torch.float32)
    for kind in ("additive", "general", "concat"):
        m = module(kind, 4, 6).float()
        context, weights = m(q, k, v, mask=mask)
        assert context.dtype == weights.dtype == torch.float32


@pytest.mark.parametrize("kind,expected", [("dot", 0), ("general", 64 * 48), ("concat", 32 * (64 + 48 + 1)),
                                           ("additive", 32 * (64 + 48 + 1))])
def test_parameter_counts(kind, expected):
    dk = 64 if kind == "dot" else 48
    m = module(kind, 64, dk, hidden=32)
    assert sum(p.numel() for p in m.parameters()) == score_parameter_count(kind, 64, dk, 32) == (
        expected if kind != "dot" else 0)


def test_attend_alone():
    scores = torch.tensor([[0.0, 0.0, 5.0], [1.0, 2.0, 3.0]])
    values = torch.arange(12.0).reshape(2, 3, 2)
    mask = torch.tensor([[True, True, False], [False, False, False]])
    context, weights = attend(scores, values, mask)
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(context, torch.tensor([[1.0, 2.0], [0.0, 0.0]]))


def test_dot_rejects_different_sizes():
    with pytest.raises(ValueError, match=r"query_size=6, key_size=10"):
        LuongAttention(6, 10, "dot")
    m = LuongAttention(6, 6, "dot")
    with pytest.raises(ValueError, match=r"keys must have size 6.*\(2, 5, 10\)"):
        m(torch.randn(2, 6), torch.randn(2, 5, 10))


@pytest.mark.parametrize("kind", MODULES)
def test_bad_input(kind):
    m = module(kind, 4, 4).float()
    q, k = torch.randn(2, 4), torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match=r"query must be \(B, Dq\) or \(B, Tq, Dq\).*\(2, 1, 1, 4\)"):
        m(q[:, None, None], k)
    with pytest.raises(ValueError, match=r"keys.*at least 3 dims.*\(5, 4\)"):
        m(q, k[0])
    with pytest.raises(ValueError, match=r"query must have size 4.*\(2, 3\)"):
        m(torch.randn(2, 3), k)
    with pytest.raises(ValueError, match=r"batch size.*\(3, 4\).*\(2, 5, 4\)"):
        m(torch.randn(3, 4), k)
    with pytest.raises(ValueError, match=r"values.*\(2, 4, 4\)"):
        m(q, k, torch.randn(2, 4, 4))
    with pytest.raises(ValueError, match=r"mask must be \(B, T\) = \(2, 5\).*\(2, 4\)"):
        m(q, k, mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"mask must be a bool.*float32"):
        m(q, k, mask=torch.ones(2, 5))
    with pytest.raises(TypeError, match=r"query must be a torch.Tensor, got list"):
        m([[0.0] * 4] * 2, k)
    with pytest.raises(TypeError, match=r"keys must be a floating-point.*int64"):
        m(q, k.long())


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"score must be one of.*'cosine'"):
        LuongAttention(4, 4, "cosine")
    with pytest.raises(ValueError, match=r"hidden_size must be positive, got 0"):
        AdditiveAttention(4, 4, 0)
    with pytest.raises(TypeError, match=r"query_size must be an int, got float"):
        LuongAttention(4.0, 4, "general")
    with pytest.raises(ValueError, match=r"'additive' needs hidden_size"):
        score_parameter_count("additive", 4, 4)
    with pytest.raises(ValueError, match=r"score must be.*'bilinear'"):
        score_parameter_count("bilinear", 4, 4)
