r"""The chunkwise backward pass of decayed linear attention, written out (chapter 13, section 5).

Forward, for one chunk of C tokens with cumulative log-decays :math:`G` (inside the chunk), the state :math:`S`
at its start and :math:`D_{rs} = e^{G_r - G_s}` for :math:`s \le r` (0 above the diagonal):

.. math::
    O = \big((Q K^\top) \odot D\big) V + (Q \odot e^{G}) S, \qquad
    S' = e^{G_C} S + (K \odot e^{G_C - G})^\top V .

Backward, given :math:`dO` and the gradient :math:`dS'` of the state at the chunk's end (from the later chunks),
with :math:`P = (Q K^\top) \odot D` and :math:`dA = (dO\,V^\top) \odot D`:

.. math::
    dQ = dA\,K + (dO\,S^\top) \odot e^{G}, \quad
    dK = dA^\top Q + (V\,dS'^\top) \odot e^{G_C - G}, \quad
    dV = P^\top dO + (K \odot e^{G_C - G})\, dS', \quad
    dS = (Q \odot e^{G})^\top dO + e^{G_C}\, dS' .

The log-decays enter only through differences :math:`G_t - G_s` (query position minus key position), so the gradient
of :math:`G_t` is what :math:`t` receives as a query minus what it gives as a key,
:math:`dG_t = q_t \cdot dq_t - k_t \cdot dk_t`, and :math:`dg_t = \sum_{t' \ge t} dG_{t'}` because
:math:`G_t = \sum_{\tau \le t} g_\tau` (a reverse cumulative sum; flash-linear-attention's GLA and Gated DeltaNet
kernels compute their gate gradients this way). The boundaries count too: the state's decay :math:`e^{G_C}` between
chunks is handled by taking :math:`G` cumulative over the whole sequence in this identity.

What a training kernel stores is the point: the forward keeps only the :math:`n + 1` boundary states, and the
backward recomputes each chunk's :math:`P` and :math:`D` from :math:`Q, K, G` (flash-linear-attention's
``chunk_fwd_h`` and ``chunk_bwd_dh``); autograd through :func:`attncourse.linear_attention.chunked` keeps every
intermediate of every chunk instead. :func:`chunked_forward` and :func:`chunked_backward` do the former;
``tests/test_chunked_backward.py`` checks them against autograd in float64.
"""

from __future__ import annotations

import torch

from . import _validate
from .linear_attention import _check


def _split(x: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """(B, H, T, ...) -> (B, H, n, C, ...), padded with zeros (a zero key, value, query or log-decay changes
    nothing)."""
    pad = n * C - x.shape[2]
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:2], pad, *x.shape[3:])], 2)
    return x.reshape(*x.shape[:2], n, C, *x.shape[3:])


