"""Attention masks as small composable functions, in the style of FlexAttention's ``mask_mod``.

A mask function takes index tensors ``(b, h, q_idx, kv_idx)`` and returns a boolean tensor, True where
query ``q_idx`` may attend to key ``kv_idx``. Factories (``sliding_window(4)``) return such functions;
``and_masks`` / ``or_masks`` combine them; ``materialize`` turns one into a dense boolean tensor that
any attention here (or ``F.scaled_dot_product_attention``) accepts. Run ``python -m attncourse.masks``
to see them drawn.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import _validate

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """Top-left aligned causal mask: query i sees keys 0..i (PyTorch's ``is_causal``)."""
    return q_idx >= kv_idx


def causal_bottom_right(q_len: int, k_len: int) -> MaskMod:
    """Causal mask aligned bottom-right: the Tq queries are the *last* Tq of the Tk positions.

    This is what decoding with a KV cache needs: query i sits at absolute position i + k_len - q_len.
    """
    _validate.positive_int("q_len", q_len)
    _validate.positive_int("k_len", k_len)
    offset = k_len - q_len

    def mask(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    mask.__name__ = f"causal_bottom_right_{q_len}x{k_len}"
    return mask


def sliding_window(window: int) -> MaskMod:
    """Causal sliding window: query i sees keys i - window + 1 .. i (itself and window - 1 before)."""
    _validate.positive_int("window", window)

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    mask.__name__ = f"sliding_window_{window}"
    return mask


def padding(lengths: torch.Tensor | list[int]) -> MaskMod:
    """Key-padding mask from per-sequence lengths: key j of batch b is valid when j < lengths[b]."""
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.is_floating_point():
        raise ValueError(f"lengths must be a 1-D integer tensor, got shape {tuple(lengths.shape)} "
                         f"and dtype {lengths.dtype}")

    def mask(b, h, q_idx, kv_idx):
        return kv_idx < lengths.to(kv_idx.device)[b]

    mask.__name__ = "padding"
    return mask


def and_masks(*mods: MaskMod) -> MaskMod:
    """Allowed where every mask allows."""
    if not mods:
        raise ValueError("and_masks needs at least one mask function")

    def mask(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            out = out & mod(b, h, q_idx, kv_idx)
        return out

    mask.__name__ = "and(" + ", ".join(getattr(m, "__name__", "mask") for m in mods) + ")"
    return mask


def or_masks(*mods: MaskMod) -> MaskMod:
    """Allowed where any mask allows."""
    if not mods:
        raise ValueError("or_masks needs at least one mask function")

    def mask(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            out = out | mod(b, h, q_idx, kv_idx)
        return out

    mask.__name__ = "or(" + ", ".join(getattr(m, "__name__", "mask") for m in mods) + ")"
    return mask


def materialize(mask_mod: MaskMod, q_len: int, k_len: int, *, batch: int | None = None,
                heads: int | None = None, device: torch.device | None = None) -> torch.Tensor:
    """Evaluate `mask_mod` on every (query, key) pair.

    Returns a bool tensor of shape (Tq, Tk), or (B, H, Tq, Tk) when `batch` or `heads` is given
    (a missing one is 1, so it broadcasts).
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    _validate.positive_int("q_len", q_len)
    _validate.positive_int("k_len", k_len)
    full = batch is not None or heads is not None
    n_b = _validate.positive_int("batch", batch) if batch is not None else 1
    n_h = _validate.positive_int("heads", heads) if heads is not None else 1
    b = torch.arange(n_b, device=device).view(-1, 1, 1, 1)
    h = torch.arange(n_h, device=device).view(1, -1, 1, 1)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    k = torch.arange(k_len, device=device).view(1, 1, 1, -1)
    out = mask_mod(b, h, q, k).expand(n_b, n_h, q_len, k_len)  # (B, H, Tq, Tk)
    return out.contiguous() if full else out[0, 0].contiguous()


def to_additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Boolean keep-mask to a float mask to add to scores: 0 where allowed, ``-inf`` elsewhere."""
    _validate.tensor("mask", mask, min_rank=1)
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))



def attention_sink(n_sink: int, window: int) -> MaskMod:
    """StreamingLLM's pattern: causal, and either one of the first `n_sink` keys or inside the window.

    Query i sees keys 0 .. n_sink - 1 (the "sinks") and i - window + 1 .. i. ``n_sink=0`` is
    :func:`sliding_window`.
    """
    if isinstance(n_sink, bool) or not isinstance(n_sink, int):
        raise TypeError(f"n_sink must be an int, got {type(n_sink).__name__}")
    if n_sink < 0:
        raise ValueError(f"n_sink must be >= 0, got {n_sink}")
    _validate.positive_int("window", window)

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((kv_idx < n_sink) | (q_idx - kv_idx < window))

    mask.__name__ = f"attention_sink_{n_sink}_window_{window}"
    return mask


def materialize_at(mask_mod: MaskMod, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """Evaluate `mask_mod` at absolute positions: bool (Tq, Tk), entry [i, j] for the pair
    (q_positions[i], k_positions[j]). Rolling KV caches hold keys at positions that are not 0..Tk-1.
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    for name, p in (("q_positions", q_positions), ("k_positions", k_positions)):
        _validate.tensor(name, p, min_rank=1)
        if p.dim() != 1 or p.is_floating_point():
            raise ValueError(f"{name} must be a 1-D integer tensor, got shape {tuple(p.shape)}, dtype {p.dtype}")
    zero = torch.zeros((), dtype=torch.long, device=q_positions.device)
    out = mask_mod(zero, zero, q_positions[:, None], k_positions[None, :])  # (Tq, Tk)
    return out.expand(len(q_positions), len(k_positions)).contiguous()

if __name__ == "__main__":  # pragma: no cover - a demo that draws
    from .plot import masks_side_by_side
    import matplotlib.pyplot as plt

    T = 12
    masks_side_by_side(
        {
            "causal": materialize(causal, T, T),
            "sliding_window(4)": materialize(sliding_window(4), T, T),
            "causal, padded to 8": materialize(and_masks(causal, padding([8])), T, T, batch=1)[0, 0],
        }
    )
    plt.show()


def _check_parents(parents) -> list[int]:
    if isinstance(parents, torch.Tensor):
        parents = parents.tolist()
    if not isinstance(parents, (list, tuple)) or not parents:
        raise TypeError(f"parents must be a non-empty list of ints, got {type(parents).__name__}")
    out = []
    for i, p in enumerate(parents):
        if isinstance(p, bool) or not isinstance(p, int) or not -1 <= p < i:
            raise ValueError(f"parents[{i}] must be an int with -1 <= parent < {i} (nodes listed after their "
                             f"parent, -1 for a root), got {p!r} in parents of length {len(parents)}")
        out.append(p)
    return out


def tree_depths(parents) -> torch.Tensor:
    """(n,) long: the depth of each node of a token tree (0 for a root), given ``parents[i]`` (-1 for a root,
    else the index of an earlier node). A node's position in the sequence is the cache length plus its depth.

    Raises TypeError for a non-list, ValueError for a parent that is not an earlier node."""
    parents = _check_parents(parents)
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return torch.tensor(depth, dtype=torch.long)


def tree_mask(parents) -> torch.Tensor:
    """Bool (n, n) mask of **tree attention** (speculative decoding's verification of a tree of draft tokens):
    node i may attend to node j iff j is i or one of its ancestors, so each branch sees exactly the tokens of
    its own path, as if it had been decoded alone. ``parents[i]`` is -1 for a root, else an earlier node.
    A chain ``[-1, 0, 1, ...]`` gives the causal mask. Queries are rows, keys columns.

    Raises TypeError for a non-list, ValueError for a parent that is not an earlier node."""
    parents = _check_parents(parents)
    n = len(parents)
    keep = torch.eye(n, dtype=torch.bool)  # (n, n): every node sees itself
    for i, p in enumerate(parents):
        if p >= 0:
            keep[i] |= keep[p]  # and everything its parent sees: the ancestors
    return keep
