r"""What heads learn: an attention-only transformer, repeated-segment data, and scores that find
previous-token heads, induction heads and attention sinks in attention maps.

An **induction head** (Elhage et al., 2021; Olsson et al., 2022) completes ``[A][B] ... [A] -> [B]``: from the
current token it attends to the token *after* an earlier occurrence of the same token, and copies it. It
needs two layers: a **previous-token head** in layer 1 writes "my previous token was A" into each position,
and the layer-2 head matches its query (the current token A) against that. On a sequence made of a random
segment of length L followed by the same segment, the induction head of query t attends to key t - L + 1.

An **attention sink** (Xiao et al., 2023) is a key, usually the first token, that receives a large share of
attention whatever the query: softmax weights must sum to 1, so a head with nothing to attend to parks
its mass somewhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate
from .mha import MultiHeadAttention
from .variants import DifferentialAttention, SigmoidAttention

ATTENTIONS = ("softmax", "sigmoid", "differential", "sink_logit", "gated", "gated_headwise", "gated_value",
              "attn_bias", "softpick", "softmax_1")


# ----------------------------------------------------------------------------- data


def repeated_tokens(batch_size: int, seg_len: int, vocab_size: int,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, 2 L): a random segment of `seg_len` tokens followed by the same segment (the test sequence)."""
    for name, v in (("batch_size", batch_size), ("seg_len", seg_len), ("vocab_size", vocab_size)):
        _validate.positive_int(name, v)
    seg = torch.randint(0, vocab_size, (batch_size, seg_len), generator=generator)  # (B, L)
    return torch.cat([seg, seg], dim=1)  # (B, 2L)


def repeated_segment_tokens(batch_size: int, seq_len: int, vocab_size: int, *, min_len: int = 4,
                            max_len: int | None = None, generator: torch.Generator | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Training data for induction: each row is random tokens, then a random segment, then the segment again.

    Row b is ``[random prefix of seq_len - 2 L_b tokens][segment of L_b][same segment]`` with L_b drawn
    uniformly from ``min_len .. max_len`` (default seq_len // 2). Because the distance between the two copies
    changes from row to row, a head that attends a fixed number of positions back cannot solve it.

    Returns:
        tokens (B, seq_len) int64 and seg_len (B,) int64.
    """
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len), ("vocab_size", vocab_size),
                    ("min_len", min_len)):
        _validate.positive_int(name, v)
    max_len = seq_len // 2 if max_len is None else _validate.positive_int("max_len", max_len)
    if not min_len <= max_len <= seq_len // 2:
        raise ValueError(f"need min_len <= max_len <= seq_len // 2, got min_len={min_len}, max_len={max_len}, "
                         f"seq_len={seq_len}")
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)  # (B, T)
    lens = torch.randint(min_len, max_len + 1, (batch_size,), generator=generator)  # (B,)
    pos = torch.arange(seq_len)  # (T,)
    second = pos >= seq_len - lens[:, None]  # (B, T): True on the second copy
    src = (pos - lens[:, None]).clamp(min=0)  # (B, T): where the second copy reads from
    tokens = torch.where(second, tokens.gather(1, src), tokens)  # (B, T)
    return tokens, lens


# ----------------------------------------------------------------------------- model


@dataclass
class AttnOnlyConfig:
    vocab_size: int
    block_size: int = 64  # longest sequence (learned positions)
    d_model: int = 64
    n_heads: int = 4  # for "differential": differential heads, each with two maps
    n_layers: int = 2
    attention: str = "softmax"  # one of ATTENTIONS
    norm: bool = True  # LayerNorm before each attention layer (False: the pure residual stream of Elhage et al.)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "d_model", "n_heads", "n_layers"):
            _validate.positive_int(name, getattr(self, name))
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")


def _attention_layer(c: AttnOnlyConfig, layer: int) -> nn.Module:
    if c.attention == "softmax":
        return MultiHeadAttention(c.d_model, c.n_heads)
    if c.attention == "sigmoid":
        return SigmoidAttention(c.d_model, c.n_heads)
    if c.attention == "sink_logit":  # the 2025 answers that keep softmax (chapter 12, section 4b)
        from .sink_variants import SinkLogitAttention
        return SinkLogitAttention(c.d_model, c.n_heads)
    if c.attention.startswith("gated"):  # Qiu et al.'s G1 elementwise, G1 head-wise, G2 (on the values)
        from .sink_variants import GatedAttention
        gate = {"gated": "elementwise", "gated_headwise": "headwise", "gated_value": "value"}[c.attention]
        return GatedAttention(c.d_model, c.n_heads, gate=gate)
    if c.attention in ("softpick", "softmax_1"):  # Zuhri et al. 2025; Miller 2023 (= the sink logit frozen at 0)
        from .sink_fixes import SoftmaxOneAttention, SoftpickAttention
        return (SoftpickAttention if c.attention == "softpick" else SoftmaxOneAttention)(c.d_model, c.n_heads)
    if c.attention == "attn_bias":  # Sun et al. 2024's explicit attention bias (chapter 12)
        from .variant_claims import AttnBiasAttention
        return AttnBiasAttention(c.d_model, c.n_heads, init_seed=layer)
    return DifferentialAttention(c.d_model, c.n_heads, layer=layer)


class AttnOnlyTransformer(nn.Module):
    """A causal language model with attention layers only (no MLPs): tokens (B, T) -> logits (B, T, V).

    x = embed(tokens) + pos;  x = x + attn_l(LN_l(x)) for each layer;  logits = unembed(LN(x)).
    ``forward(tokens, return_weights=True)`` also returns each layer's attention map (B, H, T, T).
    """

    def __init__(self, config: AttnOnlyConfig):
        super().__init__()
        if not isinstance(config, AttnOnlyConfig):
            raise TypeError(f"config must be an AttnOnlyConfig, got {type(config).__name__}")
        self.config = c = config
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.block_size, c.d_model)
        self.norms = nn.ModuleList(nn.LayerNorm(c.d_model) if c.norm else nn.Identity() for _ in range(c.n_layers))
        self.attns = nn.ModuleList(_attention_layer(c, i + 1) for i in range(c.n_layers))
        self.norm = nn.LayerNorm(c.d_model) if c.norm else nn.Identity()
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, *, return_weights: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens (B, T) -> logits (B, T, V) [, list of n_layers maps (B, H, T, T)]."""
        _validate.tensor("tokens", tokens, min_rank=2)
        t = tokens.shape[-1]
        if tokens.dim() != 2 or tokens.is_floating_point() or t > self.config.block_size:
            raise ValueError(f"tokens must be integer ids (B, T) with T <= block_size={self.config.block_size}, "
                             f"got shape {tuple(tokens.shape)}, dtype {tokens.dtype}")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))  # (B, T, d) + (T, d)
        maps = []
        for norm, attn in zip(self.norms, self.attns):
            a, w = attn(norm(x), is_causal=True, return_weights=True)  # (B, T, d), (B, H, T, T)
            x = x + a
            maps.append(w)
        logits = self.head(self.norm(x))  # (B, T, d) -> (B, T, V)
        return (logits, maps) if return_weights else logits


