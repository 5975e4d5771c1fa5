r"""Softmax from three passes down to one, the (max, sum) state and its merge, and one-pass attention.

For a row :math:`x_1 \dots x_N` the online recurrence keeps a running max and a running sum,

.. math:: m_j = \max(m_{j-1}, x_j), \qquad \ell_j = \ell_{j-1}\, e^{m_{j-1} - m_j} + e^{x_j - m_j},

starting from :math:`(m_0, \ell_0) = (-\infty, 0)`, so that :math:`\ell_N = \sum_i e^{x_i - m_N}` after one sweep.
Two such states merge by :func:`merge_softmax_states`, an associative and commutative operator; carrying a
weighted sum of values along with them gives :func:`online_attention`, the core of FlashAttention.

Conventions (those of :func:`attncourse.scaled_dot_product_attention`): entries may be ``-inf`` (masked);
a row that is entirely ``-inf`` has the state ``(-inf, 0)``, its softmax and attention output are zeros,
never NaN, and its log-sum-exp is ``-inf`` (as :func:`torch.logsumexp` gives). float16 and bfloat16 inputs
are computed in float32 (softmax outputs are cast back; states and log-sum-exps stay float32), except by
:func:`naive_softmax`, whose point is to overflow.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _validate
from .sdpa import _check_qkv, apply_mask, causal_mask
from .sdpa import compute_dtype as _compute_dtype

__all__ = [
    "AttentionState", "SoftmaxState", "finalize_attention_state", "fold_sink_logit", "logsumexp_from_state",
    "merge_attention_states", "merge_softmax_states", "naive_softmax", "one_pass_softmax",
    "online_attention", "online_attention_update", "online_softmax_state", "online_softmax_trace",
    "softmax_state", "three_pass_softmax", "two_pass_softmax",
]  # and lazy_rescale_attention, re-exported from .lazy_rescale at the end (documented there)

_NEG_INF = float("-inf")


class SoftmaxState(NamedTuple):
    """Running max ``m`` and running sum ``l = sum_i exp(x_i - m)`` of the entries seen so far.

    Both have the shape of the input without the softmax dim. The empty state is ``(-inf, 0)``.
    """

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 (the paper's name)


class AttentionState(NamedTuple):
    """``m`` (..., Tq) running max of the scores, ``l`` (..., Tq) running sum of ``exp(s - m)``, and
    ``acc`` (..., Tq, Dv) the running sum of ``exp(s - m) * v``: the output before dividing by ``l``."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741
    acc: torch.Tensor


# ----------------------------------------------------------------------------- helpers



def _check_dim(name: str, x: object, dim: object) -> torch.Tensor:
    x = _validate.tensor(name, x, min_rank=1, floating=True)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for {name} of shape {tuple(x.shape)}")
    return x


def _row_last(name: str, x: object, dim: int) -> torch.Tensor:
    """Validate `x` and `dim`, and return `x` with `dim` moved last (in the compute dtype)."""
    x = _check_dim(name, x, dim)
    if x.shape[dim] == 0:
        raise ValueError(f"{name} has no entries along dim={dim}: shape {tuple(x.shape)}")
    return x.movedim(dim, -1).to(_compute_dtype(x.dtype))


def _chunk(name: str, chunk_size: object, length: int) -> int:
    return length if chunk_size is None else _validate.positive_int(name, chunk_size)


def _safe(m: torch.Tensor) -> torch.Tensor:
    """The max to subtract: `m` where finite, 0 on rows with nothing unmasked yet (so exp(-inf - 0) = 0)."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, with 0 where den == 0 (a fully masked row)."""
    return num / torch.where(den > 0, den, torch.ones_like(den))


def _check_state(name: str, state: object) -> SoftmaxState:
    if not (isinstance(state, tuple) and len(state) == 2):
        raise TypeError(f"{name} must be a SoftmaxState or an (m, l) pair of tensors, got {type(state).__name__}")
    m = _validate.tensor(f"{name}.m", state[0], min_rank=0, floating=True)
    l = _validate.tensor(f"{name}.l", state[1], min_rank=0, floating=True)  # noqa: E741
    if m.shape != l.shape:
        raise ValueError(f"{name}.m and {name}.l must have the same shape, got {tuple(m.shape)} and {tuple(l.shape)}")
    return SoftmaxState(m, l)


