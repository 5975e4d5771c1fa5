"""Chapter 13's breakers: right outputs computed the wrong way, which the properties in ch13.py must refuse. They
compute everything themselves (a breaker that called a helper of a checks module would be refused for that call,
which proves nothing about its property)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


# Exercise 1's breakers take g (B, H, T, Dk): one log-decay per token, head and key channel.


def _breaker_chunk_loop(q, k, v, g, initial_state, chunk_size):
    """Chunk by chunk in a Python loop, the state carried (the package's way): right, but one step per chunk."""
    S, outs, states = initial_state, [], [initial_state]
    for a in range(0, q.shape[2], chunk_size):
        qc, kc, vc, G = q[:, :, a:a + chunk_size], k[:, :, a:a + chunk_size], v[:, :, a:a + chunk_size], \
            g[:, :, a:a + chunk_size].cumsum(-2)
        keep = torch.ones(G.shape[-2], G.shape[-2], dtype=torch.bool).tril()[..., None]
        decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~keep, -math.inf).exp()  # (B,H,c,c,Dk)
        w = torch.einsum("bhrd,bhsd,bhrsd->bhrs", qc, kc, decay)
        outs.append((qc * G.exp()) @ S + w @ vc)
        S = S * G[..., -1, :, None].exp() + (kc * (G[..., -1:, :] - G).exp()).transpose(-2, -1) @ vc
        states.append(S)
    return torch.cat(outs, 2), torch.stack(states, 2)


def _breaker_token_loop(q, k, v, g, initial_state, chunk_size):
    """The recurrence, one token at a time: right, but the work grows with the tokens."""
    S = initial_state
    outs, states = [], [S]
    for t in range(q.shape[2]):
        S = S * g[:, :, t, :, None].exp() + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((S * q[:, :, t, :, None]).sum(-2))
        if (t + 1) % chunk_size == 0 or t + 1 == q.shape[2]:
            states.append(S)
    return torch.stack(outs, 2), torch.stack(states, 2)


