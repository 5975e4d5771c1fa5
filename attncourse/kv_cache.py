r"""KV caches for decoding: a preallocated cache, a rolling sliding-window cache, and StreamingLLM's
sink + window cache.

Protocol (what :class:`~attncourse.mha.MultiHeadAttention` calls): ``k, v = cache.update(k_new, v_new)``
with the new keys and values (B, Hkv, T_new, D); it stores them and returns every key and value the new
queries may need (B, Hkv, S, D). One cache per layer.

Every cache also knows the **absolute position** of each key it returns (:meth:`key_positions`), because a
rolling cache forgets old keys: its i-th slot is not position i. Masks and position biases must be
built from those positions (:meth:`attn_mask`), *before* calling the layer, so that cached decoding
equals full attention under the same mask. Memory: :attr:`nbytes` of the stored tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _validate
from .masks import MaskMod, causal, materialize_at


class _Cache:
    """What all caches share: the number of tokens seen and the positions of the stored keys."""

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int):
        self.shape = (_validate.positive_int("batch_size", batch_size),
                      _validate.positive_int("n_kv_heads", n_kv_heads),
                      _validate.positive_int("head_dim", head_dim))
        self.seen = 0  # tokens appended so far = absolute position of the next token
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.positions = torch.zeros(0, dtype=torch.long)  # (S_stored,) absolute positions of stored keys

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored keys and values (the preallocated buffer for :class:`KVCache`)."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)

    def query_positions(self, t_new: int) -> torch.Tensor:
        """(T_new,) absolute positions of the next `t_new` tokens."""
        _validate.positive_int("t_new", t_new)
        return torch.arange(self.seen, self.seen + t_new)

    def key_positions(self, t_new: int) -> torch.Tensor:
        """(S,) absolute positions of the keys :meth:`update` will return for `t_new` new tokens."""
        return torch.cat([self.positions, self.query_positions(t_new)])

    def attn_mask(self, t_new: int, mask_mod: MaskMod = causal) -> torch.Tensor:
        """Bool (T_new, S) mask for the next update, from absolute positions (call it before update)."""
        return materialize_at(mask_mod, self.query_positions(t_new), self.key_positions(t_new))

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        _validate.tensor("k", k, min_rank=4, floating=True)
        _validate.tensor("v", v, min_rank=4, floating=True)
        b, h, d = self.shape
        if k.dim() != 4 or k.shape != v.shape or (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d):
            raise ValueError(f"k and v must both be (B={b}, Hkv={h}, T_new, D={d}), got k {tuple(k.shape)} "
                             f"and v {tuple(v.shape)}")
        if self.k is not None and k.dtype != self.k.dtype:
            raise TypeError(f"k has dtype {k.dtype} but the cache holds {self.k.dtype}")

    def reset(self) -> None:
        """Forget everything (keeps a preallocated buffer)."""
        self.seen = 0
        self.positions = self.positions[:0]


class KVCache(_Cache):
    """Keys and values of one layer, preallocated to `capacity` positions: (B, Hkv, capacity, D) each.

    ``update`` writes the new entries after the old ones and returns views of everything so far; going
    past `capacity` raises ValueError (no silent reallocation).
    """

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, capacity: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__(batch_size, n_kv_heads, head_dim)
        self.capacity = _validate.positive_int("capacity", capacity)
        self.k = torch.zeros(batch_size, n_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)  # (B, Hkv, capacity, D)

    @classmethod
    def for_model(cls, config: Any, batch_size: int, max_len: int, **kw) -> list["KVCache"]:
        """One cache per layer for a model config with n_layers, n_heads, n_kv_heads (None = MHA), d_model."""
        n_kv = config.n_kv_heads or config.n_heads
        return [cls(batch_size, n_kv, config.d_model // config.n_heads, max_len, **kw)
                for _ in range(config.n_layers)]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, Hkv, T_new, D); return all cached keys and values (B, Hkv, S_total, D)."""
        self._check(k, v)
        start, end = self.seen, self.seen + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache is full: it holds {start} of {self.capacity} positions and cannot "
                             f"append {k.shape[2]} more (k {tuple(k.shape)}); make a larger cache")
        self.k[:, :, start:end] = k  # (B, Hkv, T_new, D) into the buffer, no reallocation
        self.v[:, :, start:end] = v
        self.positions = torch.arange(end)
        self.seen = end
        return self.k[:, :, :end], self.v[:, :, :end]  # (B, Hkv, S_total, D) views