# ----------------------------------------------------------------------------- softmax, 3 to 1 passes


def naive_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(x) / sum(exp(x))`` with no max subtracted, in `x`'s own dtype: overflows to NaN once an
    entry exceeds about 88.7 in float32 or 11.1 in float16. Shown to be avoided; same shape as `x`."""
    _check_dim("x", x, dim)
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def three_pass_softmax(x: torch.Tensor, dim: int = -1, chunk_size: int | None = None) -> torch.Tensor:
    """Safe softmax of `x` along `dim` in three sweeps over the row, `chunk_size` entries at a time
    (None: the whole row): 1) the max, 2) the sum of ``exp(x - max)``, 3) ``exp(x - max) / sum``."""
    xs = _row_last("x", x, dim)  # (..., N)
    chunks = xs.split(_chunk("chunk_size", chunk_size, xs.shape[-1]), dim=-1)
    m = torch.full(xs.shape[:-1], _NEG_INF, dtype=xs.dtype, device=xs.device)  # (...)
    for c in chunks:  # pass 1: the max
        m = torch.maximum(m, c.amax(dim=-1))
    m = _safe(m)
    l = torch.zeros_like(m)  # noqa: E741
    for c in chunks:  # pass 2: the sum, every exponent <= 0 so nothing overflows
        l = l + torch.exp(c - m[..., None]).sum(dim=-1)
    out = torch.cat([_divide(torch.exp(c - m[..., None]), l[..., None]) for c in chunks], dim=-1)  # pass 3
    return out.movedim(-1, dim).to(x.dtype)


def softmax_state(x: torch.Tensor, dim: int = -1) -> SoftmaxState:
    """The (max, sum) state of a whole chunk at once: ``m = max(x)``, ``l = sum(exp(x - m))`` along `dim`."""
    xs = _row_last("x", x, dim)  # (..., N)
    m = xs.amax(dim=-1)  # (...)
    return SoftmaxState(m, torch.exp(xs - _safe(m)[..., None]).sum(dim=-1))


def merge_softmax_states(a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
    r"""The state of the union of two chunks:
    :math:`m = \max(m_a, m_b),\ \ell = \ell_a e^{m_a - m} + \ell_b e^{m_b - m}`.

    Associative and commutative, with identity ``(-inf, 0)``; an empty side contributes nothing and
    two empty sides give ``(-inf, 0)``, not NaN. `a` and `b` must have equal shapes.
    """
    a, b = _check_state("a", a), _check_state("b", b)
    if a.m.shape != b.m.shape:
        raise ValueError(f"a and b must have the same shape, got {tuple(a.m.shape)} and {tuple(b.m.shape)}")
    m = torch.maximum(a.m, b.m)
    ref = _safe(m)  # exp(-inf - ref) = 0 for an empty side
    return SoftmaxState(m, a.l * torch.exp(a.m - ref) + b.l * torch.exp(b.m - ref))


def online_softmax_state(x: torch.Tensor, dim: int = -1, chunk_size: int | None = None) -> SoftmaxState:
    """One sweep over `x` along `dim`, `chunk_size` entries at a time (None: the whole row), updating the
    running (max, sum) after each chunk. Returns the state of the row, shape of `x` without `dim`."""
    xs = _row_last("x", x, dim)  # (..., N)
    state = SoftmaxState(torch.full(xs.shape[:-1], _NEG_INF, dtype=xs.dtype, device=xs.device),
                         torch.zeros(xs.shape[:-1], dtype=xs.dtype, device=xs.device))
    for c in xs.split(_chunk("chunk_size", chunk_size, xs.shape[-1]), dim=-1):
        state = merge_softmax_states(state, softmax_state(c))  # rescale the old sum to the new max
    return state


def logsumexp_from_state(state: SoftmaxState) -> torch.Tensor:
    """``m + log(l)``: the natural-log log-sum-exp of the row; ``-inf`` for an empty (fully masked) row."""
    m, l = _check_state("state", state)  # noqa: E741
    return torch.where(l > 0, m + torch.log(torch.where(l > 0, l, torch.ones_like(l))),
                       torch.full_like(m, _NEG_INF))


def two_pass_softmax(x: torch.Tensor, dim: int = -1, chunk_size: int | None = None) -> torch.Tensor:
    """Online-normaliser softmax (Milakov and Gimelshein): sweep 1 computes the running (max, sum),
    sweep 2 writes ``exp(x - m) / l``. Same shape and dtype as `x`."""
    xs = _row_last("x", x, dim)  # (..., N)
    size = _chunk("chunk_size", chunk_size, xs.shape[-1])
    m, l = online_softmax_state(xs, -1, size)  # noqa: E741  sweep 1, (...) each
    out = torch.cat([_divide(torch.exp(c - _safe(m)[..., None]), l[..., None])
                     for c in xs.split(size, dim=-1)], dim=-1)  # sweep 2, (..., N)
    return out.movedim(-1, dim).to(x.dtype)


def one_pass_softmax(x: torch.Tensor, dim: int = -1, chunk_size: int | None = None) -> torch.Tensor:
    """Softmax that reads `x` once: each chunk's ``exp(x - m)`` is written with the running max, and the
    outputs already written are rescaled by ``exp(m_old - m_new)`` whenever the max grows; the written
    outputs are divided by ``l`` at the end. (Attention with V = identity.) Same shape and dtype as `x`."""
    xs = _row_last("x", x, dim)  # (..., N)
    size = _chunk("chunk_size", chunk_size, xs.shape[-1])
    m = torch.full(xs.shape[:-1], _NEG_INF, dtype=xs.dtype, device=xs.device)  # (...)
    l = torch.zeros_like(m)  # noqa: E741
    out = torch.empty_like(xs)  # (..., N) unnormalised outputs, relative to the current max
    for start in range(0, xs.shape[-1], size):
        c = xs[..., start:start + size]  # (..., C)
        m_new = torch.maximum(m, c.amax(dim=-1))
        alpha = torch.exp(m - _safe(m_new))  # (...) rescales everything written so far
        p = torch.exp(c - _safe(m_new)[..., None])  # (..., C)
        out[..., :start] *= alpha[..., None]
        out[..., start:start + size] = p
        l, m = alpha * l + p.sum(dim=-1), m_new  # noqa: E741
    return _divide(out, l[..., None]).movedim(-1, dim).to(x.dtype)


def online_softmax_trace(x: torch.Tensor, chunk_size: int = 1) -> dict[str, torch.Tensor]:
    """Step-by-step values of the online recurrence over a 1-D row `x` (N,), for plots and exercises.

    Returns a dict of (steps,) tensors, steps = ceil(N / chunk_size): ``"running_max"`` m after each
    chunk, ``"rescale"`` the factor ``exp(m_old - m_new)`` applied to the old sum at that step (0 at the
    first step, where there is nothing to rescale), and ``"running_sum"`` l after each chunk.
    """
    _validate.tensor("x", x, min_rank=1, floating=True)
    if x.dim() != 1:
        raise ValueError(f"x must be a 1-D row, got shape {tuple(x.shape)}")
    xs = _row_last("x", x, -1)
    m = torch.tensor(_NEG_INF, dtype=xs.dtype)
    l = torch.tensor(0.0, dtype=xs.dtype)  # noqa: E741
    trace: dict[str, list[torch.Tensor]] = {"running_max": [], "rescale": [], "running_sum": []}
    for c in xs.split(_chunk("chunk_size", chunk_size, xs.shape[-1])):
        m_new = torch.maximum(m, c.amax())
        alpha = torch.exp(m - _safe(m_new))
        l = alpha * l + torch.exp(c - _safe(m_new)).sum()  # noqa: E741
        m = m_new
        for key, value in (("running_max", m), ("rescale", alpha), ("running_sum", l)):
            trace[key].append(value)
    return {key: torch.stack(values) for key, values in trace.items()}


# ----------------------------------------------------------------------------- attention in one pass


def online_attention_update(state: AttentionState, scores: torch.Tensor, value: torch.Tensor) -> AttentionState:
    r"""Fold one chunk of keys into the running state (FlashAttention's inner step).

    Args:
        state: ``(m, l, acc)`` with shapes (..., Tq), (..., Tq), (..., Tq, Dv); start from
            ``(-inf, 0, 0)``.
        scores: (..., Tq, C) scaled scores of this chunk, ``-inf`` where masked.
        value: (..., C, Dv) the chunk's values.

    .. math:: m' = \max(m, \max_j s_j),\quad \alpha = e^{m - m'},\quad
              \ell' = \alpha\ell + \textstyle\sum_j e^{s_j - m'},\quad
              \mathrm{acc}' = \alpha\,\mathrm{acc} + \textstyle\sum_j e^{s_j - m'} v_j
    """
    if not (isinstance(state, tuple) and len(state) == 3):
        raise TypeError(f"state must be an AttentionState (m, l, acc), got {type(state).__name__}")
    m, l, acc = (_validate.tensor(f"state.{name}", t, min_rank=0, floating=True)  # noqa: E741
                 for name, t in zip(("m", "l", "acc"), state))
    _validate.tensor("scores", scores, min_rank=2, floating=True)
    _validate.tensor("value", value, min_rank=2, floating=True)
    if scores.shape[-1] != value.shape[-2] or scores.shape[:-1] != m.shape or acc.shape[:-1] != m.shape:
        raise ValueError(f"shapes do not fit: m {tuple(m.shape)}, l {tuple(l.shape)}, acc {tuple(acc.shape)}, "
                         f"scores {tuple(scores.shape)}, value {tuple(value.shape)}")
    m_new = torch.maximum(m, scores.amax(dim=-1))  # (..., Tq)
    ref = _safe(m_new)  # rows with nothing unmasked so far keep l = 0 and acc = 0
    alpha = torch.exp(m - ref)  # (..., Tq): how much the old max overestimated the new one
    p = torch.exp(scores - ref[..., None])  # (..., Tq, C)
    l_new = alpha * l + p.sum(dim=-1)  # (..., Tq)
    acc_new = alpha[..., None] * acc + p @ value.to(p.dtype)  # (..., Tq, C) @ (..., C, Dv) -> (..., Tq, Dv)
    return AttentionState(m_new, l_new, acc_new)


def merge_attention_states(a: AttentionState, b: AttentionState) -> AttentionState:
    """The state of attention over the keys of `a` and of `b` together (any order, any grouping)."""
    for name, s in (("a", a), ("b", b)):
        if not (isinstance(s, tuple) and len(s) == 3):
            raise TypeError(f"{name} must be an AttentionState (m, l, acc), got {type(s).__name__}")
    (m, l), acc_a, acc_b = merge_softmax_states(a[:2], b[:2]), a.acc, b.acc  # noqa: E741
    if acc_a.shape != acc_b.shape or acc_a.shape[:-1] != m.shape:
        raise ValueError(f"a.acc {tuple(acc_a.shape)} and b.acc {tuple(acc_b.shape)} must match "
                         f"m {tuple(m.shape)} + (Dv,)")
    ref = _safe(m)[..., None]
    return AttentionState(m, l, acc_a * torch.exp(a.m[..., None] - ref) + acc_b * torch.exp(b.m[..., None] - ref))


def finalize_attention_state(state: AttentionState) -> tuple[torch.Tensor, torch.Tensor]:
    """``(acc / l, m + log l)``: the output (..., Tq, Dv), zeros on fully masked rows, and the
    log-sum-exp (..., Tq) of each scaled, masked score row, ``-inf`` on fully masked rows."""
    m, l, acc = state  # noqa: E741
    return _divide(acc, l[..., None]), logsumexp_from_state(SoftmaxState(m, l))


def fold_sink_logit(state: AttentionState, sink: torch.Tensor) -> AttentionState:
    r"""Fold a sink logit (gpt-oss) into a running attention state: one more term :math:`e^{s}` in the
    denominator, with a zero value, entering the running maximum and the sum once.

    .. math:: m' = \max(m, s),\quad \ell' = e^{m - m'}\ell + e^{s - m'},\quad \mathrm{acc}' = e^{m - m'}\mathrm{acc}

    Applied to the start state ``(-inf, 0, 0)`` it gives ``(s, 1, 0)`` (the sink first); applied after the last
    chunk it is what ``flash_attn.cute``'s forward does when it finalises a row. Both give the same weights.

    Args:
        state: ``(m, l, acc)`` with shapes (..., Tq), (..., Tq), (..., Tq, Dv).
        sink: a tensor broadcastable to (..., Tq), e.g. (H, 1) for one logit per head of a (B, H, Tq) state.
    """
    if not (isinstance(state, tuple) and len(state) == 3):
        raise TypeError(f"state must be an AttentionState (m, l, acc), got {type(state).__name__}")
    m, l, acc = state  # noqa: E741
    _validate.tensor("sink", sink, min_rank=0, floating=True)
    _validate.broadcastable("sink", tuple(sink.shape), tuple(m.shape), "state.m")
    sink = sink.to(m.dtype).expand(m.shape)
    m_new = torch.maximum(m, sink)  # finite: the sink is always there
    alpha = torch.exp(m - m_new)  # (..., Tq); 0 where m = -inf (nothing seen yet)
    return AttentionState(m_new, alpha * l + torch.exp(sink - m_new), alpha[..., None] * acc)


def online_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    chunk_size: int = 128,
    sink_logits: torch.Tensor | None = None,
    sink_at: str = "end",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in one pass over the keys, `chunk_size` at a time, never holding a (Tq, Tk) matrix.

    Same arguments and masking conventions as :func:`attncourse.scaled_dot_product_attention`
    (boolean mask True = may attend, float mask added, ``is_causal`` top-left aligned). All queries are
    processed together; chapter 09 tiles the queries too.

    With ``sink_logits`` (H,) (one per head; inputs (B, H, T, D)), each row's denominator gets one more term
    :math:`e^{s_h}` with no value (gpt-oss's sink, :func:`attncourse.sink_variants.sink_softmax_attention`), folded by
    :func:`fold_sink_logit` once: before the first chunk (``sink_at="start"``) or when the row is finalised
    (``"end"``, as ``flash_attn.cute`` does). The lse then includes the sink's term.

    Returns:
        out (..., Tq, Dv) in the inputs' dtype, zeros on fully masked rows; lse (..., Tq), the
        log-sum-exp of each scaled, masked score row (float32 for half-precision inputs).
    """
    _check_qkv(query, key, value)
    if sink_at not in ("start", "end"):
        raise ValueError(f"sink_at must be 'start' or 'end', got {sink_at!r}")
    if sink_logits is not None:
        _validate.tensor("sink_logits", sink_logits, floating=True)
        if query.dim() != 4 or sink_logits.shape != (query.shape[1],):
            raise ValueError(f"sink_logits must be (H,) for inputs (B, H, T, D); got sink_logits "
                             f"{tuple(sink_logits.shape)}, query {tuple(query.shape)}")
    size = _validate.positive_int("chunk_size", chunk_size)
    q_len, k_len, dv = query.shape[-2], key.shape[-2], value.shape[-1]
    lead = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be bool or floating point, got dtype {attn_mask.dtype}")
        _validate.broadcastable("attn_mask", tuple(attn_mask.shape), (*lead, q_len, k_len), "scores")
    if scale is None:
        scale = query.shape[-1] ** -0.5
    dtype = _compute_dtype(query.dtype)
    q = query.to(dtype)
    m = torch.full((*lead, q_len), _NEG_INF, dtype=dtype, device=query.device)  # (..., Tq)
    state = AttentionState(m, torch.zeros_like(m), torch.zeros(*lead, q_len, dv, dtype=dtype, device=query.device))
    sink = None if sink_logits is None else sink_logits.to(dtype)[:, None]  # (H, 1): broadcasts over (B, H, Tq)
    if sink is not None and sink_at == "start":
        state = fold_sink_logit(state, sink)  # (s, 1, 0): the running max starts at the sink, the sum at its term
    for start in range(0, k_len, size):
        stop = min(start + size, k_len)
        k_chunk = key[..., start:stop, :].to(dtype)  # (..., C, D)
        s = (q @ k_chunk.transpose(-2, -1)) * scale  # (..., Tq, D) @ (..., D, C) -> (..., Tq, C)
        if attn_mask is not None:
            part = attn_mask if attn_mask.shape[-1] == 1 else attn_mask[..., start:stop]  # (..., Tq or 1, C or 1)
            s = apply_mask(s, part)
        if is_causal:
            keep = causal_mask(q_len, k_len, device=s.device)[:, start:stop]  # (Tq, C)
            s = s.masked_fill(~keep, _NEG_INF)
        state = online_attention_update(state, s, value[..., start:stop, :])
    if sink is not None and sink_at == "end":
        state = fold_sink_logit(state, sink)  # once, when the row is finalised
    out, lse = finalize_attention_state(state)
    return out.to(value.dtype), lse


from .lazy_rescale import lazy_rescale_attention  # noqa: E402  (it builds on this module's helpers)
