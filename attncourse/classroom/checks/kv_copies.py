"""The property of exercise 05-grouped-attention (attncourse/classroom/checks/ch05.py): K and V are read where they
are, never copied for the query heads and read once per KV head, judged from the operators the answer ran; and the
answers that break it."""

from __future__ import annotations

import torch


# Operators that only describe data (views) and those that read K/V as a matmul operand: neither makes a copy.
_VIEW_OPS = frozenset(("view", "_unsafe_view", "expand", "permute", "transpose", "t", "slice", "select", "unsqueeze",
                       "squeeze", "alias", "detach", "as_strided", "split", "split_with_sizes", "unbind", "chunk",
                       "narrow", "diagonal", "unfold", "lift_fresh", "_reshape_alias", "view_as", "expand_as",
                       "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"))
_MATMUL_OPS = frozenset(("mm", "bmm", "baddbmm", "addmm", "addbmm", "matmul", "dot", "mv", "vdot"))


def _op_name(name: str) -> str:
    return name.split("::")[-1].split(".")[0]


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= int(size)
    return n


def _no_kv_copy(runs) -> str | None:
    """K and V are read where they are: no operator receives a tensor larger than anything attention itself needs
    (a K or V repeated over the query heads of a group, even an expanded view handed to a copying or arithmetic
    operator), and the operators other than views and matmuls touch K- or V-shaped data at most twice over (a copy
    per query head, one head at a time, is G times). Judged on the cases where a G-fold copy would be the largest
    tensor of all (G > 1, fewer new queries than keys and than the head width)."""
    for run in runs:
        q, k, v = run.case.args[:3]
        (b, h, t, d), (h_kv, s) = q.shape, k.shape[1:3]
        g = h // h_kv
        limit = max(q.numel(), k.numel(), v.numel(), b * h * t * s)
        if g < 2 or g * k.numel() <= limit:
            continue
        # Score- and weight-shaped data ((T, S), or the group folded into rows, (G T, S), and their transposes) is
        # not K or V even where its shape matches K's (G T = D): only K's and V's own storage counts then.
        scores = {(t, s), (s, t), (g * t, s), (s, g * t)}
        touched = 0
        for name, _launch, _helper, tensors in run.trace["ops"]:
            op = _op_name(name)
            for _label, _offset, shape, stride in tensors:
                n = _numel(shape)
                if n > limit and not (op in _VIEW_OPS and 0 in stride):
                    times = n / k.numel()
                    return (f"case {run.case.name!r}: {name} received a tensor of shape {tuple(shape)}, "
                            f"{times:.3g} times the size of the keys: K or V was repeated for the query heads. "
                            "Each KV head should serve its group of query heads where it is, in one matmul")
            if op in _VIEW_OPS or op in _MATMUL_OPS:
                continue
            kv_shaped = [_numel(shape) for label, _o, shape, _s in tensors
                         if len(shape) >= 2 and tuple(shape[-2:]) in ((s, d), (d, s))
                         and (label in ("arg1", "arg2") or tuple(shape[-2:]) not in scores)]
            touched += max(kv_shaped, default=0)
        if touched > 2 * (k.numel() + v.numel()):
            return (f"case {run.case.name!r}: operators other than views and matmuls moved "
                    f"{touched / (k.numel() + v.numel()):.3g} times the keys and values: K or V was copied for "
                    "the query heads (one head at a time counts too). Each KV head should serve its group of "
                    "query heads where it is")
        read = _kv_read_by_matmuls(run, t, s, d)
        if read is not None and read > 1.5 * (k.numel() + v.numel()):
            return (f"case {run.case.name!r}: the matmuls read {read / (k.numel() + v.numel()):.3g} times the keys "
                    "and values: each KV head was read once per query head of its group (a loop over the query "
                    "heads does this without any copy). Read each KV head once, for all its query heads together, "
                    "which is what makes grouped attention cheaper to decode")
    return None


def _kv_read_by_matmuls(run, t: int, s: int, d: int) -> int | None:
    """Elements of K- or V-shaped operands ((..., S, D) or (..., D, S)) the answer's matmuls received, the queries
    (input 0) excepted; None where that shape is ambiguous (T equal to S or to D)."""
    if t in (s, d):
        return None
    read = 0
    for name, _launch, _helper, tensors in run.trace["ops"]:
        if _op_name(name) not in _MATMUL_OPS:
            continue
        for label, _offset, shape, _stride in tensors:
            if label != "arg0" and len(shape) >= 2 and tuple(shape[-2:]) in ((s, d), (d, s)):
                read += _numel(shape)
    return read


