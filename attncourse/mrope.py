r"""Positions beyond one line of text: multimodal RoPE (M-RoPE, Qwen2-VL) and position ids under packing (chapter 06).

**M-RoPE** (Wang et al. 2024, *Qwen2-VL*, section 2.1): every token gets three position ids, (temporal, height,
width). The head's ``D/2`` rotary frequencies are split into three consecutive sections (``mrope_section``;
Qwen2-VL ships ``[16, 24, 24]`` for ``D = 128``); the frequencies of section ``a`` turn with position id ``a``.
A text token has the same id on all three axes, so on text M-RoPE is plain 1-D RoPE; an image patch at row ``r``,
column ``c`` of a grid placed at offset ``p`` gets ``(p, p + r, p + c)``, and the text after the image continues from
one past the largest id used (:func:`mrope_position_ids`, the rule of Hugging Face's ``get_rope_index``). A score
between two patches then depends on their 2-D offset ``(dr, dc)``, not on their distance in the flattened sequence.
:func:`apply_mrope` follows Hugging Face's ``apply_multimodal_rotary_pos_emb`` (halves layout, ``rotate_half``).

**Packing**: several documents in one row of a batch. :func:`packed_position_ids` restarts the position ids at
every document, as Hugging Face's ``position_ids`` and FlashAttention's ``cu_seqlens`` do; :func:`document_causal`
is the mask that keeps each query inside its own document.
"""
from __future__ import annotations

import torch

from . import _validate
from .positions import rope_inv_freq


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_mrope(x: torch.Tensor, position_ids: torch.Tensor, sections: list[int] | tuple[int, ...],
                base: float = 10000.0) -> torch.Tensor:
    """Rotate x (..., T, D) by three position ids per token, ``position_ids`` (3, T): frequency ``i`` of section
    ``a`` (``sections`` sums to D/2) turns by ``position_ids[a, t] * theta_i``. Halves layout; returns x's shape."""
    _validate.tensor("x", x, min_rank=2, floating=True)
    t, d = x.shape[-2:]
    _validate.tensor("position_ids", position_ids, min_rank=2)
    if position_ids.shape != (3, t):
        raise ValueError(f"position_ids must be (3, T) = (3, {t}) for x of shape {tuple(x.shape)}, got "
                         f"{tuple(position_ids.shape)}")
    if position_ids.is_floating_point() or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must be an integer tensor, got dtype {position_ids.dtype}")
    sections = [int(s) for s in sections]
    if len(sections) != 3 or min(sections) < 0 or sum(sections) != d // 2 or d % 2:
        raise ValueError(f"sections must be 3 non-negative sizes summing to D/2 = {d // 2}, got {sections}")
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = rope_inv_freq(d, base).to(cdt)                                              # (D/2,)
    if cdt == torch.float64:
        inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=cdt) / d))
    axis = torch.repeat_interleave(torch.arange(3), torch.tensor(sections))                # (D/2,) which id
    pos = position_ids.to(cdt)[axis]                                                       # (D/2, T)
    angle = (pos * inv_freq[:, None]).T                                                    # (T, D/2)
    angle = torch.cat((angle, angle), dim=-1)                                              # (T, D): halves
    return (x.to(cdt) * angle.cos() + _rotate_half(x.to(cdt)) * angle.sin()).to(x.dtype)


def mrope_position_ids(segments: list[tuple[str, object]]) -> torch.Tensor:
    """(3, T) ids for a sequence of ``("text", n)`` and ``("image", (h, w))`` segments (one frame, patches in
    raster order): text ids count on from the last id; an image at offset ``p`` gives patch ``(r, c)`` the ids
    ``(p, p + r, p + c)``, and the next segment starts one past the largest id used."""
    if not isinstance(segments, (list, tuple)) or not segments:
        raise ValueError(f"segments must be a non-empty list of (kind, size), got {segments!r}")
    parts, start = [], 0
    for kind, size in segments:
        if kind == "text":
            n = _validate.positive_int("text segment size", size)
            parts.append(torch.arange(start, start + n).expand(3, n))
            start += n
        elif kind == "image":
            if not (isinstance(size, (tuple, list)) and len(size) == 2):
                raise ValueError(f"an image segment's size must be (h, w), got {size!r}")
            h, w = (_validate.positive_int("image size", s) for s in size)
            rows = torch.arange(h).repeat_interleave(w)                                    # (h w,)
            cols = torch.arange(w).repeat(h)                                               # (h w,)
            parts.append(torch.stack((torch.zeros(h * w, dtype=torch.long), rows, cols)) + start)
            start += max(h, w)
        else:
            raise ValueError(f"segment kind must be 'text' or 'image', got {kind!r}")
    return torch.cat(parts, dim=1)


def packed_position_ids(lengths: list[int] | torch.Tensor) -> torch.Tensor:
    """(sum(lengths),) position ids of documents packed into one row: ``0 .. n_k - 1`` for each document k."""
    lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must be a non-empty list of positive document lengths, got {lengths}")
    return torch.cat([torch.arange(n) for n in lengths])


def document_causal(lengths: list[int] | torch.Tensor) -> torch.Tensor:
    """(T, T) bool keep-mask of packed documents: a query sees the keys of its own document up to itself."""
    pos = packed_position_ids(lengths)                                                     # validates lengths
    sizes = torch.as_tensor([int(n) for n in lengths])                                    # (documents,)
    doc = torch.repeat_interleave(torch.arange(len(sizes)), sizes)                         # (T,) document index
    i = torch.arange(len(pos))
    return (doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :])