def _breaker_quadratic(q, k, v, g, initial_state, chunk_size):
    """The (T, T) masked product, one mask per channel, and the boundary states from every key at once: right, but
    quadratic in T."""
    G = g.cumsum(-2)  # (B,H,T,Dk)
    T = q.shape[2]
    keep = torch.ones(T, T, dtype=torch.bool).tril()[..., None]
    diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~keep, float("-inf"))  # (B,H,T,T,Dk)
    o = torch.einsum("bhrd,bhsd,bhrsd->bhrs", q, k, diff.exp()) @ v + (q * G.exp()) @ initial_state
    ends = torch.tensor([min(e, T) for e in range(0, T + chunk_size, chunk_size)][:-(-T // chunk_size) + 1])
    Gb = F.pad(G, (0, 0, 1, 0))[..., ends, :]  # (B,H,n+1,Dk) log-decay from the start to each boundary
    w = (Gb[..., :, None, :] - G[..., None, :, :]).masked_fill((torch.arange(T)[None, :] >= ends[:, None])[..., None],
                                                               float("-inf"))  # (B,H,n+1,T,Dk)
    states = torch.einsum("bhnsk,bhsk,bhsv->bhnkv", w.exp(), k, v) + Gb.exp()[..., None] * initial_state[:, :, None]
    return o, states


def _breaker_rows_against_all_keys(q, k, v, g, initial_state, chunk_size):
    """A chunk of queries at a time, but against every earlier key (tiled, no state carried): quadratic in T."""
    G = g.cumsum(-2)  # (B,H,T,Dk)
    T = q.shape[2]
    outs, states = [], [initial_state]
    for a in range(0, T, chunk_size):
        b = min(a + chunk_size, T)
        diff = G[..., a:b, None, :] - G[..., None, :b, :]  # (B,H,c,b,Dk)
        keep = (torch.arange(a, b)[:, None] >= torch.arange(b)[None, :])[..., None]
        w = torch.einsum("bhrd,bhsd,bhrsd->bhrs", q[:, :, a:b], k[:, :, :b], diff.masked_fill(~keep, float("-inf")).exp())
        outs.append(w @ v[:, :, :b] + (q[:, :, a:b] * G[..., a:b, :].exp()) @ initial_state)
        rest = (G[..., b - 1:b, :] - G[..., :b, :]).exp()  # (B,H,b,Dk) decay from each key to the boundary
        states.append((k[:, :, :b] * rest).transpose(-2, -1) @ v[:, :, :b]
                      + G[..., b - 1, :, None].exp() * initial_state)
    return torch.cat(outs, 2), torch.stack(states, 2)


def _breaker_gdn_token_loop(q, k, v, g, beta, initial_state, chunk_size):
    """The gated delta rule one token at a time: right, but the work grows with the tokens."""
    S = initial_state
    outs, states = [], [S]
    for t in range(q.shape[2]):
        S = S * g[:, :, t, None, None].exp()
        u = beta[:, :, t, None] * (v[:, :, t] - (S * k[:, :, t, :, None]).sum(-2))
        S = S + k[:, :, t, :, None] * u[:, :, None, :]
        outs.append((S * q[:, :, t, :, None]).sum(-2))
        if (t + 1) % chunk_size == 0 or t + 1 == q.shape[2]:
            states.append(S)
    return torch.stack(outs, 2), torch.stack(states, 2)


def _breaker_gdn_all_chunks_solved_at_once(q, k, v, g, beta, initial_state, chunk_size):
    """The package's form (an edited copy of la.chunked with the boundary states kept): every chunk's system solved
    in one batched call before the loop. Right, but not the given code fixed."""
    B, H, T, Dk = q.shape
    C, n = chunk_size, -(-q.shape[2] // chunk_size)
    pad = n * C - T
    q, k, v = (F.pad(x, (0, 0, 0, pad)).reshape(B, H, n, C, -1) for x in (q, k, v))
    G = F.pad(g, (0, pad)).reshape(B, H, n, C).cumsum(-1)
    b = F.pad(beta, (0, pad)).reshape(B, H, n, C, 1)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    A = (b * (k @ k.transpose(-2, -1)) * decay).masked_fill(~causal.tril(-1), 0.0)
    eye = torch.eye(C, dtype=q.dtype)
    U0 = torch.linalg.solve_triangular(eye + A, b * v, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(eye + A, b * k * G[..., None].exp(), upper=False, unitriangular=True)
    S, outs, states = initial_state, [], [initial_state]
    for i in range(n):
        u = U0[:, :, i] - W[:, :, i] @ S
        outs.append((q[:, :, i] * G[:, :, i, :, None].exp()) @ S + ((q[:, :, i] @ k[:, :, i].transpose(-2, -1))
                                                                   * decay[:, :, i]) @ u)
        S = S * G[:, :, i, -1, None, None].exp() + \
            (k[:, :, i] * (G[:, :, i, -1:] - G[:, :, i])[..., None].exp()).transpose(-2, -1) @ u
        states.append(S)
    return torch.cat(outs, 2)[:, :, :T], torch.stack(states, 2)


# The given function of exercise 2 exactly as the exercise notebook shows it (tests/test_edits.py compares the two).
BUGGY_GDN = '''\
def gated_delta_chunked(q, k, v, g, beta, initial_state, chunk_size):
    # q, k (B, H, T, Dk), v (B, H, T, Dv), g and beta (B, H, T), initial_state (B, H, Dk, Dv)
    # -> o (B, H, T, Dv), states (B, H, n + 1, Dk, Dv): the state before each chunk, then the final one
    T = q.shape[2]
    S = initial_state
    outs, states = [], [S]
    for a in range(0, T, chunk_size):
        q_c, k_c, v_c, b_c = (x[:, :, a:a + chunk_size] for x in (q, k, v, beta))
        G = g[:, :, a:a + chunk_size].cumsum(-1)                          # (B,H,c) log-decay inside the chunk
        c = G.shape[-1]
        lower = torch.ones(c, c, dtype=torch.bool).tril()
        D = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, -math.inf).exp()   # (B,H,c,c) decay s -> r
        S_end = S * G[..., -1, None, None].exp()                          # the earlier chunks, at this chunk's end
        # the writes: (I + A) u = beta (v - what the state already returns for each key), A strictly lower
        A = (b_c[..., None] * (k_c @ k_c.transpose(-2, -1)) * D).tril(-1)  # (B,H,c,c)
        predicted = (k_c * G[..., None].exp()) @ S_end                 # (B,H,c,Dk) @ (B,H,Dk,Dv)
        u = torch.linalg.solve_triangular(torch.eye(c, dtype=q.dtype) + A, b_c[..., None] * (v_c - predicted),
                                          upper=False, unitriangular=True)  # (B,H,c,Dv)
        outs.append((q_c * G[..., None].exp()) @ S + ((q_c @ k_c.transpose(-2, -1)) * D) @ u)
        S = S_end + (k_c * (G[..., -1:] - G)[..., None].exp()).transpose(-2, -1) @ u
        states.append(S)
    return torch.cat(outs, 2), torch.stack(states, 2)                     # (B,H,T,Dv), (B,H,n+1,Dk,Dv)
'''


def _breaker_gdn_rewrite(q, k, v, g, beta, initial_state, chunk_size):
    """The chunkwise gated delta rule written afresh from the lesson without reading the given code (one triangular
    solve per chunk, the state carried): right, chunkwise, refused as no edit of the given function."""
    S, outs, states = initial_state, [], [initial_state]
    for a in range(0, q.shape[2], chunk_size):
        qc, kc, vc, bc = (x[:, :, a:a + chunk_size] for x in (q, k, v, beta))
        G = g[:, :, a:a + chunk_size].cumsum(-1)  # (B, H, c)
        n = G.shape[-1]
        keep = torch.ones(n, n, dtype=torch.bool).tril()
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(~keep, -math.inf).exp()  # (B, H, c, c)
        A = (bc[..., None] * (kc @ kc.transpose(-2, -1)) * decay).tril(-1)
        u = torch.linalg.solve_triangular(torch.eye(n, dtype=q.dtype) + A,
                                          bc[..., None] * (vc - (kc * G[..., None].exp()) @ S),
                                          upper=False, unitriangular=True)  # (B, H, c, Dv)
        outs.append((qc * G[..., None].exp()) @ S + ((qc @ kc.transpose(-2, -1)) * decay) @ u)
        S = S * G[..., -1, None, None].exp() + (kc * (G[..., -1:] - G)[..., None].exp()).transpose(-2, -1) @ u
        states.append(S)
    return torch.cat(outs, 2), torch.stack(states, 2)
