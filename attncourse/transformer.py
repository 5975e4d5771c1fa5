r"""The Transformer block: attention and a position-wise feed-forward network, each wrapped in a residual
connection and a LayerNorm, in the post-norm order of Vaswani et al. or the pre-norm order of GPT-2.

.. math::
   \text{post-norm:}\quad h = \mathrm{LN}(x + \mathrm{MHA}(x)), \quad y = \mathrm{LN}(h + \mathrm{FFN}(h)) \\
   \text{pre-norm:}\quad  h = x + \mathrm{MHA}(\mathrm{LN}(x)), \quad y = h + \mathrm{FFN}(\mathrm{LN}(h))

With dropout off and the same weights, :class:`TransformerBlock` equals ``nn.TransformerEncoderLayer``
(``batch_first=True``); :func:`to_torch_encoder_layer` builds that twin.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate
from .mha import MultiHeadAttention

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class FeedForward(nn.Module):
    """Position-wise FFN: ``linear2(act(linear1(x)))``, applied to every position independently.

    x (..., d_model) -> (..., d_model) through a hidden width d_ff (4 d_model in Vaswani et al.).
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", *, bias: bool = True):
        super().__init__()
        _validate.positive_int("d_model", d_model)
        _validate.positive_int("d_ff", d_ff)
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(_ACTIVATIONS[self.activation](self.linear1(x)))  # (..., d) -> (..., d_ff) -> (..., d)


class TransformerBlock(nn.Module):
    """One encoder block: self-attention then FFN, each with a residual connection and a LayerNorm.

    Args:
        d_model, n_heads, n_kv_heads: as :class:`~attncourse.mha.MultiHeadAttention` (biases on, as
            in ``nn.TransformerEncoderLayer``).
        d_ff: FFN hidden width (default 4 d_model).
        norm_first: pre-norm (True) or post-norm (False, the original Transformer).
        activation: "relu" or "gelu".
        eps: LayerNorm epsilon.
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int | None = None, *, n_kv_heads: int | None = None,
                 norm_first: bool = False, activation: str = "relu", eps: float = 1e-5):
        super().__init__()
        self.attn = MultiHeadAttention(d_model, n_heads, n_kv_heads, bias=True)
        self.ff = FeedForward(d_model, 4 * d_model if d_ff is None else d_ff, activation)
        self.norm1 = nn.LayerNorm(d_model, eps=eps)
        self.norm2 = nn.LayerNorm(d_model, eps=eps)
        self.norm_first = bool(norm_first)

    def forward(self, x: torch.Tensor, *, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                kv_cache: Any = None, return_weights: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d_model) -> (B, T, d_model); weights (B, H, T, S) too if `return_weights`."""
        kw = dict(attn_mask=attn_mask, is_causal=is_causal, kv_cache=kv_cache, return_weights=True)
        if self.norm_first:
            a, w = self.attn(self.norm1(x), **kw)  # (B, T, d), (B, H, T, S)
            x = x + a
            x = x + self.ff(self.norm2(x))
        else:
            a, w = self.attn(x, **kw)
            x = self.norm1(x + a)
            x = self.norm2(x + self.ff(x))
        return (x, w) if return_weights else x


def to_torch_encoder_layer(block: TransformerBlock) -> nn.TransformerEncoderLayer:
    """An ``nn.TransformerEncoderLayer`` (batch_first, dropout 0) holding a copy of `block`'s weights.

    Only MHA blocks (n_kv_heads = n_heads) have a PyTorch twin; GQA/MQA raise ValueError.
    """
    if not isinstance(block, TransformerBlock):
        raise TypeError(f"block must be a TransformerBlock, got {type(block).__name__}")
    attn = block.attn
    if attn.n_kv_heads != attn.n_heads:
        raise ValueError(f"only MHA blocks have an nn.TransformerEncoderLayer twin, got n_heads="
                         f"{attn.n_heads}, n_kv_heads={attn.n_kv_heads}")
    ref = nn.TransformerEncoderLayer(
        attn.d_model, attn.n_heads, dim_feedforward=block.ff.linear1.out_features, dropout=0.0,
        activation=block.ff.activation, layer_norm_eps=block.norm1.eps, batch_first=True,
        norm_first=block.norm_first,
    ).to(dtype=attn.q_proj.weight.dtype, device=attn.q_proj.weight.device)
    with torch.no_grad():
        ref.self_attn.in_proj_weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        ref.self_attn.in_proj_bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        ref.self_attn.out_proj.load_state_dict(attn.o_proj.state_dict())
        ref.linear1.load_state_dict(block.ff.linear1.state_dict())
        ref.linear2.load_state_dict(block.ff.linear2.state_dict())
        ref.norm1.load_state_dict(block.norm1.state_dict())
        ref.norm2.load_state_dict(block.norm2.state_dict())
    return ref.eval()


class TransformerClassifier(nn.Module):
    """Token embedding (+ learned positions) -> n_layers blocks -> mean pool over time -> linear head.

    tokens (B, T) integer ids -> logits (B, n_classes). Used by chapter 04's classification exercise.
    """

    def __init__(self, vocab_size: int, n_classes: int, d_model: int = 64, n_heads: int = 4,
                 n_layers: int = 2, max_len: int = 512, *, norm_first: bool = True):
        super().__init__()
        for name, v in (("vocab_size", vocab_size), ("n_classes", n_classes), ("n_layers", n_layers),
                        ("max_len", max_len)):
            _validate.positive_int(name, v)
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)  # learned positions (chapter 06 has others)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, norm_first=norm_first)
                                    for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _validate.tensor("tokens", tokens, min_rank=2)
        if tokens.dim() != 2 or tokens.is_floating_point() or tokens.shape[1] > self.pos.num_embeddings:
            raise ValueError(f"tokens must be integer ids (B, T) with T <= {self.pos.num_embeddings}, "
                             f"got shape {tuple(tokens.shape)} and dtype {tokens.dtype}")
        x = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]  # (B, T, d) + (T, d) -> (B, T, d)
        for block in self.blocks:
            x = block(x)  # (B, T, d)
        return self.head(self.norm(x).mean(dim=1))  # (B, T, d) -> (B, d) -> (B, n_classes)
