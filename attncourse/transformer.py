r"""The Transformer block: attention and a position-wise feed-forward network, each wrapped in a residual
connection and a LayerNorm, in the post-norm order of Vaswani et al. or the pre-norm order of GPT-2.

.. math::
   \text{post-norm:}\quad h = \mathrm{LN}(x + \mathrm{MHA}(x)), \quad y = \mathrm{LN}(h + \mathrm{FFN}(h)) \\
   \text{pre-norm:}\quad  h = x + \mathrm{MHA}(\mathrm{LN}(x)), \quad y = h + \mathrm{FFN}(\mathrm{LN}(h))

With dropout off and the same weights, :class:`TransformerBlock` equals ``nn.TransformerEncoderLayer``
(``batch_first=True``), :class:`DecoderBlock` equals ``nn.TransformerDecoderLayer`` and
:class:`EncoderDecoder` equals ``nn.Transformer`` between the embeddings and the output head;
:func:`to_torch_encoder_layer`, :func:`to_torch_decoder_layer` and :func:`to_torch_transformer` build the twins.
"""

from __future__ import annotations

import warnings
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
        d_model, n_heads, n_kv_heads: as :class:`~attncourse.mha.MultiHeadAttention`.
        bias: biases in the projections, the FFN and the LayerNorms (True, as ``nn.TransformerEncoderLayer``;
            False as in LLaMA-style blocks).
        d_ff: FFN hidden width (default 4 d_model).
        norm_first: pre-norm (True) or post-norm (False, the original Transformer).
        activation: "relu" or "gelu".
        eps: LayerNorm epsilon.
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int | None = None, *, n_kv_heads: int | None = None,
                 norm_first: bool = False, activation: str = "relu", eps: float = 1e-5, bias: bool = True):
        super().__init__()
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool, got {type(bias).__name__}")
        self.attn = MultiHeadAttention(d_model, n_heads, n_kv_heads, bias=bias)
        self.ff = FeedForward(d_model, 4 * d_model if d_ff is None else d_ff, activation, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=eps, bias=bias)
        self.norm2 = nn.LayerNorm(d_model, eps=eps, bias=bias)
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
        norm_first=block.norm_first, bias=block.norm1.bias is not None,
    ).to(dtype=attn.q_proj.weight.dtype, device=attn.q_proj.weight.device)
    with torch.no_grad():
        ref.self_attn.in_proj_weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        if attn.q_proj.bias is not None:
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


class DecoderBlock(nn.Module):
    """One decoder block: causal self-attention, cross-attention over the encoder's output (the "memory"),
    then an FFN; each sublayer with a residual connection and a LayerNorm (post- or pre-norm).

    Same arguments as :class:`TransformerBlock`; the submodules are named after ``nn.TransformerDecoderLayer``'s.
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int | None = None, *, norm_first: bool = False,
                 activation: str = "relu", eps: float = 1e-5):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, bias=True)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, bias=True)
        self.ff = FeedForward(d_model, 4 * d_model if d_ff is None else d_ff, activation)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(d_model, eps=eps) for _ in range(3))
        self.norm_first = bool(norm_first)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, *, memory_mask: torch.Tensor | None = None,
                is_causal: bool = True, return_weights: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d) decoder states, memory (B, S, d) -> (B, T, d); cross-attention weights (B, H, T, S) too
        if `return_weights`. memory_mask: bool keep-mask broadcastable to (B, H, T, S), e.g. (B, 1, 1, S)."""
        if self.norm_first:
            x = x + self.self_attn(self.norm1(x), is_causal=is_causal)
            c, w = self.cross_attn(self.norm2(x), memory, attn_mask=memory_mask, return_weights=True)
            x = x + c
            x = x + self.ff(self.norm3(x))
        else:
            x = self.norm1(x + self.self_attn(x, is_causal=is_causal))
            c, w = self.cross_attn(x, memory, attn_mask=memory_mask, return_weights=True)  # (B, T, d), (B, H, T, S)
            x = self.norm2(x + c)
            x = self.norm3(x + self.ff(x))
        return (x, w) if return_weights else x