def token_losses(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Per-position next-token cross-entropy (B, T - 1): entry t is the loss of predicting token t + 1."""
    logits = model(tokens[:, :-1])  # (B, T-1, V)
    return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")  # (B, T-1)


# ----------------------------------------------------------------------------- scores


def _check_maps(weights: torch.Tensor) -> torch.Tensor:
    _validate.tensor("weights", weights, min_rank=2, floating=True)
    if weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights must be self-attention maps (..., T, T), got shape {tuple(weights.shape)}")
    return weights


def previous_token_scores(weights: torch.Tensor) -> torch.Tensor:
    """Mean weight from query t to key t - 1 over t = 1 .. T-1: (..., T, T) -> (...). 1 for a perfect
    previous-token head."""
    _check_maps(weights)
    if weights.shape[-1] < 2:
        raise ValueError(f"need T >= 2 for a previous token, got shape {tuple(weights.shape)}")
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)  # (..., T-1) -> (...)


def induction_scores(weights: torch.Tensor, seg_len: int) -> torch.Tensor:
    """Mean weight from query t to key t - seg_len + 1 over the second copy t = seg_len .. 2 seg_len - 1.

    For maps (..., 2L, 2L) of a model run on :func:`repeated_tokens` (a segment of L tokens, then again):
    key t - L + 1 holds the token that followed the current token last time. 1 for a perfect induction head.
    Returns (...).
    """
    _check_maps(weights)
    _validate.positive_int("seg_len", seg_len)
    if weights.shape[-1] != 2 * seg_len:
        raise ValueError(f"weights must be (..., 2*seg_len, 2*seg_len) = (..., {2 * seg_len}, {2 * seg_len}) "
                         f"for seg_len={seg_len}, got shape {tuple(weights.shape)}")
    return weights.diagonal(offset=-(seg_len - 1), dim1=-2, dim2=-1)[..., 1:].mean(-1)  # queries L .. 2L-1


def sink_scores(weights: torch.Tensor, *, n_sink: int = 1, min_query: int = 0) -> torch.Tensor:
    """Mean weight on the first `n_sink` keys over queries t >= min_query: (..., Tq, Tk) -> (...)."""
    _validate.tensor("weights", weights, min_rank=2, floating=True)
    _validate.positive_int("n_sink", n_sink)
    if not 0 <= min_query < weights.shape[-2] or n_sink > weights.shape[-1]:
        raise ValueError(f"need 0 <= min_query < Tq and n_sink <= Tk, got min_query={min_query}, n_sink={n_sink}, "
                         f"weights {tuple(weights.shape)}")
    return weights[..., min_query:, :n_sink].sum(-1).mean(-1)  # (..., Tq', n_sink) -> (...)


@torch.no_grad()
def attention_maps(model: nn.Module, *args, **kwargs) -> list[torch.Tensor]:
    """Run ``model(*args, **kwargs)`` and return the weights (B, H, T, S) of every attention module it calls,
    in call order.

    Works for any model whose attention layers are :class:`~attncourse.MultiHeadAttention` (or a subclass)
    or :class:`~attncourse.DifferentialAttention` called with ``return_weights=True``, as
    :class:`~attncourse.TransformerBlock` (and so :class:`~attncourse.GPT`) does.
    """
    maps: list[torch.Tensor] = []

    def hook(module, inputs, output):
        if isinstance(output, tuple):
            maps.append(output[1].detach())

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (MultiHeadAttention, DifferentialAttention))]
    try:
        model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    if not maps:
        raise ValueError(f"{type(model).__name__} returned no attention weights: its attention modules must be "
                         "called with return_weights=True")
    return maps


# ----------------------------------------------------------------------------- causal role: ablation and copying


def _head_width(model: AttnOnlyTransformer) -> int:
    return model.config.d_model // model.config.n_heads  # MHA: head_dim; differential: 2d per head


def _check_head(model: nn.Module, layer: int, head: int) -> None:
    if not isinstance(model, AttnOnlyTransformer):
        raise TypeError(f"model must be an AttnOnlyTransformer, got {type(model).__name__}")
    c = model.config
    if not (isinstance(layer, int) and isinstance(head, int) and 0 <= layer < c.n_layers and 0 <= head < c.n_heads):
        raise ValueError(f"(layer, head) must be ints in [0, {c.n_layers}) x [0, {c.n_heads}), got ({layer!r}, {head!r})")


@contextmanager
def ablate_heads(model: AttnOnlyTransformer, heads: Iterable[tuple[int, int]]) -> Iterator[None]:
    """Zero-ablate heads of `model` inside a ``with`` block: each (layer, head) (0-based) adds nothing to the
    residual stream.

    A forward pre-hook on the layer's output projection zeroes the head's slice of its input (the merged heads
    (B, T, H * width)); the attention maps are still computed, only the head's output is removed.
    """
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        _check_head(model, layer, head)
        by_layer.setdefault(layer, []).append(head)
    width = _head_width(model)

    def make_hook(hs: list[int]):
        def hook(module, args):
            x = args[0].clone()  # (B, T, H * width)
            for h in hs:
                x[..., h * width:(h + 1) * width] = 0
            return (x, *args[1:])
        return hook

    handles = [model.attns[layer].o_proj.register_forward_pre_hook(make_hook(hs)) for layer, hs in by_layer.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def repeated_half_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss on the second copy of :func:`repeated_tokens` (B, 2L): predictions of tokens
    L + 1 .. 2L - 1, the ones an induction head can copy. A 0-dim tensor."""
    _validate.tensor("tokens", tokens, min_rank=2)
    if tokens.dim() != 2 or tokens.shape[1] % 2 or tokens.shape[1] < 4:
        raise ValueError(f"tokens must be (B, 2L) with L >= 2, got shape {tuple(tokens.shape)}")
    return token_losses(model, tokens)[:, tokens.shape[1] // 2:].mean()  # (B, 2L - 1) -> ()


@torch.no_grad()
def ablation_effects(model: AttnOnlyTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """(layers, H): how much the repeated-half loss rises when each head alone is zero-ablated."""
    c = model.config
    base = repeated_half_loss(model, tokens)
    out = torch.zeros(c.n_layers, c.n_heads)
    for layer in range(c.n_layers):
        for head in range(c.n_heads):
            with ablate_heads(model, [(layer, head)]):
                out[layer, head] = repeated_half_loss(model, tokens) - base
    return out


@torch.no_grad()
def ov_logits(model: AttnOnlyTransformer, layer: int, head: int) -> torch.Tensor:
    """(V, V): row a holds the logits one head adds when it attends entirely to a token a: the OV circuit
    W_U W_O W_V W_E of Elhage et al. (2021), here with the layer's LayerNorm on the input (token embedding plus
    the mean position embedding), the differential head's own norm, and the final LayerNorm without its
    per-row scale and bias (which shift or scale a row's logits but do not reorder them)."""
    _check_head(model, layer, head)
    attn, width = model.attns[layer], _head_width(model)
    x = model.norms[layer](model.tok.weight + model.pos.weight.mean(0))  # (V, d_model)
    v = attn.v_proj(x)[:, head * width:(head + 1) * width]  # (V, width): the head's value of each token
    if isinstance(attn, DifferentialAttention):
        v = attn.subln(v) * (1.0 - attn.lambda_init)
    o = v @ attn.o_proj.weight[:, head * width:(head + 1) * width].T  # (V, width) @ (width, d) -> (V, d)
    if isinstance(model.norm, nn.LayerNorm):
        o = (o - o.mean(-1, keepdim=True)) * model.norm.weight  # centred, with the gain
    return o @ model.head.weight.T  # (V, d) @ (d, V) -> (V, V)


def copying_scores(model: AttnOnlyTransformer) -> torch.Tensor:
    """(layers, H): for each head, the share of tokens a whose own logit is the largest in the head's OV
    row a (:func:`ov_logits`): 1 for a head that copies whatever it attends to, about 1/V by chance."""
    c = model.config
    out = torch.zeros(c.n_layers, c.n_heads)
    for layer in range(c.n_layers):
        for head in range(c.n_heads):
            m = ov_logits(model, layer, head)  # (V, V)
            out[layer, head] = (m.argmax(-1) == torch.arange(m.shape[0])).float().mean()
    return out


def planted_induction_model(vocab_size: int, seg_len: int, *, generator: torch.Generator | None = None,
                            noise: float = 0.1) -> AttnOnlyTransformer:
    """A 2-layer, 2-head attention-only model (no LayerNorm) whose weights are set by hand to an induction
    circuit: head (0, 0) is a previous-token head, head (1, 0) an induction head reading what it wrote; heads
    (0, 1) and (1, 1) are random (N(0, noise^2) weights drawn from `generator`), doing something useless.

    Residual stream: [token one-hot | position one-hot | previous token | copied token]. A known answer for
    ablation and copying tools: on :func:`repeated_tokens` of length 2 seg_len, removing either circuit head
    sends the repeated-half loss towards ln V, removing a random head barely moves it.
    """
    for name, v in (("vocab_size", vocab_size), ("seg_len", seg_len)):
        _validate.positive_int(name, v)
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or noise < 0:
        raise ValueError(f"noise must be a float >= 0, got {noise!r}")
    n_vocab, t = vocab_size, 2 * seg_len
    tok, pos, prev, cop = 0, n_vocab, n_vocab + t, 2 * n_vocab + t  # slot offsets in the residual stream
    d_model = max(3 * n_vocab + t, 2 * max(n_vocab, t))
    d_model += d_model % 2
    width = d_model // 2
    model = AttnOnlyTransformer(AttnOnlyConfig(n_vocab, block_size=t, d_model=d_model, n_heads=2, norm=False))
    sharp = 12.0 * width ** 0.5  # scores of 12 after the 1/sqrt(width) scale: one key takes ~all the weight
    ids, ps = torch.arange(n_vocab), torch.arange(t)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * noise)
        for p in (model.tok.weight, model.pos.weight, model.head.weight):
            p.zero_()
        model.tok.weight[ids, tok + ids] = 1.0
        model.pos.weight[ps, pos + ps] = 1.0
        model.head.weight[ids, cop + ids] = 10.0  # the unembedding reads the copied-token slot
        for layer, (q_from, k_from, write) in enumerate(((pos, None, prev), (tok, prev, cop))):
            a = model.attns[layer]
            for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight):
                w[:width].zero_()
            a.o_proj.weight[:, :width].zero_()
            if layer == 0:  # query t matches key t - 1: key j carries position j + 1
                a.q_proj.weight[ps, pos + ps] = sharp
                a.k_proj.weight[ps[1:], pos + ps[:-1]] = 1.0
            else:  # query: the current token; key: the token before it (written by head (0, 0))
                a.q_proj.weight[ids, q_from + ids] = sharp
                a.k_proj.weight[ids, k_from + ids] = 1.0
            a.v_proj.weight[ids, tok + ids] = 1.0  # value: the key's own token
            a.o_proj.weight[write + ids, ids] = 1.0
            a.o_proj.weight[prev:cop + n_vocab, width:] = 0.0  # the random heads leave the circuit's slots alone
    return model.eval()

