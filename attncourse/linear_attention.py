r"""Attention without the softmax: linear attention, decay gates, the (gated) delta rule, the chunkwise form and
Mamba-2's state-space duality.

One recurrence covers the whole family. The state :math:`S_t` is a (Dk, Dv) matrix per head; each token decays it,
optionally corrects what it stores under key :math:`k_t` (the delta rule), and reads it with :math:`q_t`:

.. math::
    \tilde S_t = \mathrm{diag}(e^{g_t})\, S_{t-1}, \qquad
    S_t = \tilde S_t + \beta_t\, k_t \bigl(v_t - \tilde S_t^\top k_t\bigr)^\top, \qquad
    o_t = s\, S_t^\top q_t

- ``g=None, beta=None``: plain (unnormalised) causal linear attention, :math:`S_t = S_{t-1} + k_t v_t^\top`;
- ``g`` of shape (B, H, T): a scalar decay per token and head (RetNet with a constant, Mamba-2 and Gated
  DeltaNet with a data-dependent one); of shape (B, H, T, Dk): a decay per key channel (GLA, Kimi Delta Attention);
- ``beta`` (B, H, T): the delta rule (DeltaNet); with ``g`` as well, the gated delta rule (Gated DeltaNet, KDA).
  Without ``beta`` the update is :math:`S_t = \tilde S_t + k_t v_t^\top`.

Layout as everywhere in the course: q, k (B, H, T, Dk), v (B, H, T, Dv). ``g`` is a log-decay (:math:`\alpha_t =
e^{g_t}`, so :math:`g \le 0` keeps the state bounded). The scale ``s`` defaults to :math:`D_k^{-1/2}` (as in
flash-linear-attention's reference kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _validate

State = torch.Tensor  # (B, H, Dk, Dv)


# ----------------------------------------------------------------------------- validation


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
           beta: torch.Tensor | None, initial_state: torch.Tensor | None = None) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _validate.tensor(name, x, min_rank=4, floating=True)
        if x.dim() != 4:
            raise ValueError(f"{name} must be (B, H, T, D), got shape {tuple(x.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape (B, H, T, Dk), got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be (B, H, T, Dv) with q's (B, H, T) = {tuple(q.shape[:3])}, got {tuple(v.shape)}")
    if g is not None:
        _validate.tensor("g", g, min_rank=3, floating=True)
        if tuple(g.shape) not in (tuple(q.shape[:3]), tuple(q.shape)):
            raise ValueError(f"g must be (B, H, T) = {tuple(q.shape[:3])} (one decay per head) or (B, H, T, Dk) = "
                             f"{tuple(q.shape)} (one per key channel), got {tuple(g.shape)}")
    if beta is not None:
        _validate.tensor("beta", beta, min_rank=3, floating=True)
        if tuple(beta.shape) != tuple(q.shape[:3]):
            raise ValueError(f"beta must be (B, H, T) = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    if initial_state is not None:
        want = (*q.shape[:2], q.shape[-1], v.shape[-1])
        _validate.tensor("initial_state", initial_state, min_rank=4, floating=True)
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be (B, H, Dk, Dv) = {want}, got {tuple(initial_state.shape)}")


def _scale(scale: float | None, dk: int) -> float:
    if scale is None:
        return dk ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    return float(scale)


# ----------------------------------------------------------------------------- the recurrent form


def recurrent_step(state: State, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
                   beta: torch.Tensor | None = None, scale: float | None = None) -> tuple[torch.Tensor, State]:
    """One token of the recurrence: the decode step, O(1) memory whatever the position.

    Args:
        state: (B, H, Dk, Dv) the state after the previous token.
        q, k: (B, H, Dk); v: (B, H, Dv) this token's query, key and value.
        g: None, (B, H) or (B, H, Dk): the log-decay of this step.
        beta: None or (B, H): the delta rule's write strength.
        scale: multiplies q (default Dk ** -0.5).
    Returns:
        (o, state): o (B, H, Dv) and the new (B, H, Dk, Dv) state.
    Raises:
        TypeError, ValueError: for non-tensors or shapes that do not match.
    """
    _validate.tensor("state", state, min_rank=4, floating=True)
    if state.dim() != 4:
        raise ValueError(f"state must be (B, H, Dk, Dv), got shape {tuple(state.shape)}")
    _check(q[:, :, None], k[:, :, None], v[:, :, None], None if g is None else g[:, :, None],
           None if beta is None else beta[:, :, None], state)
    if g is not None:
        decay = g.exp()  # (B,H) or (B,H,Dk)
        state = state * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])  # (B,H,Dk,Dv)
    if beta is None:
        new_value = v  # (B,H,Dv)
    else:
        stored = (state * k[..., None]).sum(-2)  # S^T k: (B,H,Dk,Dv) * (B,H,Dk,1) -> (B,H,Dv)
        new_value = beta[..., None] * (v - stored)  # (B,H,Dv) the correction the delta rule writes
    state = state + k[..., :, None] * new_value[..., None, :]  # (B,H,Dk,1) * (B,H,1,Dv) -> (B,H,Dk,Dv)
    o = (state * q[..., None]).sum(-2) * _scale(scale, q.shape[-1])  # S^T q: (B,H,Dv)
    return o, state


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
              beta: torch.Tensor | None = None, scale: float | None = None,
              initial_state: State | None = None) -> tuple[torch.Tensor, State]:
    """The whole sequence, one token at a time (the reference every other form is checked against).

    Args:
        q, k: (B, H, T, Dk); v: (B, H, T, Dv).
        g: None, (B, H, T) or (B, H, T, Dk): log-decays. beta: None or (B, H, T).
        scale: multiplies q (default Dk ** -0.5). initial_state: None (zeros) or (B, H, Dk, Dv).
    Returns:
        (o, state): o (B, H, T, Dv) and the final state (B, H, Dk, Dv), in the inputs' dtype.
    Raises:
        TypeError, ValueError: for non-tensors or shapes that do not match.
    """
    _check(q, k, v, g, beta, initial_state)
    B, H, T, Dk = q.shape
    state = initial_state if initial_state is not None else q.new_zeros(B, H, Dk, v.shape[-1])
    outs = []
    for t in range(T):
        o, state = recurrent_step(state, q[:, :, t], k[:, :, t], v[:, :, t], None if g is None else g[:, :, t],
                                  None if beta is None else beta[:, :, t], scale)
        outs.append(o)
    return torch.stack(outs, dim=2), state  # (B,H,T,Dv)


# ----------------------------------------------------------------------------- the parallel (attention) form


def segsum(g: torch.Tensor) -> torch.Tensor:
    """Sums of a log-decay over segments: out[..., t, s] = g[s+1] + ... + g[t] for s <= t, -inf above the diagonal.

    Args:
        g: (..., T) log-decays.
    Returns:
        (..., T, T): exp of it is the decay from position s to position t (1 on the diagonal, 0 above it).
    Raises:
        TypeError, ValueError: for a non-tensor or a rank-0 tensor.
    """
    _validate.tensor("g", g, min_rank=1, floating=True)
    T = g.shape[-1]
    # Sum the entries of each segment directly rather than subtract two cumulative sums (no cancellation).
    x = g[..., :, None].expand(*g.shape, T)  # (...,T,T): x[..., j, s] = g[j]
    later = torch.ones(T, T, dtype=torch.bool, device=g.device).tril(-1)  # (T,T) j > s
    out = x.masked_fill(~later, 0.0).cumsum(-2)  # (...,T,T): out[t, s] = sum of g[j] for s < j <= t
    causal = torch.ones(T, T, dtype=torch.bool, device=g.device).tril()  # (T,T) s <= t
    return out.masked_fill(~causal, float("-inf"))


def decay_mask(g: torch.Tensor) -> torch.Tensor:
    """The 1-semiseparable causal mask L[..., t, s] = exp(g[s+1] + ... + g[t]) for s <= t, 0 above the diagonal.

    With g = 0 it is the plain causal mask of ones (linear attention); with a constant g it is RetNet's
    :math:`\\gamma^{t-s}`. Args: g (..., T). Returns: (..., T, T). Raises as :func:`segsum`.
    """
    return segsum(g).exp()


def parallel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
             scale: float | None = None) -> torch.Tensor:
    """Linear attention with optional decay as one masked product, O(T^2): (Q K^T * L) V, no softmax.

    Args:
        q, k: (B, H, T, Dk); v: (B, H, T, Dv); g: None, (B, H, T) or (B, H, T, Dk) log-decays.
        scale: multiplies q (default Dk ** -0.5).
    Returns:
        o (B, H, T, Dv), equal to :func:`recurrent` without ``beta``.
    Raises:
        TypeError, ValueError: for non-tensors or shapes that do not match.
    """
    _check(q, k, v, g, None)
    q = q * _scale(scale, q.shape[-1])
    T = q.shape[2]
    if g is None or g.dim() == 3:
        scores = q @ k.transpose(-2, -1)  # (B,H,T,Dk) @ (B,H,Dk,T) -> (B,H,T,T)
        mask = decay_mask(g) if g is not None else torch.ones(T, T, dtype=q.dtype, device=q.device).tril()
        return (scores * mask) @ v  # (B,H,T,T) @ (B,H,T,Dv) -> (B,H,T,Dv)
    # one decay per key channel: the mask differs per channel, so it enters the scores' sum over Dk
    mask = decay_mask(g.transpose(-2, -1))  # (B,H,Dk,T,T)
    scores = torch.einsum("bhtc,bhsc,bhcts->bhts", q, k, mask)  # (B,H,T,T)
    return scores @ v


# ----------------------------------------------------------------------------- the chunkwise form


def _decayed_products(a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """(B,H,n,C,D) and (B,H,n,C,D) with decay (B,H,n,C,C,1 or D) -> (B,H,n,C,C): sum_c a_rc b_sc decay_rsc."""
    if decay.shape[-1] == 1:  # one decay per head: it factors out of the sum over channels
        return (a @ b.transpose(-2, -1)) * decay[..., 0]  # (B,H,n,C,D) @ (B,H,n,D,C) -> (B,H,n,C,C)
    return torch.einsum("bhnrc,bhnsc,bhnrsc->bhnrs", a, b, decay)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
            beta: torch.Tensor | None = None, chunk_size: int = 64, scale: float | None = None,
            initial_state: State | None = None) -> tuple[torch.Tensor, State]:
    r"""The chunkwise-parallel form used for training: inside a chunk of C tokens everything is a (C, C) masked
    product; between chunks only the (Dk, Dv) state is carried. Equal to :func:`recurrent` in exact arithmetic.

    With the delta rule, the corrections :math:`u_r = \beta_r (v_r - \tilde S_r^\top k_r)` of a chunk depend on
    each other; they solve one unit lower-triangular system :math:`(I + A) U = \mathrm{diag}(\beta)(V - (K \odot
    e^{G}) S_0)` with :math:`A_{rs} = \beta_r \sum_c k_{rc} k_{sc} e^{G_{rc} - G_{sc}}` for s < r (the UT form of
    the WY representation; :math:`G` the cumulative log-decay inside the chunk).

    Args:
        q, k: (B, H, T, Dk); v: (B, H, T, Dv); g: None, (B, H, T) or (B, H, T, Dk); beta: None or (B, H, T).
        chunk_size: C; T need not be a multiple (the last chunk is padded with tokens that change nothing).
        scale: multiplies q (default Dk ** -0.5). initial_state: None (zeros) or (B, H, Dk, Dv).
    Returns:
        (o, state): o (B, H, T, Dv) and the final state (B, H, Dk, Dv).
    Raises:
        TypeError, ValueError: for non-tensors, shapes that do not match, or a chunk_size below 1.
    """
    _check(q, k, v, g, beta, initial_state)
    _validate.positive_int("chunk_size", chunk_size)
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    C = chunk_size
    n = -(-T // C)
    pad = n * C - T  # padded tokens: k = v = beta = g = 0 leave the state as it is
    q = q * _scale(scale, Dk)
    gg = q.new_zeros(B, H, T, 1) if g is None else (g[..., None] if g.dim() == 3 else g)  # (B,H,T,1 or Dk)
    q, k, v, gg = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, gg))
    split = (lambda x: x.reshape(B, H, n, C, x.shape[-1]))  # (B,H,T',D) -> (B,H,n,C,D)
    q, k, v, gg = split(q), split(k), split(v), split(gg)
    G = gg.cumsum(-2)  # (B,H,n,C,Dg) cumulative log-decay inside each chunk (Dg = 1 or Dk)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # (C,C) s <= r
    diff = (G[..., :, None, :] - G[..., None, :, :])  # (B,H,n,C,C,Dg) G_r - G_s
    decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()  # 0 above the diagonal: no overflow
    qk = _decayed_products(q, k, decay)  # (B,H,n,C,C) q_r . (k_s * e^(G_r - G_s)), 0 for s > r
    if beta is not None:
        b = F.pad(beta, (0, pad)).reshape(B, H, n, C, 1)  # (B,H,n,C,1)
        kk = _decayed_products(k, k, decay)  # (B,H,n,C,C)
        A = (b * kk).masked_fill(~causal.tril(-1), 0.0)  # (B,H,n,C,C) strictly lower
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        # T = (I + A)^{-1} applied to diag(beta) V and to diag(beta)(K * e^G): one triangular solve each
        U0 = torch.linalg.solve_triangular(eye + A, b * v, upper=False, unitriangular=True)  # (B,H,n,C,Dv)
        W = torch.linalg.solve_triangular(eye + A, b * k * G.exp(), upper=False, unitriangular=True)  # (...,C,Dk)
    state = initial_state if initial_state is not None else q.new_zeros(B, H, Dk, Dv)
    outs = []
    for i in range(n):  # only the state crosses chunk boundaries
        u = v[:, :, i] if beta is None else U0[:, :, i] - W[:, :, i] @ state  # (B,H,C,Dv) values written
        Gi = G[:, :, i]  # (B,H,C,Dg)
        inter = (q[:, :, i] * Gi.exp()) @ state  # (B,H,C,Dk) @ (B,H,Dk,Dv) -> (B,H,C,Dv): the earlier chunks
        outs.append(inter + qk[:, :, i] @ u)  # + (B,H,C,C) @ (B,H,C,Dv): this chunk
        last = Gi[:, :, -1:]  # (B,H,1,Dg) decay over the whole chunk
        state = state * last.transpose(-2, -1).exp() + \
            (k[:, :, i] * (last - Gi).exp()).transpose(-2, -1) @ u  # (B,H,Dk,C) @ (B,H,C,Dv)
    o = torch.cat(outs, dim=2)[:, :, :T]  # (B,H,T,Dv)
    return o, state


# ----------------------------------------------------------------------------- per-channel decay as matrix products


def gla_intra(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub_chunk: int | None = 16) -> torch.Tensor:
    r"""The intra-chunk scores of a per-channel decay (GLA, KDA) as a kernel computes them:
    :math:`A_{rs} = \sum_c q_{rc} k_{sc} e^{G_{rc} - G_{sc}}` for s <= r, 0 above the diagonal.

    The sum over channels does not factor out of the decay, so a direct form needs a (C, C, Dk) tensor. Matrix
    units want a product instead: :math:`A = (Q \odot e^{G})(K \odot e^{-G})^\top`, masked. ``sub_chunk=None``
    computes exactly that, and :math:`e^{-G}` overflows once a channel's cumulative log-decay inside the chunk
    passes about -88 (float32; -11 in float16). With ``sub_chunk=c`` it follows flash-linear-attention's GLA
    kernels (``chunk_gla_fwd_A_kernel_intra_sub_inter`` / ``_sub_intra``, the GLA paper's secondary chunking):
    the rows of each sub-chunk of c queries are taken relative to that sub-chunk's first position n, as
    :math:`(Q_i \odot e^{G_i - G_n})(K_{<n} \odot e^{G_n - G_{<n}})^\top`, where both exponents are <= 0; only
    the (c, c) diagonal blocks are computed channel by channel, in log space.

    Args:
        q, k: (B, H, C, Dk) one chunk (the scale already applied to q); G: (B, H, C, Dk) the cumulative
        log-decay inside the chunk (non-increasing along C); sub_chunk: None (one product) or a positive int.
    Returns:
        A: (B, H, C, C).
    Raises:
        TypeError, ValueError: for non-tensors, shapes that differ or a sub_chunk below 1.
    """
    for name, x in (("q", q), ("k", k), ("G", G)):
        _validate.tensor(name, x, min_rank=4, floating=True)
    if q.shape != k.shape or G.shape != q.shape or q.dim() != 4:
        raise ValueError(f"q, k and G must share one shape (B, H, C, Dk), got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"G {tuple(G.shape)}")
    C = q.shape[2]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # (C, C) s <= r
    if sub_chunk is None:
        A = (q * G.exp()) @ (k * (-G).exp()).transpose(-2, -1)  # (B,H,C,Dk) @ (B,H,Dk,C): overflows for strong decay
        return A.masked_fill(~causal, 0.0)
    _validate.positive_int("sub_chunk", sub_chunk)
    A = q.new_zeros(*q.shape[:2], C, C)
    for i0 in range(0, C, sub_chunk):
        i1 = min(i0 + sub_chunk, C)
        Gn = G[:, :, i0:i0 + 1]  # (B,H,1,Dk) the sub-chunk's first position: the reference point
        if i0 > 0:  # every earlier key of the chunk, one product; both factors <= 1
            qi = q[:, :, i0:i1] * (G[:, :, i0:i1] - Gn).exp()  # (B,H,c,Dk)
            kj = k[:, :, :i0] * (Gn - G[:, :, :i0]).exp()  # (B,H,i0,Dk)
            A[:, :, i0:i1, :i0] = qi @ kj.transpose(-2, -1)  # (B,H,c,i0)
        d = G[:, :, i0:i1, None, :] - G[:, :, None, i0:i1, :]  # (B,H,c,c,Dk) G_r - G_s, log space
        d = d.masked_fill(~causal[:i1 - i0, :i1 - i0, None], float("-inf"))
        A[:, :, i0:i1, i0:i1] = (q[:, :, i0:i1, None, :] * k[:, :, None, i0:i1, :] * d.exp()).sum(-1)  # (B,H,c,c)
    return A


def chunk_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, chunk_size: int = 64,
              sub_chunk: int | None = 16, scale: float | None = None,
              initial_state: State | None = None) -> tuple[torch.Tensor, State]:
    r"""Gated linear attention with a decay per key channel, chunk by chunk, in the matrix-product form of
    flash-linear-attention's ``chunk_gla``: the intra-chunk scores from :func:`gla_intra` (secondary chunking when
    ``sub_chunk`` is set), the earlier chunks through the state, :math:`(Q \odot e^{G}) S`, and the state carried as
    :math:`S \leftarrow e^{G_C} \odot S + (K \odot e^{G_C - G})^\top V`: every exponent <= 0. Equal to
    :func:`recurrent` with the same per-channel ``g``.

    Args:
        q, k: (B, H, T, Dk); v: (B, H, T, Dv); g: (B, H, T, Dk) log-decays (<= 0 keeps the state bounded).
        chunk_size: C (T need not be a multiple); sub_chunk: None or a positive int (see :func:`gla_intra`).
        scale: multiplies q (default Dk ** -0.5). initial_state: None (zeros) or (B, H, Dk, Dv).
    Returns:
        (o, state): o (B, H, T, Dv) and the final state (B, H, Dk, Dv).
    Raises:
        TypeError, ValueError: for non-tensors, a g that is not (B, H, T, Dk), or a chunk_size below 1.
    """
    _check(q, k, v, g, None, initial_state)
    if g.shape != q.shape:
        raise ValueError(f"g must hold one log-decay per key channel, (B, H, T, Dk) = {tuple(q.shape)}, "
                         f"got {tuple(g.shape)}")
    _validate.positive_int("chunk_size", chunk_size)
    B, H, T, Dk = q.shape
    q = q * _scale(scale, Dk)
    state = initial_state if initial_state is not None else q.new_zeros(B, H, Dk, v.shape[-1])
    outs = []
    for a in range(0, T, chunk_size):
        qc, kc, vc = q[:, :, a:a + chunk_size], k[:, :, a:a + chunk_size], v[:, :, a:a + chunk_size]  # (B,H,c,D)
        G = g[:, :, a:a + chunk_size].cumsum(2)  # (B,H,c,Dk) inside the chunk only
        A = gla_intra(qc, kc, G, sub_chunk)  # (B,H,c,c)
        outs.append((qc * G.exp()) @ state + A @ vc)  # earlier chunks + this one: (B,H,c,Dv)
        last = G[:, :, -1:]  # (B,H,1,Dk) the whole chunk's decay
        state = state * last.transpose(-2, -1).exp() + (kc * (last - G).exp()).transpose(-2, -1) @ vc
    return torch.cat(outs, 2), state


# ----------------------------------------------------------------------------- Mamba-2's scalar SSM


def ssm_scan(x: torch.Tensor, log_a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    r"""A selective state-space model with a scalar decay per step (Mamba-2's SSD layer, one head), as a scan:

    .. math:: h_t = a_t h_{t-1} + b_t x_t^\top, \qquad y_t = h_t^\top c_t

    Args:
        x: (B, H, T, P) inputs (already multiplied by the step size); log_a: (B, H, T) log of a_t;
        b, c: (B, H, T, N) the input and output projections (N the state size).
    Returns:
        y (B, H, T, P).
    Raises:
        TypeError, ValueError: for non-tensors or shapes that do not match.
    """
    _check(c, b, x, log_a, None)
    h = x.new_zeros(*x.shape[:2], b.shape[-1], x.shape[-1])  # (B,H,N,P)
    ys = []
    for t in range(x.shape[2]):
        h = log_a[:, :, t, None, None].exp() * h + b[:, :, t, :, None] * x[:, :, t, None, :]  # (B,H,N,P)
        ys.append((h * c[:, :, t, :, None]).sum(-2))  # h^T c: (B,H,P)
    return torch.stack(ys, dim=2)


def state_bytes(n_heads: int, key_dim: int, value_dim: int, bytes_per_element: int = 2) -> int:
    """Bytes of one layer's recurrent state for one sequence: a (Dk, Dv) matrix per head, whatever the length.

    Raises: TypeError, ValueError for arguments that are not positive ints.
    """
    for name, x in (("n_heads", n_heads), ("key_dim", key_dim), ("value_dim", value_dim),
                    ("bytes_per_element", bytes_per_element)):
        _validate.positive_int(name, x)
    return n_heads * key_dim * value_dim * bytes_per_element
