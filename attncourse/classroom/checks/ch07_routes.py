"""Chapter 07's shortcuts and breakers (answers built on forbidden functions, right outputs computed the
wrong way), kept apart from the exercises in ch07.py so that each module stays readable."""

from __future__ import annotations
import math
import re
import torch
from attncourse.kv_cache import KVCache, SinkWindowCache
from attncourse.masks import attention_sink, causal_bottom_right, materialize, materialize_at, sliding_window
from attncourse.mha import MultiHeadAttention
from attncourse.positions import sinusoidal_positions
from . import Case, exercise

_HEADS = 4  # the exercise's MultiHeadAttention(16, 4): head_dim 4


def _shortcut_cache_mask_tril(q_len, k_len, window=None):
    """Two triangles of ones: must be refused (torch.tril)."""
    ones = torch.ones(q_len, k_len, dtype=torch.bool)
    keep = ones.tril(diagonal=k_len - q_len)  # (Tq, Tk)
    return keep if window is None else keep & ~ones.tril(diagonal=k_len - q_len - window)


def _shortcut_cache_mask_aten(q_len, k_len, window=None):
    """The triangle through the ATen operator directly: must be refused (ops family aten::tril)."""
    ones = torch.ones(q_len, k_len, dtype=torch.bool)
    keep = torch.ops.aten.tril.default(ones, k_len - q_len)  # (Tq, Tk)
    return keep if window is None else keep & ~torch.ops.aten.tril.default(ones, k_len - q_len - window)


def _shortcut_cache_mask_numpy(q_len, k_len, window=None):
    """The triangle from numpy: must be refused (numpy.tril)."""
    import numpy
    ones = numpy.ones((q_len, k_len), dtype=bool)
    keep = numpy.tril(ones, k_len - q_len)  # (Tq, Tk)
    if window is not None:
        keep = keep & ~numpy.tril(ones, k_len - q_len - window)
    return torch.from_numpy(keep)


def _shortcut_cache_mask_masks(q_len, k_len, window=None):
    """The course's mask functions: must be refused."""
    q_pos = torch.arange(q_len) + (k_len - q_len)
    mod = attention_sink(0, window if window is not None else k_len)
    return materialize_at(mod, q_pos, torch.arange(k_len))


def _shortcut_update_kvcache(buf_k, buf_v, length, k_new, v_new):
    """The package's KVCache around the learner's buffers: must be refused."""
    b, h, capacity, d = buf_k.shape
    cache = KVCache(b, h, d, capacity, dtype=buf_k.dtype)
    cache.k, cache.v, cache.seen = buf_k, buf_v, length
    return cache.update(k_new, v_new)


def _shortcut_update_cat(buf_k, buf_v, length, k_new, v_new):
    """New tensors by concatenation (the values are right, the buffers untouched): must be refused."""
    return torch.cat([buf_k[:, :, :length], k_new], dim=2), torch.cat([buf_v[:, :, :length], v_new], dim=2)


def _breaker_update_new_tensors(buf_k, buf_v, length, k_new, v_new):
    """Right values in fresh tensors, the buffers untouched and no torch.cat: refused by the property."""
    out = []
    for buf, new in ((buf_k, k_new), (buf_v, v_new)):
        fresh = buf.new_empty(*buf.shape[:2], length + new.shape[2], buf.shape[3])
        fresh[:, :, :length] = buf[:, :, :length]
        fresh[:, :, length:] = new
        out.append(fresh)
    return tuple(out)


def _breaker_unbounded_cache(state, x, n_sink, window):
    """Keeps every key in an unbounded KVCache and masks with sinks + window: right output, memory O(T). Refused."""
    b, t, d = x.shape
    mha = MultiHeadAttention(d, _HEADS)
    mha.load_state_dict(state)
    cache = KVCache(b, _HEADS, d // _HEADS, capacity=t)
    pe = sinusoidal_positions(t, d)
    outs = []
    with torch.no_grad():
        for i in range(t):
            j = torch.arange(i + 1)[None, :]
            outs.append(mha(x[:, i:i + 1] + pe[i], attn_mask=(j < n_sink) | (i - j < window), kv_cache=cache))
    return torch.cat(outs, dim=1)


def _breaker_full_forward(state, x, n_sink, window):
    """The full masked forward, no decode and no cache: right output, refused by the property."""
    mha = MultiHeadAttention(16, 4)
    mha.load_state_dict(state)
    t = x.shape[1]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    with torch.no_grad():
        return mha(x + sinusoidal_positions(t, 16), attn_mask=(j <= i) & ((j < n_sink) | (i - j < window)))


def _breaker_recompute_prefix(state, x, n_sink, window):
    """Token by token, but every step recomputes the whole prefix (no cache): refused by the property."""
    mha = MultiHeadAttention(16, 4)
    mha.load_state_dict(state)
    t = x.shape[1]
    pe = sinusoidal_positions(t, 16)
    outs = []
    with torch.no_grad():
        for n in range(1, t + 1):
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            keep = (j <= i) & ((j < n_sink) | (i - j < window))
            outs.append(mha(x[:, :n] + pe[:n], attn_mask=keep)[:, -1:])
    return torch.cat(outs, dim=1)


def _breaker_rewrite_decode(state, x, n_sink, window):
    """A right decode written from scratch without reading the given code (one token per step, a bounded cache, the
    absolute position): right output, every property of the trace met, refused as no edit of the given function."""
    b, t, d = x.shape
    layer = MultiHeadAttention(d, _HEADS)
    layer.load_state_dict(state)
    sink_cache = SinkWindowCache(b, _HEADS, d // _HEADS, window=window, n_sink=n_sink)
    positions = sinusoidal_positions(t, d)
    with torch.no_grad():
        return torch.cat([layer(x[:, i:i + 1] + positions[i], kv_cache=sink_cache) for i in range(t)], dim=1)


def _shortcut_dropped_mass_fsdpa(q, k, window, slope):
    """The weights read out of PyTorch's fused attention by identity values (bias, causal mask and window written by
    hand): must be refused (torch.nn.functional.scaled_dot_product_attention; review 15)."""
    t = q.shape[0]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]  # (T, 1), (1, T)
    bias = (slope * (j - i)).to(q.dtype).masked_fill(j > i, float("-inf"))  # (T, T): ALiBi, causal
    weights = torch.nn.functional.scaled_dot_product_attention(q, k, torch.eye(t, dtype=q.dtype), attn_mask=bias)
    return float(weights.masked_fill(i - j < window, 0.0).sum(-1).mean())  # the mass the window would drop