class SinkWindowCache(_Cache):
    """A bounded cache that keeps the first `n_sink` keys forever plus the most recent `window` keys.

    ``n_sink=0`` is the rolling cache of sliding-window attention (Mistral); ``n_sink > 0`` is StreamingLLM.
    ``update`` returns the stored keys followed by the new ones (so a long prefill still sees its own
    recent tokens), then evicts: at most ``n_sink + window - 1`` keys stay stored, whatever the length.
    Pair it with the mask ``masks.attention_sink(n_sink, window)`` built by :meth:`attn_mask`.

    ``reindex=True`` numbers positions **inside the cache**, as StreamingLLM does: the stored keys are
    positions 0 .. S-1 and the new tokens follow them, so a model with relative positions (ALiBi) never
    sees a distance larger than the cache, however long the stream. Eviction still follows the tokens'
    absolute positions (:attr:`positions`). With ``reindex=False`` (the default) every key keeps its
    absolute position, and a cached decode equals one masked forward over the original positions.
    """

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, window: int, n_sink: int = 0, *,
                 reindex: bool = False):
        super().__init__(batch_size, n_kv_heads, head_dim)
        self.window = _validate.positive_int("window", window)
        if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 0:
            raise ValueError(f"n_sink must be a non-negative int, got {n_sink!r}")
        if not isinstance(reindex, bool):
            raise TypeError(f"reindex must be a bool, got {type(reindex).__name__}")
        self.n_sink, self.reindex = n_sink, reindex

    def query_positions(self, t_new: int) -> torch.Tensor:
        """(T_new,) positions of the next tokens: absolute, or right after the stored keys with `reindex`."""
        if not self.reindex:
            return super().query_positions(t_new)
        _validate.positive_int("t_new", t_new)
        return torch.arange(len(self), len(self) + t_new)

    def key_positions(self, t_new: int) -> torch.Tensor:
        """(S,) positions of the keys :meth:`update` will return: absolute, or 0 .. S-1 with `reindex`."""
        if not self.reindex:
            return super().key_positions(t_new)
        return torch.arange(len(self) + _validate.positive_int("t_new", t_new))

    @property
    def max_size(self) -> int:
        return self.n_sink + self.window - 1  # the next query brings the window's last key itself

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return stored + new keys and values (B, Hkv, S, D); keep only sinks and the last window."""
        self._check(k, v)
        positions = torch.cat([self.positions, torch.arange(self.seen, self.seen + k.shape[2])])  # (S,) absolute
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)  # (B, Hkv, S, D)
        newest = positions[-1]
        # The next query (at newest + 1) sees keys newest - window + 2 .. newest + 1, plus the sinks.
        keep = (positions < self.n_sink) | (positions > newest + 1 - self.window)  # (S,)
        self.k, self.v = k[:, :, keep], v[:, :, keep]  # (B, Hkv, <= n_sink + window - 1, D): copies
        self.positions, self.seen = positions[keep], int(newest) + 1
        return k, v

    def reset(self) -> None:
        super().reset()
        self.k = self.v = None


def caches_for(config: Any, batch_size: int, max_len: int, **kw) -> list[_Cache]:
    """One cache per layer: rolling (sink + window) when ``config.window`` is set, else a KVCache
    (`kw`: its dtype and device)."""
    if getattr(config, "window", None):
        n_kv = config.n_kv_heads or config.n_heads
        return [SinkWindowCache(batch_size, n_kv, config.d_model // config.n_heads, config.window,
                                getattr(config, "n_sink", 0)) for _ in range(config.n_layers)]
    return KVCache.for_model(config, batch_size, max_len, **kw)
