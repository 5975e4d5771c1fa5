r"""FlashAttention's options in the tiled loop: a two-sided local window, logit soft-capping, ALiBi slopes,
attention dropout with the random mask regenerated in the backward, and packed variable-length batches.

These are the arguments a learner meets first when porting to ``flash_attn.flash_attn_func`` /
``flash_attn_varlen_func``: ``window_size=(left, right)``, ``softcap``, ``alibi_slopes``, ``dropout_p`` and
``cu_seqlens``. :func:`flash_attention_options` runs chapter 09's forward and backward loops (queries outside in
the forward, keys outside in the backward, P rebuilt from the saved lse) with all of them, one tile at a time, and
never holds a (Tq, Tk) matrix. It is written for clarity, not speed: the fast path of the course stays
:func:`attncourse.flash_attention` (its benchmark is unaffected by these options). :func:`dense_reference` is the
same computation with the whole score matrix, differentiated by autograd, which the tests and chapter 09 compare
against.

Conventions (FlashAttention's): positions are aligned **bottom-right** (query i sits at position
``i + Tk - Tq`` of the keys); key j is visible to that query iff ``pos - left <= j <= pos + right`` (``None`` for
an unbounded side; ``is_causal`` is ``right = 0``); soft-capping replaces a scaled score s by
``softcap * tanh(s / softcap)`` before the bias and the mask; ALiBi adds ``-slope_h * |pos - j|``; dropout zeroes
each probability with probability p and scales the others by 1 / (1 - p), after the softmax, with a mask that is a
pure function of ``(seed, row, query index, key index)`` (a counter-based hash, as FlashAttention's Philox
generator is keyed by offsets), so the backward regenerates it tile by tile instead of storing it.
"""

from __future__ import annotations

import math

import torch

from . import _validate

__all__ = ["dropout_keep", "flash_attention_options", "dense_reference", "varlen_attention"]

_NEG_INF = float("-inf")
_M1, _M2 = -4658895280553007687, -7723592293110705685  # splitmix64's multipliers as signed 64-bit integers


