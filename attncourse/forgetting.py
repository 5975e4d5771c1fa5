r"""The Forgetting Transformer (FoX; Lin, Nikishin, He and Courville 2025, arXiv:2503.02130, ICLR 2025): softmax
attention with a data-dependent forget gate, the softmax-side relative of Gated DeltaNet's decay.

Each token t has a forget gate :math:`f_t = \sigma(w_f^\top x_t + b_f) \in (0, 1)` per head. The weight of key s
for query t is multiplied by :math:`\prod_{l=s+1}^{t} f_l` before the softmax normalises, which in log space is a
bias added to the scores:

.. math::
    o_t = \sum_{s \le t} \mathrm{softmax}_s\Bigl(\tfrac{q_t \cdot k_s}{\sqrt d} + D_{ts}\Bigr) v_s, \qquad
    D_{ts} = \sum_{l=s+1}^{t} \log f_l = c_t - c_s, \quad c_t = \sum_{l \le t} \log f_l.

:math:`\exp(D)` is the 1-semiseparable decay mask of Mamba-2 and GLA (``linear_attention.decay_mask``): FoX keeps the
softmax and its KV cache, and borrows the decay. Because :math:`D_{ts} = c_t - c_s`, a FlashAttention tile needs
only the two slices of :math:`c` to rebuild its block of the bias, which is how the paper's kernel runs it.
"""

from __future__ import annotations

import math

import torch

from . import _validate


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _validate.tensor(name, x, min_rank=4, floating=True)
        if x.dim() != 4:
            raise ValueError(f"{name} must be (B, H, T, D), got shape {tuple(x.shape)}")
    if q.shape != k.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k must be (B, H, T, Dk) and v (B, H, T, Dv) alike, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    _validate.tensor("log_f", log_f, min_rank=3, floating=True)
    if tuple(log_f.shape) != tuple(q.shape[:3]):
        raise ValueError(f"log_f must be (B, H, T) = {tuple(q.shape[:3])}, got {tuple(log_f.shape)}")


def forget_bias(log_f: torch.Tensor) -> torch.Tensor:
    """D[..., t, s] = c_t - c_s for s <= t (c the cumulative sum of log_f), -inf above the diagonal.

    Args:
        log_f: (B, H, T) log forget gates (<= 0), in any float dtype (summed in float32 at least).
    Returns:
        (B, H, T, T) float32 (or float64) bias.
    Raises:
        TypeError, ValueError: for a non-tensor or a rank below 1.
    """
    _validate.tensor("log_f", log_f, min_rank=1, floating=True)
    c = log_f.to(torch.promote_types(log_f.dtype, torch.float32)).cumsum(-1)  # (..., T)
    T = log_f.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=log_f.device).tril()
    return (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf"))


def forgetting_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention with FoX's forget-gate bias; scores and softmax in float32 (or float64).

    Args:
        q, k: (B, H, T, Dk); v: (B, H, T, Dv); log_f: (B, H, T) log forget gates, ``logsigmoid`` of the gate logits.
        scale: multiplies the scores (default Dk ** -0.5).
    Returns:
        (B, H, T, Dv) in v's dtype. With log_f = 0 it is ordinary causal softmax attention.
    Raises:
        TypeError, ValueError: for non-tensors or shapes that do not match.
    """
    _check(q, k, v, log_f)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * s + forget_bias(log_f).to(acc)  # (B, H, T, T)
    weights = torch.softmax(scores, dim=-1)
    return (weights @ v.to(acc)).to(v.dtype)
