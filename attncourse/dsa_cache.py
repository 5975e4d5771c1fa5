"""What DeepSeek Sparse Attention keeps per sequence at decode: MLA's latent cache plus the lightning indexer's FP8
keys (chapter 14), in the layout of DeepSeek-V3.2-Exp's released ``inference/model.py``."""

from __future__ import annotations

from . import _validate

__all__ = ["dsa_cache_bytes"]


def dsa_cache_bytes(context: int, *, n_layers: int = 61, kv_rank: int = 512, rope_dim: int = 64, latent_bytes: int = 2,
                    index_dim: int = 128, index_bytes: int = 1, index_scale_bytes: int = 4, index_block: int = 128,
                    indexer: bool = True, compress: int = 1) -> dict[str, int]:
    """Bytes one sequence keeps at decode after `context` tokens, for MLA with (or without) DSA's lightning indexer,
    DeepSeek-V3.2's layout by default (its released ``inference/model.py``): per token and layer, MLA's latent and
    RoPE key, ``kv_rank + rope_dim`` values in ``latent_bytes`` (``MLA.kv_cache``, ``MLA.pe_cache``, bfloat16), and the
    indexer's key, ``index_dim`` FP8 values plus one float32 scale per ``index_block`` of them (``Indexer.k_cache``,
    ``Indexer.k_scale_cache``). ``compress=m`` keeps one entry per m tokens (a DeepSeek-V4-style compressed layer at
    these sizes; the window of raw tokens and the sink are not counted).

    Returns ``latent`` (MLA's cache), ``indexer`` (the indexer's keys, 0 without an indexer) and ``total``, summed over
    ``n_layers`` layers.

    Raises:
        TypeError, ValueError: for arguments that are not positive ints (``indexer`` must be a bool).
    """
    for name, x in (("context", context), ("n_layers", n_layers), ("kv_rank", kv_rank), ("rope_dim", rope_dim),
                    ("latent_bytes", latent_bytes), ("index_dim", index_dim), ("index_bytes", index_bytes),
                    ("index_scale_bytes", index_scale_bytes), ("index_block", index_block), ("compress", compress)):
        _validate.positive_int(name, x)
    if not isinstance(indexer, bool):
        raise TypeError(f"indexer must be a bool, got {type(indexer).__name__}")
    entries = -(-context // compress)  # entries kept per layer
    latent = n_layers * entries * (kv_rank + rope_dim) * latent_bytes
    index = n_layers * entries * (index_dim * index_bytes + -(-index_dim // index_block) * index_scale_bytes) if indexer else 0
    return {"latent": latent, "indexer": index, "total": latent + index}