def _mix(z: torch.Tensor) -> torch.Tensor:
    """A 64-bit integer hash (splitmix64's finaliser, with logical shifts emulated by masks)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _M1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _M2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def dropout_keep(seed: int, rows: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor, p: float) -> torch.Tensor:
    """Bool keep-mask (R, Tq', Tk') for rows `rows` (R,) (batch x head index), query indices `q_idx` (Tq',) and key
    indices `k_idx` (Tk',): True with probability 1 - p, a pure function of its arguments (any tile of the
    full mask is recomputed exactly). Raises ValueError for p outside [0, 1)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p must be in [0, 1), got {p}")
    z = (rows.long()[:, None, None] * 1_000_003 + q_idx.long()[None, :, None]) * 1_000_033 + k_idx.long()[None, None, :]
    z = _mix(_mix(z + int(seed) * 0x9E3779B9))
    return (z & ((1 << 24) - 1)) >= int(p * (1 << 24))  # (R, Tq', Tk')


def _check(query, key, value, window, softcap, alibi_slopes, dropout_p, seed, block_q, block_k):
    for name, x in (("query", query), ("key", key), ("value", value)):
        _validate.tensor(name, x, min_rank=4, floating=True)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or key.shape[:2] != query.shape[:2] \
            or key.shape[-1] != query.shape[-1] or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"need query (B, H, Tq, D), key (B, H, Tk, D), value (B, H, Tk, Dv), got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if not (isinstance(window, tuple) and len(window) == 2
            and all(w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 0) for w in window)):
        raise ValueError(f"window must be a pair (left, right) of ints >= 0 or None, got {window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"softcap must be None or a positive number, got {softcap!r}")
    if alibi_slopes is not None:
        _validate.tensor("alibi_slopes", alibi_slopes, floating=True)
        if tuple(alibi_slopes.shape) != (query.shape[1],):
            raise ValueError(f"alibi_slopes must have shape (H,) = ({query.shape[1]},), got {tuple(alibi_slopes.shape)}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    _validate.positive_int("block_q", block_q)
    _validate.positive_int("block_k", block_k)


class _Tiles:
    """What a (query block, key block) tile needs, shared by the forward and the backward."""

    def __init__(self, b, h, t_q, t_k, window, softcap, alibi_slopes, dropout_p, seed, scale, segments):
        self.b, self.h, self.t_q, self.t_k = b, h, t_q, t_k
        self.left, self.right = window
        self.softcap, self.slopes, self.p, self.seed, self.scale = softcap, alibi_slopes, dropout_p, seed, scale
        self.shift = t_k - t_q
        self.segments = segments  # None, or (q_seg (Tq,), k_seg (Tk,), q_pos (Tq,), k_pos (Tk,)) for packed batches

    def key_range(self, q0: int, q1: int) -> tuple[int, int]:
        """Keys any query of rows q0..q1-1 may see (tiles outside are never visited)."""
        if self.segments is not None:
            q_seg, k_seg = self.segments[0], self.segments[1]
            first, last = int(q_seg[q0]), int(q_seg[q1 - 1])
            lo = int(torch.searchsorted(k_seg, torch.tensor(first)))
            hi = int(torch.searchsorted(k_seg, torch.tensor(last), right=True))
            return lo, hi  # the keys of the sequences these queries belong to (windows are applied per element)
        lo = 0 if self.left is None else max(0, q0 + self.shift - self.left)
        hi = self.t_k if self.right is None else min(self.t_k, q1 - 1 + self.shift + self.right + 1)
        return lo, hi

    def scores(self, q_blk, k_blk, q0, q1, k0, k1):
        """Raw scaled scores (B*H, Bq, Bk) -> (capped scores, biased + masked scores)."""
        s = torch.bmm(q_blk, k_blk.transpose(1, 2)) * self.scale  # (BH, Bq, D) @ (BH, D, Bk) -> (BH, Bq, Bk)
        capped = s if self.softcap is None else self.softcap * torch.tanh(s / self.softcap)
        if self.segments is None:
            pos = torch.arange(q0, q1)[:, None] + self.shift  # (Bq, 1) aligned positions
            j = torch.arange(k0, k1)[None, :]  # (1, Bk)
            same = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        else:
            q_seg, k_seg, q_pos, k_pos = self.segments
            same = q_seg[q0:q1, None] == k_seg[None, k0:k1]  # (Bq, Bk): the same packed sequence
            pos, j = q_pos[q0:q1, None], k_pos[None, k0:k1]  # positions inside each sequence (bottom-right)
        keep = same.clone()
        if self.left is not None:
            keep &= j >= pos - self.left
        if self.right is not None:
            keep &= j <= pos + self.right
        out = capped
        if self.slopes is not None:
            dist = (pos - j).abs().to(s.dtype)  # (Bq, Bk)
            out = out - self.slopes.to(s.dtype).repeat(self.b)[:, None, None] * dist  # (BH, Bq, Bk)
        return capped, out.masked_fill(~keep, _NEG_INF)

    def dropout_scale(self, q0, q1, k0, k1, like: torch.Tensor):
        """(BH, Bq, Bk) keep / (1 - p) in `like`'s dtype, regenerated from the seed, or None without dropout."""
        if self.p == 0:
            return None
        rows = torch.arange(self.b * self.h)
        keep = dropout_keep(self.seed, rows, torch.arange(q0, q1), torch.arange(k0, k1), self.p)
        return keep.to(device=like.device, dtype=like.dtype) / (1 - self.p)


def _forward(q, k, v, tiles: _Tiles, block_q, block_k):
    """q (BH, Tq, D), k (BH, Tk, D), v (BH, Tk, Dv) -> out (BH, Tq, Dv), lse (BH, Tq)."""
    bh, t_q, _ = q.shape
    out = q.new_zeros(bh, t_q, v.shape[-1])
    lse = q.new_full((bh, t_q), _NEG_INF)
    for q0 in range(0, t_q, block_q):
        q1 = min(q0 + block_q, t_q)
        lo, hi = tiles.key_range(q0, q1)
        m = q.new_full((bh, q1 - q0, 1), _NEG_INF)
        l = q.new_zeros(bh, q1 - q0, 1)  # noqa: E741
        acc = q.new_zeros(bh, q1 - q0, v.shape[-1])
        for k0 in range(lo, hi, block_k):
            k1 = min(k0 + block_k, hi)
            _, s = tiles.scores(q[:, q0:q1], k[:, k0:k1], q0, q1, k0, k1)  # (BH, Bq, Bk)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            ref = m_new.masked_fill(m_new == _NEG_INF, 0.0)
            p = torch.exp(s - ref)  # (BH, Bq, Bk): undropped, for the normaliser
            alpha = torch.exp(m - ref)
            l = alpha * l + p.sum(-1, keepdim=True)  # noqa: E741
            drop = tiles.dropout_scale(q0, q1, k0, k1, p)
            pv = p if drop is None else p * drop  # dropout after the softmax: only the output sees it
            acc = alpha * acc + torch.bmm(pv, v[:, k0:k1])  # (BH, Bq, Bk) @ (BH, Bk, Dv)
            m = m_new
        out[:, q0:q1] = acc / l.masked_fill(l == 0, 1.0)
        lse[:, q0:q1] = (m + torch.log(l)).squeeze(-1)
    return out, lse


def _backward(q, k, v, out, lse, d_out, tiles: _Tiles, block_q, block_k):
    """Gradients (dq, dk, dv), P rebuilt tile by tile from lse, the dropout mask regenerated from the seed."""
    bh, t_q, _ = q.shape
    t_k = k.shape[1]
    delta = (d_out * out).sum(-1, keepdim=True)  # (BH, Tq, 1): D_i = rowsum(dO o O), true with dropout too
    lse_safe = lse.masked_fill(lse == _NEG_INF, float("inf")).unsqueeze(-1)  # rows with no key: P = 0
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0 in range(0, t_q, block_q):  # queries outside here (simplest to bound by key_range); dQ owned per block
        q1 = min(q0 + block_q, t_q)
        lo, hi = tiles.key_range(q0, q1)
        for k0 in range(lo, hi, block_k):
            k1 = min(k0 + block_k, hi)
            capped, s = tiles.scores(q[:, q0:q1], k[:, k0:k1], q0, q1, k0, k1)
            p = torch.exp(s - lse_safe[:, q0:q1])  # (BH, Bq, Bk): the forward's probabilities
            drop = tiles.dropout_scale(q0, q1, k0, k1, p)
            do = d_out[:, q0:q1]
            pd = p if drop is None else p * drop
            dv[:, k0:k1] += torch.bmm(pd.transpose(1, 2), do)  # (BH, Bk, Bq) @ (BH, Bq, Dv)
            dp = torch.bmm(do, v[:, k0:k1].transpose(1, 2))  # (BH, Bq, Dv) @ (BH, Dv, Bk)
            if drop is not None:
                dp = dp * drop
            ds = p * (dp - delta[:, q0:q1])  # gradient w.r.t. the biased, capped score
            if tiles.softcap is not None:
                ds = ds * (1 - (capped / tiles.softcap) ** 2)  # d(c tanh(s/c))/ds = 1 - tanh^2
            ds = ds * tiles.scale
            dq[:, q0:q1] += torch.bmm(ds, k[:, k0:k1])
            dk[:, k0:k1] += torch.bmm(ds.transpose(1, 2), q[:, q0:q1])
    return dq, dk, dv


class _OptionsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, tiles, block_q, block_k):
        b, h = query.shape[:2]
        work = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
        q, k, v = (x.reshape(b * h, *x.shape[2:]).to(work) for x in (query, key, value))
        out, lse = _forward(q, k, v, tiles, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (tiles, block_q, block_k, query.shape, key.shape, value.shape, query.dtype)
        return out.reshape(b, h, *out.shape[1:]).to(query.dtype), lse.reshape(b, h, -1)

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        tiles, block_q, block_k, qs, ks, vs, dtype = ctx.config
        if d_lse is not None and bool((d_lse != 0).any()):
            raise NotImplementedError("flash_attention_options differentiates out, not lse")
        do = d_out.reshape(out.shape).to(out.dtype)
        dq, dk, dv = _backward(q, k, v, out, lse, do, tiles, block_q, block_k)
        return dq.reshape(qs).to(dtype), dk.reshape(ks).to(dtype), dv.reshape(vs).to(dtype), None, None, None


def flash_attention_options(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                            window: tuple[int | None, int | None] = (None, None), is_causal: bool = False,
                            softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                            dropout_p: float = 0.0, seed: int = 0, scale: float | None = None,
                            block_q: int = 64, block_k: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled attention with FlashAttention's options; returns ``(out, lse)``, out differentiable.

    Args:
        query (B, H, Tq, D), key (B, H, Tk, D), value (B, H, Tk, Dv): one KV head per query head.
        window: ``(left, right)``, FlashAttention's ``window_size`` with None for -1 (unbounded): the query at
            aligned position p sees keys p - left .. p + right. ``(W - 1, 0)`` is a causal window of W keys;
            ``(w, w)`` a two-sided local window (Longformer-style encoders).
        is_causal: sets ``right = 0`` (bottom-right aligned, as FlashAttention >= 2.1).
        softcap: None or c > 0: each scaled score s becomes c tanh(s / c) (Gemma 2: 50 on attention logits).
        alibi_slopes: None or (H,): adds ``-slope_h * |p - j|`` to the scores (FlashAttention's ``alibi_slopes``).
        dropout_p, seed: attention dropout after the softmax; the mask is :func:`dropout_keep` (regenerated in the
            backward, never stored).
        scale: defaults to 1/sqrt(D). block_q, block_k: tile sizes.

    Returns:
        out (B, H, Tq, Dv) (zeros for a row that sees no key) and lse (B, H, Tq) of the capped, biased, masked
        scores (before dropout).

    Raises:
        TypeError/ValueError naming the argument for bad tensors, shapes, window, softcap, slopes, p or blocks.
    """
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if is_causal and isinstance(window, tuple) and len(window) == 2:
        window = (window[0], 0)
    _check(query, key, value, window, softcap, alibi_slopes, dropout_p, seed, block_q, block_k)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    b, h, t_q, _ = query.shape
    tiles = _Tiles(b, h, t_q, key.shape[2], window, softcap, alibi_slopes, float(dropout_p), seed, scale, None)
    return _OptionsFunction.apply(query, key, value, tiles, block_q, block_k)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     is_causal: bool = False, window: tuple[int | None, int | None] = (None, None),
                     block_q: int = 64, block_k: int = 64) -> torch.Tensor:
    """Attention over a **packed** batch, FlashAttention's ``flash_attn_varlen_func``: sequences of different
    lengths concatenated with no padding, ``cu_seqlens`` (n + 1,) their cumulative lengths (``[0, 5, 12, ...]``).

    query (total, H, D), key and value (total, H, D/Dv): token i attends only inside its own sequence (positions
    counted from the sequence's start, so ``is_causal`` and `window` apply per sequence); tiles that fall between
    two sequences are never visited. Returns out (total, H, Dv), differentiable.

    Raises ValueError for cu_seqlens that do not start at 0, decrease, or do not end at `total`.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        _validate.tensor(name, x, min_rank=3, floating=True)
    if query.dim() != 3 or key.shape != query.shape or value.shape[:2] != query.shape[:2]:
        raise ValueError(f"need packed query, key (total, H, D) and value (total, H, Dv), got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    _validate.tensor("cu_seqlens", cu_seqlens, min_rank=1)
    cu = cu_seqlens.long().tolist()
    if cu_seqlens.dim() != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != query.shape[0] or \
            any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to total={query.shape[0]}, got {cu}")
    lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:])])
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # (total,) sequence of each token
    pos = torch.arange(query.shape[0]) - torch.tensor(cu[:-1])[seg]  # (total,) position inside its sequence
    if is_causal:
        window = (window[0], 0)
    _check(query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None], window, None, None,
           0.0, 0, block_q, block_k)
    h = query.shape[1]
    scale = query.shape[-1] ** -0.5
    tiles = _Tiles(1, h, query.shape[0], key.shape[0], window, None, None, 0.0, 0, scale, (seg, seg, pos, pos))
    q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))  # (1, H, total, D)
    out, _ = _OptionsFunction.apply(q, k, v, tiles, block_q, block_k)
    return out[0].transpose(0, 1)  # (total, H, Dv)


