r"""KV caches for decoding: a preallocated cache, and a ring buffer for sliding-window attention
(Mistral's rolling buffer) and StreamingLLM's sink + window cache.

Protocol (what :class:`~attncourse.mha.MultiHeadAttention` calls): ``k, v = cache.update(k_new, v_new)``
with the new keys and values (B, Hkv, T_new, D); it stores them and returns every key and value the new
queries may need (B, Hkv, S, D). One cache per layer.

Every cache also knows the **absolute position** of each key it returns (:meth:`key_positions`), because a
rolling cache forgets old keys and reuses their slots: its i-th slot is not position i. Masks and position biases must be
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
    """A bounded **ring buffer**: the first `n_sink` keys forever plus the most recent `window` keys.

    ``n_sink=0`` is the rolling buffer of sliding-window attention (Mistral 7B); ``n_sink > 0`` is StreamingLLM.
    Storage is one preallocated (B, Hkv, n_sink + window, D) buffer for keys and one for values, allocated at
    the first update (dtype and device of that update's keys). Token ``p`` goes to slot ``p`` if it is a sink
    (``p < n_sink``), else to slot ``n_sink + (p - n_sink) % window``: a new token overwrites the one exactly
    `window` positions older, which no later query can see, and nothing is ever moved. The slots are therefore
    **out of temporal order** once the window has wrapped; :attr:`slot_positions` says which position each slot
    holds, and masks and position encodings are built from those positions (:meth:`attn_mask`), never from
    the slot index.

    ``update`` with one new token (a decode step) writes it into its slot and returns **views** of the filled
    slots (B, Hkv, S <= n_sink + window, D): no allocation, no copy. With several new tokens (a prefill or a
    chunk) the new queries may need keys that their own chunk will overwrite, so it returns the stored keys the
    first new query can see followed by the new ones (a fresh tensor), then writes the sinks and the last
    `window` of the new tokens into their slots.

    ``reindex=True`` numbers positions **inside the cache**, as StreamingLLM does: the keys ``update`` returns
    are ranked 0 .. S-1 by their absolute positions (sinks first, newest last), so a model with relative
    positions never sees a distance larger than the cache, however long the stream. With ``reindex=False``
    (the default) every key keeps its absolute position, and a cached decode equals one masked forward over
    the original positions.

    Raises ValueError for a non-positive `window` or a negative `n_sink`, TypeError for a non-bool `reindex`.
    """

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, window: int, n_sink: int = 0, *,
                 reindex: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__(batch_size, n_kv_heads, head_dim)
        self.window = _validate.positive_int("window", window)
        if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 0:
            raise ValueError(f"n_sink must be a non-negative int, got {n_sink!r}")
        if not isinstance(reindex, bool):
            raise TypeError(f"reindex must be a bool, got {type(reindex).__name__}")
        self.n_sink, self.reindex = n_sink, reindex
        self.capacity = n_sink + window
        self.slot_positions = torch.full((self.capacity,), -1, dtype=torch.long)  # (C,) -1 = empty slot
        self.filled = 0  # slots 0 .. filled - 1 hold keys (they fill in order until the ring wraps)
        self.positions = self.slot_positions[:0]
        if dtype is not None:
            self._allocate(dtype, device)

    def _allocate(self, dtype: torch.dtype, device: torch.device | str | None) -> None:
        b, h, d = self.shape
        self.k = torch.zeros(b, h, self.capacity, d, dtype=dtype, device=device)  # (B, Hkv, C, D), once
        self.v = torch.zeros_like(self.k)

    def slot_of(self, position: int) -> int:
        """The buffer slot that holds absolute `position`: itself for a sink, else n_sink + (p - n_sink) % window."""
        if position < self.n_sink:
            return int(position)
        return self.n_sink + (int(position) - self.n_sink) % self.window

    def live_positions(self) -> torch.Tensor:
        """(S_live,) absolute positions, in slot order, of the stored keys a future query can still see: the
        sinks and the last ``window - 1`` tokens. Once the ring is full one more slot holds the key exactly
        `window` positions back, which the next token overwrites."""
        stored = self.slot_positions[:self.filled]
        return stored[(stored < self.n_sink) | (stored > self.seen - self.window)]

    def __len__(self) -> int:
        """Live keys (at most n_sink + window - 1): see :meth:`live_positions`."""
        return len(self.live_positions())

    @property
    def max_size(self) -> int:
        """The most live keys between steps: n_sink + window - 1 (the buffer has one slot more)."""
        return self.n_sink + self.window - 1

    def _plan(self, t_new: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absolute positions (S,) of the keys the next update returns, and for a chunk the stored slots it
        returns (None for a one-token update, which returns the buffer's filled slots)."""
        _validate.positive_int("t_new", t_new)
        if t_new == 1:
            slots = self.slot_positions[:max(self.filled, self.slot_of(self.seen) + 1)].clone()
            slots[self.slot_of(self.seen)] = self.seen
            return slots, None
        stored = self.slot_positions[:self.filled]
        visible = (stored < self.n_sink) | (stored > self.seen - self.window)  # (S_stored,): seen by the first query
        idx = visible.nonzero().flatten()
        return torch.cat([stored[idx], torch.arange(self.seen, self.seen + t_new)]), idx

    @staticmethod
    def _ranks(positions: torch.Tensor) -> torch.Tensor:
        return positions.argsort().argsort()  # (S,) rank of each absolute position, 0 = oldest

    def query_positions(self, t_new: int) -> torch.Tensor:
        """(T_new,) positions of the next tokens: absolute, or their rank inside the cache with `reindex`."""
        if not self.reindex:
            return super().query_positions(t_new)
        positions = self._plan(t_new)[0]
        return self._ranks(positions)[positions >= self.seen]  # the new tokens, in order

    def key_positions(self, t_new: int) -> torch.Tensor:
        """(S,) positions of the keys :meth:`update` will return, in the order it returns them (slot order for
        a decode step): absolute, or ranks 0 .. S-1 with `reindex`."""
        positions = self._plan(t_new)[0]
        return self._ranks(positions) if self.reindex else positions

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, Hkv, T_new, D) into their slots; return the keys and values the new queries may see
        (B, Hkv, S, D): views of the buffer for T_new = 1, else the visible stored keys then the new ones."""
        self._check(k, v)
        if self.k is None:
            self._allocate(k.dtype, k.device)
        t_new = k.shape[2]
        new_pos = torch.arange(self.seen, self.seen + t_new)  # (T_new,) absolute
        if t_new > 1:
            _, idx = self._plan(t_new)
            idx = idx.to(self.k.device)
            out_k = torch.cat([self.k.index_select(2, idx), k], dim=2)  # (B, Hkv, S, D): a chunk's own copy
            out_v = torch.cat([self.v.index_select(2, idx), v], dim=2)
        # Only the sinks and the last `window` new tokens survive; their slots are distinct.
        js = ((new_pos < self.n_sink) | (new_pos > new_pos[-1] - self.window)).nonzero().flatten()  # (n,)
        pos = new_pos[js]
        slots = torch.where(pos < self.n_sink, pos, self.n_sink + (pos - self.n_sink) % self.window)  # (n,)
        dev = self.k.device
        self.k.index_copy_(2, slots.to(dev), k.index_select(2, js.to(k.device)) if t_new > 1 else k)  # in place
        self.v.index_copy_(2, slots.to(dev), v.index_select(2, js.to(v.device)) if t_new > 1 else v)
        self.slot_positions[slots] = pos
        self.filled = max(self.filled, int(slots.max()) + 1)
        self.seen += t_new
        self.positions = self.slot_positions[:self.filled]  # (S_stored,) a view, in slot order
        if t_new > 1:
            return out_k, out_v
        return self.k[:, :, :self.filled], self.v[:, :, :self.filled]  # views of the buffer, slot order

    def reset(self) -> None:
        """Forget everything (keeps the buffers)."""
        self.seen, self.filled = 0, 0
        self.slot_positions.fill_(-1)
        self.positions = self.slot_positions[:0]


def caches_for(config: Any, batch_size: int, max_len: int, **kw) -> list[_Cache]:
    """One cache per layer: a ring buffer (sink + window) when ``config.window`` is set, else a KVCache
    (`kw`: their dtype and device)."""
    if getattr(config, "window", None):
        n_kv = config.n_kv_heads or config.n_heads
        return [SinkWindowCache(batch_size, n_kv, config.d_model // config.n_heads, config.window,
                                getattr(config, "n_sink", 0), **kw) for _ in range(config.n_layers)]
    return KVCache.for_model(config, batch_size, max_len, **kw)