class EncoderDecoder(nn.Module):
    """The encoder-decoder Transformer of Vaswani et al. with learned positions, for token-to-token tasks.

    src (B, S) and tgt_in (B, T) integer ids -> logits (B, T, tgt_vocab). Token ``pad_id`` in `src` is
    padding: no query attends to it (a key-padding keep-mask (B, 1, 1, S)). As in ``nn.Transformer``, the
    encoder and the decoder stacks each end with a LayerNorm.
    """

    def __init__(self, src_vocab: int, tgt_vocab: int, d_model: int = 64, n_heads: int = 4, n_layers: int = 2,
                 d_ff: int | None = None, max_len: int = 64, *, norm_first: bool = False, pad_id: int = 0):
        super().__init__()
        for name, v in (("src_vocab", src_vocab), ("tgt_vocab", tgt_vocab), ("n_layers", n_layers),
                        ("max_len", max_len)):
            _validate.positive_int(name, v)
        self.pad_id, self.max_len = pad_id, max_len
        self.src_embed, self.tgt_embed = nn.Embedding(src_vocab, d_model), nn.Embedding(tgt_vocab, d_model)
        self.src_pos, self.tgt_pos = nn.Embedding(max_len, d_model), nn.Embedding(max_len, d_model)
        kw = dict(d_ff=d_ff, norm_first=norm_first)
        self.encoder = nn.ModuleList(TransformerBlock(d_model, n_heads, **kw) for _ in range(n_layers))
        self.decoder = nn.ModuleList(DecoderBlock(d_model, n_heads, **kw) for _ in range(n_layers))
        self.encoder_norm, self.decoder_norm = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, tgt_vocab)

    def _embed(self, tokens: torch.Tensor, table: nn.Embedding, pos: nn.Embedding, name: str) -> torch.Tensor:
        _validate.tensor(name, tokens, min_rank=2)
        if tokens.dim() != 2 or tokens.is_floating_point() or tokens.shape[1] > self.max_len:
            raise ValueError(f"{name} must be integer ids (B, T) with T <= {self.max_len}, "
                             f"got shape {tuple(tokens.shape)} and dtype {tokens.dtype}")
        return table(tokens) + pos.weight[: tokens.shape[1]]  # (B, T, d) + (T, d) -> (B, T, d)

    def key_padding(self, src: torch.Tensor) -> torch.Tensor:
        """(B, 1, 1, S) bool keep-mask: True at real source tokens (broadcasts over heads and queries)."""
        return (src != self.pad_id)[:, None, None, :]

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        """src (B, S) -> memory (B, S, d)."""
        x, keep = self._embed(src, self.src_embed, self.src_pos, "src"), self.key_padding(src)
        for block in self.encoder:
            x = block(x, attn_mask=keep)  # (B, S, d)
        return self.encoder_norm(x)

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src: torch.Tensor
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits (B, T, V) and each decoder layer's cross-attention weights (B, H, T, S)."""
        y, keep, weights = self._embed(tgt_in, self.tgt_embed, self.tgt_pos, "tgt_in"), self.key_padding(src), []
        for block in self.decoder:
            y, w = block(y, memory, memory_mask=keep, return_weights=True)  # (B, T, d), (B, H, T, S)
            weights.append(w)
        return self.head(self.decoder_norm(y)), weights

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: src (B, S), tgt_in (B, T) (the target shifted right) -> logits (B, T, V)."""
        return self.decode(tgt_in, self.encode(src), src)[0]

    @torch.no_grad()
    def greedy(self, src: torch.Tensor, steps: int, start_id: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Greedy decoding for `steps` tokens: (B, steps) ids, and the last step's cross-attention weights
        per layer (B, H, steps, S) (the causal mask makes earlier rows equal to the earlier steps')."""
        memory = self.encode(src)  # (B, S, d), computed once
        out = torch.full((src.shape[0], 1), start_id, dtype=torch.long, device=src.device)
        for _ in range(steps):
            logits, weights = self.decode(out, memory, src)  # (B, t, V)
            out = torch.cat([out, logits[:, -1:].argmax(-1)], dim=1)
        return out[:, 1:], weights


def _copy_attention(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
    theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
    theirs.out_proj.load_state_dict(ours.o_proj.state_dict())


def to_torch_decoder_layer(block: DecoderBlock) -> nn.TransformerDecoderLayer:
    """An ``nn.TransformerDecoderLayer`` (batch_first, dropout 0) holding a copy of `block`'s weights."""
    if not isinstance(block, DecoderBlock):
        raise TypeError(f"block must be a DecoderBlock, got {type(block).__name__}")
    a = block.self_attn
    ref = nn.TransformerDecoderLayer(
        a.d_model, a.n_heads, dim_feedforward=block.ff.linear1.out_features, dropout=0.0,
        activation=block.ff.activation, layer_norm_eps=block.norm1.eps, batch_first=True, norm_first=block.norm_first,
    ).to(dtype=a.q_proj.weight.dtype, device=a.q_proj.weight.device)
    with torch.no_grad():
        _copy_attention(block.self_attn, ref.self_attn)
        _copy_attention(block.cross_attn, ref.multihead_attn)
        for name in ("linear1", "linear2"):
            getattr(ref, name).load_state_dict(getattr(block.ff, name).state_dict())
        for name in ("norm1", "norm2", "norm3"):
            getattr(ref, name).load_state_dict(getattr(block, name).state_dict())
    return ref.eval()


def to_torch_transformer(model: EncoderDecoder) -> nn.Transformer:
    """An ``nn.Transformer`` (batch_first, dropout 0) with `model`'s blocks and final norms: it maps embedded
    inputs to the decoder's normalised output, the part of `model` between the embeddings and the head."""
    if not isinstance(model, EncoderDecoder):
        raise TypeError(f"model must be an EncoderDecoder, got {type(model).__name__}")
    first = model.decoder[0]
    with warnings.catch_warnings():  # PyTorch warns that pre-norm encoders cannot use its nested-tensor fast path
        warnings.simplefilter("ignore", UserWarning)
        ref = nn.Transformer(
            first.self_attn.d_model, first.self_attn.n_heads, len(model.encoder), len(model.decoder),
            first.ff.linear1.out_features, dropout=0.0, activation=first.ff.activation, batch_first=True,
            norm_first=first.norm_first,
        ).to(dtype=model.head.weight.dtype, device=model.head.weight.device)
    ref.encoder.enable_nested_tensor = ref.encoder.use_nested_tensor = False  # padded positions stay computed, as ours
    with torch.no_grad():
        for mine, theirs in zip(model.encoder, ref.encoder.layers):
            theirs.load_state_dict(to_torch_encoder_layer(mine).state_dict())
        for mine, theirs in zip(model.decoder, ref.decoder.layers):
            theirs.load_state_dict(to_torch_decoder_layer(mine).state_dict())
        ref.encoder.norm.load_state_dict(model.encoder_norm.state_dict())
        ref.decoder.norm.load_state_dict(model.decoder_norm.state_dict())
    return ref.eval()