def dense_reference(query, key, value, *, window=(None, None), is_causal=False, softcap=None, alibi_slopes=None,
                    dropout_p=0.0, seed=0, scale=None) -> torch.Tensor:
    """The same attention with the whole (Tq, Tk) score matrix (for tests and chapter 09; autograd differentiates
    it): out (B, H, Tq, Dv)."""
    b, h, t_q, d = query.shape
    t_k = key.shape[2]
    if is_causal:
        window = (window[0], 0)
    scale = d ** -0.5 if scale is None else scale
    s = query @ key.transpose(-2, -1) * scale  # (B, H, Tq, Tk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(t_q)[:, None] + (t_k - t_q)
    j = torch.arange(t_k)[None, :]
    keep = torch.ones(t_q, t_k, dtype=torch.bool)
    if window[0] is not None:
        keep &= j >= pos - window[0]
    if window[1] is not None:
        keep &= j <= pos + window[1]
    if alibi_slopes is not None:
        s = s - alibi_slopes.to(s.dtype)[:, None, None] * (pos - j).abs().to(s.dtype)
    s = s.masked_fill(~keep, _NEG_INF)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see nothing: zeros
    if dropout_p:
        mask = dropout_keep(seed, torch.arange(b * h), torch.arange(t_q), torch.arange(t_k), dropout_p)
        p = p * mask.view(b, h, t_q, t_k).to(p.dtype) / (1 - dropout_p)
    return p @ value