def _breaker_repeat_interleave(q, k, v):
    """The copy the lesson warns about: K and V repeated per query head, then plain attention."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - q.shape[-2]),
                                                                 float("-inf"))
    return torch.softmax(s, -1) @ v


def _breaker_expand_reshape(q, k, v):
    """repeat_kv: expand (free) then reshape (a copy)."""
    b, h_kv, s, d = k.shape
    g = q.shape[1] // h_kv
    k, v = (x[:, :, None].expand(b, h_kv, g, s, d).reshape(b, h_kv * g, s, d) for x in (k, v))
    w = torch.softmax((q @ k.transpose(-2, -1) / d ** 0.5).masked_fill(~torch.ones(q.shape[-2], s, dtype=torch.bool).tril(s - q.shape[-2]),
                                                                       float("-inf")), -1)
    return w @ v


def _breaker_index_select(q, k, v):
    """Gather the KV head of every query head with index_select."""
    g = q.shape[1] // k.shape[1]
    idx = torch.arange(q.shape[1]) // g
    k, v = k.index_select(1, idx), v.index_select(1, idx)
    w = torch.softmax((q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(
        ~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - q.shape[-2]), float("-inf")), -1)
    return w @ v


def _breaker_broadcast_matmul(q, k, v):
    """Let matmul broadcast over the group: it expands and copies the keys inside."""
    b, h, t, d = q.shape
    h_kv, s = k.shape[1:3]
    sc = q.view(b, h_kv, h // h_kv, t, d) @ k[:, :, None].transpose(-2, -1) / d ** 0.5
    w = torch.softmax(sc.masked_fill(~torch.ones(t, s, dtype=torch.bool).tril(s - t), float("-inf")), -1)
    return (w @ v[:, :, None]).view(b, h, t, d)


def _breaker_per_head_copies(q, k, v):
    """One query head at a time, each with its own copy of its KV head (after a first copy that hides the inputs)."""
    g = q.shape[1] // k.shape[1]
    k, v = k * 1.0, v * 1.0
    outs = []
    for head in range(q.shape[1]):
        kh, vh = k[:, head // g].clone(), v[:, head // g].clone()
        w = torch.softmax((q[:, head] @ kh.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(
            ~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - q.shape[-2]), float("-inf")), -1)
        outs.append(w @ vh)
    return torch.stack(outs, 1)


def _breaker_per_head_loop(q, k, v):
    """One query head at a time, each reading its KV head in place (views only, no copy): K and V are read G times."""
    g = q.shape[1] // k.shape[1]
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - q.shape[-2])
    outs = []
    for head in range(q.shape[1]):
        w = torch.softmax((q[:, head] @ k[:, head // g].transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(
            ~keep, float("-inf")), -1)
        outs.append(w @ v[:, head // g])
    return torch.stack(outs, 1)


# Operators that replicate what they read: handed K's or V's projection weights, they build more K/V heads.
_REPLICATING = frozenset(("repeat", "repeat_interleave", "index_select", "cat", "stack", "gather", "index", "take",
                          "tile", "index_put", "scatter"))


def _matmul_flops(tensors) -> int:
    """Multiply-adds of one matmul-family operator from its two last operands' shapes ((..., n, k) @ (..., k, m))."""
    mats = [shape for _label, _offset, shape, _stride in tensors if len(shape) >= 1][-2:]
    if len(mats) < 2:
        return 0
    a, b = mats
    return _numel(a) * (int(b[-1]) if len(b) >= 2 else 1)


def _gqa_weights_and_cost(runs) -> str | None:
    """A module of GQA's weights and cost: the K and V projection weights (arguments w_k, w_v) are multiplied as they
    are, never repeated, tiled or gathered into the weights of more K/V heads, and the matmuls together do no more
    work than projecting n_kv_heads K/V heads once (half of what computing K and V for every query head adds is
    allowed, for other orders of the same work). Judged on the cases with fewer KV heads than query heads."""
    for run in runs:
        x, _w_q, w_k, _w_v, _w_o, h, h_kv = run.case.args[:7]
        if h_kv >= h:
            continue
        (b, t, d), head = x.shape, x.shape[-1] // h
        flops = 0
        for name, _launch, _helper, tensors in run.trace["ops"]:
            op = _op_name(name)
            if op in _MATMUL_OPS:
                flops += _matmul_flops(tensors)
                continue
            if op in _VIEW_OPS:
                continue
            for label, _offset, shape, _stride in tensors:
                if label in ("arg2", "arg3") and (op in _REPLICATING or _numel(shape) > w_k.numel()):
                    return (f"case {run.case.name!r}: {name} read the K/V projection weights ({label}): they were "
                            "repeated for the query heads, which builds the K/V heads of multi-head attention (its "
                            "cache and its cost). Grouped-query attention projects n_kv_heads K/V heads once and lets "
                            "each group of query heads share one")
        gqa = 2 * b * t * d * d + 2 * b * t * d * h_kv * head + 2 * b * h * t * t * head
        extra = 2 * b * t * d * (h - h_kv) * head  # what K and V projected for every query head would add
        if flops > gqa + extra // 2:
            return (f"case {run.case.name!r}: the matmuls did {flops:,} multiply-adds where projecting "
                    f"{h_kv} K/V heads once needs {gqa:,}: K and V were computed for every query head (multi-head "
                    "attention's cost). Project each KV head once and share it within its group")
    return None


def _breaker_repeated_kv_weights(x, w_q, w_k, w_v, w_o, n_heads, n_kv_heads):
    """Multi-head attention on GQA's K/V weights repeated per query head (cold review 10): right values, MHA's K/V."""
    b, t, d = x.shape
    head, g = d // n_heads, n_heads // n_kv_heads
    rk, rv = (w.view(n_kv_heads, head, d).repeat_interleave(g, 0).reshape(d, d) for w in (w_k, w_v))
    q, k, v = ((x @ w.T).view(b, t, n_heads, head).transpose(1, 2) for w in (w_q, rk, rv))
    weights = torch.softmax(q @ k.transpose(-2, -1) / head ** 0.5, -1)
    return (weights @ v).transpose(1, 2).reshape(b, t, d) @ w_o.T


def _breaker_kv_per_query_head(x, w_q, w_k, w_v, w_o, n_heads, n_kv_heads):
    """One query head at a time, each projecting its group's K and V again from the weights (no copy of any weight)."""
    b, t, d = x.shape
    head, g = d // n_heads, n_heads // n_kv_heads
    outs = []
    for h in range(n_heads):
        rows = slice(h // g * head, (h // g + 1) * head)
        q = x @ w_q[h * head:(h + 1) * head].T
        k, v = x @ w_k[rows].T, x @ w_v[rows].T
        outs.append(torch.softmax(q @ k.transpose(-2, -1) / head ** 0.5, -1) @ v)
    return torch.cat(outs, -1) @ w_o.T
