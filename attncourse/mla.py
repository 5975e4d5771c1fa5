r"""Multi-head latent attention (MLA, DeepSeek-V2): cache a small latent instead of keys and values.

Keys and values are compressed jointly into a latent ``c_kv = x W_DKV`` of ``kv_rank`` numbers per token,
and expanded per head by up-projections (``k_h = c_kv W_UK_h``, ``v_h = c_kv W_UV_h``). RoPE does not
commute with the up-projection, so position is carried by a separate, decoupled key of ``rope_dim`` numbers,
shared by all heads (``k_rope = RoPE(x W_KR)``), concatenated to each head's key. The cache holds only
``c_kv`` and ``k_rope``: ``kv_rank + rope_dim`` numbers per token and layer, whatever the number of heads.

.. math:: \text{bytes} = L \cdot (r_{kv} + d_{rope}) \cdot T \cdot B \cdot \text{bytes per element}
"""

from __future__ import annotations

from . import _validate


def mla_cache_bytes(n_layers: int, kv_rank: int, rope_dim: int, seq_len: int, batch_size: int = 1,
                    bytes_per_element: int = 2) -> int:
    """Bytes of an MLA cache: the latent (kv_rank) and the RoPE key (rope_dim) per token and layer."""
    for name, v in (("n_layers", n_layers), ("kv_rank", kv_rank), ("rope_dim", rope_dim), ("seq_len", seq_len),
                    ("batch_size", batch_size), ("bytes_per_element", bytes_per_element)):
        _validate.positive_int(name, v)
    return n_layers * (kv_rank + rope_dim) * seq_len * batch_size * bytes_per_element