def _decay(G: torch.Tensor) -> torch.Tensor:
    """(B, H, n, C) cumulative log-decays -> (B, H, n, C, C) D[r, s] = e^(G_r - G_s) for s <= r, else 0."""
    C = G.shape[-1]
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()
    return (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()


def chunked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, initial_state: torch.Tensor,
                    chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decayed linear attention (one log-decay per token and head, no scale), chunk by chunk.

    Args:
        q, k: (B, H, T, Dk); v: (B, H, T, Dv); g: (B, H, T) log-decays; initial_state: (B, H, Dk, Dv).
    Returns:
        (o (B, H, T, Dv), states (B, H, n + 1, Dk, Dv)): the boundary states, all a backward needs besides the inputs.
    Raises:
        TypeError, ValueError: for non-tensors, shapes that do not match or a chunk_size below 1.
    """
    _check(q, k, v, g, None, initial_state)
    _validate.positive_int("chunk_size", chunk_size)
    if g.dim() != 3:
        raise ValueError(f"g must be (B, H, T) = {tuple(q.shape[:3])} (one decay per head), got {tuple(g.shape)}")
    T, C = q.shape[2], chunk_size
    n = -(-T // C)
    Q, K, V, G = _split(q, n, C), _split(k, n, C), _split(v, n, C), _split(g, n, C).cumsum(-1)  # (B,H,n,C,.)
    D = _decay(G)  # (B,H,n,C,C)
    S, outs, states = initial_state, [], [initial_state]
    for i in range(n):
        Gi = G[:, :, i]  # (B,H,C)
        outs.append(((Q[:, :, i] @ K[:, :, i].transpose(-2, -1)) * D[:, :, i]) @ V[:, :, i]
                    + (Q[:, :, i] * Gi[..., None].exp()) @ S)  # (B,H,C,Dv)
        S = Gi[..., -1, None, None].exp() * S + (K[:, :, i] * (Gi[..., -1:] - Gi)[..., None].exp()).transpose(-2, -1) \
            @ V[:, :, i]  # (B,H,Dk,C) @ (B,H,C,Dv)
        states.append(S)
    return torch.cat(outs, 2)[:, :, :T], torch.stack(states, 2)


def chunked_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, states: torch.Tensor,
                     d_o: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, ...]:
    """Gradients of a loss that depends on :func:`chunked_forward`'s output `o` only, from the inputs, the stored
    boundary states and dL/do, chunk by chunk from the last (each chunk's scores recomputed, nothing else stored).

    Args:
        q, k, v, g: as :func:`chunked_forward`; states: its (B, H, n + 1, Dk, Dv); d_o: (B, H, T, Dv).
    Returns:
        (dq, dk, dv, dg, d_initial_state), shaped like q, k, v, g and the initial state.
    Raises:
        TypeError, ValueError: for non-tensors or shapes that do not match.
    """
    _check(q, k, v, g, None, states[:, :, 0])
    _validate.positive_int("chunk_size", chunk_size)
    T, C = q.shape[2], chunk_size
    n = -(-T // C)
    if tuple(states.shape) != (*q.shape[:2], n + 1, q.shape[-1], v.shape[-1]) or d_o.shape != v.shape:
        raise ValueError(f"states must be (B, H, n + 1 = {n + 1}, Dk, Dv) and d_o like v {tuple(v.shape)}, got "
                         f"states {tuple(states.shape)} and d_o {tuple(d_o.shape)}")
    Q, K, V, dO = _split(q, n, C), _split(k, n, C), _split(v, n, C), _split(d_o, n, C)
    G = _split(g, n, C).cumsum(-1)  # (B,H,n,C) inside each chunk
    D = _decay(G)  # (B,H,n,C,C), recomputed: the forward did not keep it
    dQ, dK, dV = torch.zeros_like(Q), torch.zeros_like(K), torch.zeros_like(V)
    dS = torch.zeros_like(states[:, :, 0])  # dL/d(state at the end of the last chunk): o does not read it
    for i in reversed(range(n)):
        Gi, Di, S = G[:, :, i], D[:, :, i], states[:, :, i]  # S: the state at the chunk's start
        left = (Gi[..., -1:] - Gi)[..., None].exp()  # (B,H,C,1) e^(G_C - G_s)
        dA = (dO[:, :, i] @ V[:, :, i].transpose(-2, -1)) * Di  # (B,H,C,C)
        P = (Q[:, :, i] @ K[:, :, i].transpose(-2, -1)) * Di  # (B,H,C,C)
        dQ[:, :, i] = dA @ K[:, :, i] + (dO[:, :, i] @ S.transpose(-2, -1)) * Gi[..., None].exp()
        dK[:, :, i] = dA.transpose(-2, -1) @ Q[:, :, i] + (V[:, :, i] @ dS.transpose(-2, -1)) * left
        dV[:, :, i] = P.transpose(-2, -1) @ dO[:, :, i] + (K[:, :, i] * left) @ dS
        dS = (Q[:, :, i] * Gi[..., None].exp()).transpose(-2, -1) @ dO[:, :, i] + Gi[..., -1, None, None].exp() * dS
    dq, dk, dv = (x.flatten(2, 3)[:, :, :T] for x in (dQ, dK, dV))
    dG = (q * dq).sum(-1) - (k * dk).sum(-1)  # (B,H,T) query share minus key share of each cumulative log-decay
    dg = dG.flip(-1).cumsum(-1).flip(-1)  # G_t = g_1 + ... + g_t: dg_t sums dG over t' >= t
    return dq, dk, dv, dg, dS
