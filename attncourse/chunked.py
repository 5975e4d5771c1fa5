r"""Chunked prefill: a long prompt processed a chunk of queries at a time against a growing KV cache.

In chunks of C tokens, chunk c attends to the cached keys of every earlier chunk plus its own (a bottom-right
aligned causal mask): the same output and the same cache as one-shot prefill. Done with plain attention the
largest score matrix shrinks from (B, H, T, T) to (B, H, C, T), but FlashAttention never builds the T x T
matrix anyway: serving engines (SARATHI; vLLM, SGLang) chunk prompts to *schedule* them, interleaving a long
prefill with other requests' decodes under a per-step token budget (see :mod:`attncourse.scheduler`).

:func:`peak_tensor_bytes` measures what a call allocates, exactly and without noise: it follows every
tensor storage created while the call runs and reports the largest total alive at any moment.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import _validate
from .mha import MultiHeadAttention
from .sdpa import _check_qkv, scaled_dot_product_attention

__all__ = ["chunked_prefill", "chunked_causal_attention", "peak_tensor_bytes"]


def chunked_prefill(layer: MultiHeadAttention, x: torch.Tensor, chunk_size: int, kv_cache: Any) -> torch.Tensor:
    """Causal self-attention of `layer` over x (B, T, d_model), `chunk_size` tokens at a time.

    `kv_cache` follows chapter 07's protocol (a :class:`~attncourse.KVCache`, a paged sequence, ...);
    it holds the prompt's keys and values afterwards, ready for decoding. Returns (B, T, d_model),
    equal to ``layer(x, is_causal=True)``.
    """
    if not isinstance(layer, MultiHeadAttention):
        raise TypeError(f"layer must be a MultiHeadAttention, got {type(layer).__name__}")
    _validate.tensor("x", x, min_rank=3, floating=True)
    _validate.positive_int("chunk_size", chunk_size)
    if not hasattr(kv_cache, "update"):
        raise TypeError(f"kv_cache must have an update(k, v) method, got {type(kv_cache).__name__}")
    outs = [layer(chunk, is_causal=True, kv_cache=kv_cache)  # (B, C, d): bottom-right causal over the cache
            for chunk in x.split(chunk_size, dim=1)]  # (B, T, d) -> chunks (B, C, d)
    return torch.cat(outs, dim=1)  # (B, T, d)


def chunked_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk_size: int, *,
                             scale: float | None = None) -> torch.Tensor:
    """Causal attention (top-left aligned, Tq == Tk) computed `chunk_size` query rows at a time; each chunk
    sees only the keys up to its last row. query, key (..., T, D), value (..., T, Dv) -> (..., T, Dv)."""
    _check_qkv(query, key, value)
    _validate.positive_int("chunk_size", chunk_size)
    t = query.shape[-2]
    if key.shape[-2] != t:
        raise ValueError(f"query and key must have the same length, got query {tuple(query.shape)} "
                         f"and key {tuple(key.shape)}")
    outs = []
    for start in range(0, t, chunk_size):
        stop = min(start + chunk_size, t)
        keep = torch.ones(stop - start, stop, dtype=torch.bool, device=query.device).tril(diagonal=start)  # (C, stop)
        outs.append(scaled_dot_product_attention(query[..., start:stop, :], key[..., :stop, :],
                                                 value[..., :stop, :], keep, scale=scale))  # (..., C, Dv)
    return torch.cat(outs, dim=-2)  # (..., T, Dv)


class _StorageTracker(TorchDispatchMode):
    """Adds up the bytes of every storage the ops create and drops them when the storage is freed."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.seen = 0, 0, set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.seen and key not in inputs:  # new memory, not a view or an in-place result
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._freed, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def peak_tensor_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """Run ``fn(*args, **kwargs)`` and return ``(result, peak)``: the most bytes of tensors created during
    the call that were alive at the same time (inputs not counted; the result counted while alive).
    Views share their base's storage and are counted once. Exact and machine-independent."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    tracker = _StorageTracker()
    with tracker, torch.no_grad():
        result = fn(*args, **kwargs)
    return result, tracker.peak
