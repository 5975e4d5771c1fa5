r"""Where a token is: sinusoidal position encodings (Vaswani et al.) and ALiBi biases (Press et al.).

Attention is permutation-equivariant, so order has to be added. Sinusoidal encodings add a fixed vector
per absolute position to the embeddings:

.. math:: PE_{t, 2i} = \sin(t / 10000^{2i/d}), \qquad PE_{t, 2i+1} = \cos(t / 10000^{2i/d})

ALiBi adds nothing to the embeddings; it adds a per-head linear penalty to the scores instead,
``m_h * (j - i)`` for query i and key j (negative for keys in the past), with head slopes forming a
geometric sequence. Biases here are float masks: add them to the scores (or pass them as ``attn_mask``);
combine with a causal mask yourself, e.g. through :func:`alibi_score_mod` and the masks module.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from . import _validate
from .masks import MaskMod

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sinusoidal_positions(seq_len: int, d_model: int, base: float = 10000.0) -> torch.Tensor:
    """(T, d) table: column 2i is sin(t / base^(2i/d)), column 2i+1 is cos of the same angle."""
    _validate.positive_int("seq_len", seq_len)
    _validate.positive_int("d_model", d_model)
    if d_model % 2:
        raise ValueError(f"d_model must be even (sin/cos pairs), got {d_model}")
    t = torch.arange(seq_len, dtype=torch.float64)[:, None]  # (T, 1)
    freq = base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (d/2,)
    angle = t * freq  # (T, 1) * (d/2,) -> (T, d/2)
    pe = torch.stack([angle.sin(), angle.cos()], dim=-1)  # (T, d/2, 2): sin and cos interleaved
    return pe.reshape(seq_len, d_model).float()  # (T, d)


def _power_of_two_slopes(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)  # the first slope is 2^(-8/n); each next one is multiplied by it
    return [start ** (h + 1) for h in range(n)]


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """(H,) slopes of Press et al.: 2^(-8/H), 2^(-16/H), ..., 2^(-8) when H is a power of two.

    Otherwise (their rule): take the 2^floor(log2 H) slopes of the closest smaller power of two, then
    add every other slope of the next power of two (2^(-4/p), 2^(-12/p), ... for p = 2 * closest) until
    there are H. Building only 2^floor(log2 H) slopes (as one of the notes does) leaves heads without one.
    """
    _validate.positive_int("n_heads", n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = _power_of_two_slopes(closest)
    if closest < n_heads:
        slopes += _power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias_at(slopes: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """(H, Tq, Tk) bias ``slopes[h] * (k_positions[j] - q_positions[i])`` for any absolute positions.

    Rolling caches (chapter 07) keep keys whose positions are not 0..Tk-1; this is the general form.
    """
    _validate.tensor("slopes", slopes, min_rank=1, floating=True)
    for name, p in (("q_positions", q_positions), ("k_positions", k_positions)):
        _validate.tensor(name, p, min_rank=1)
        if p.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(p.shape)}")
    if slopes.dim() != 1:
        raise ValueError(f"slopes must be 1-D (H,), got shape {tuple(slopes.shape)}")
    rel = (k_positions[None, :] - q_positions[:, None]).to(slopes.dtype)  # (Tq, Tk): j - i, <= 0 in the past
    return slopes[:, None, None] * rel  # (H, 1, 1) * (Tq, Tk) -> (H, Tq, Tk)


def alibi_bias(n_heads: int, q_len: int, k_len: int | None = None) -> torch.Tensor:
    """(H, Tq, Tk) float bias ``slope_h * (j - i)``; query i sits at absolute position i + Tk - Tq.

    Queries are the *last* Tq of the Tk positions, as when decoding with a KV cache. Not masked: entries
    with j > i are positive; add a causal mask (``masks.causal_bottom_right``) yourself.
    """
    _validate.positive_int("q_len", q_len)
    k_len = q_len if k_len is None else _validate.positive_int("k_len", k_len)
    if k_len < q_len:
        raise ValueError(f"k_len must be >= q_len (queries are the last positions), got q_len={q_len}, "
                         f"k_len={k_len}")
    q_pos = torch.arange(k_len - q_len, k_len)  # (Tq,) absolute positions of the queries
    return alibi_bias_at(alibi_slopes(n_heads), q_pos, torch.arange(k_len))  # (H, Tq, Tk)


def alibi_score_mod(n_heads: int, q_offset: int = 0) -> ScoreMod:
    """FlexAttention-style ``score_mod(score, b, h, q_idx, kv_idx)`` adding the ALiBi bias.

    Query index q_idx sits at absolute position ``q_idx + q_offset`` (the cache length when decoding).
    """
    slopes = alibi_slopes(n_heads)
    if isinstance(q_offset, bool) or not isinstance(q_offset, int) or q_offset < 0:
        raise ValueError(f"q_offset must be a non-negative int, got {q_offset!r}")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes.to(score.device, score.dtype)[h] * (kv_idx - q_idx - q_offset)

    score_mod.__name__ = f"alibi_{n_heads}_heads"
    return score_mod


def materialize_bias(score_mod: ScoreMod, n_heads: int, q_len: int, k_len: int,
                     mask_mod: MaskMod | None = None) -> torch.Tensor:
    """(H, Tq, Tk) float mask: ``score_mod`` applied to zeros, ``-inf`` where ``mask_mod`` says False.

    The result goes straight into any attention's ``attn_mask`` (it broadcasts over the batch).
    """
    if not callable(score_mod):
        raise TypeError(f"score_mod must be callable, got {type(score_mod).__name__}")
    for name, v in (("n_heads", n_heads), ("q_len", q_len), ("k_len", k_len)):
        _validate.positive_int(name, v)
    b = torch.zeros(1, 1, 1, dtype=torch.long)
    h = torch.arange(n_heads).view(-1, 1, 1)  # (H, 1, 1)
    q = torch.arange(q_len).view(1, -1, 1)  # (1, Tq, 1)
    k = torch.arange(k_len).view(1, 1, -1)  # (1, 1, Tk)
    bias = score_mod(torch.zeros(n_heads, q_len, k_len), b, h, q, k)  # (H, Tq, Tk)
    if mask_mod is not None:
        bias = bias.masked_fill(~mask_mod(b, h, q, k).expand_as(bias), float("-inf"))
    return bias


def grouped_alibi_bias(n_heads: int, n_kv_heads: int, q_len: int, k_len: int | None = None) -> torch.Tensor:
    """ALiBi for grouped scores (B, Hkv, G, Tq, Tk): the (H, Tq, Tk) bias viewed as (Hkv, G, Tq, Tk).

    Query head h = g_kv * G + r belongs to KV head g_kv (the order of ``repeat_kv``), so a plain view keeps
    each query head's own slope; the KV heads do not have slopes of their own.
    """
    _validate.positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} must be divisible by n_kv_heads={n_kv_heads}")
    bias = alibi_bias(n_heads, q_len, k_len)  # (H, Tq, Tk)
    return bias.view(n_kv_heads, n_heads // n_kv_heads, *bias.shape[1:])  # (Hkv, G, Tq, Tk)


if __name__ == "__main__":  # pragma: no cover - a demo that draws
    import matplotlib.pyplot as plt

    from .plot import heads_grid

    heads_grid(alibi_bias(8, 10), title="ALiBi bias per head (8 heads)", cbar_label="bias")
    plt.show()
