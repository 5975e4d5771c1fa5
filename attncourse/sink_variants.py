r"""The 2025 answers to attention sinks, side by side on one tiny language model (chapter 12).

A softmax row sums to 1, so a head with nothing to read must still put its weight somewhere; trained models park
it on the first token (an *attention sink*) and grow a few huge activations that make that token's key stand out
(Sun et al. 2024, "Massive activations"). Five attentions, each a drop-in layer of :class:`SinkStudyLM`:

- ``"softmax"``: :class:`~attncourse.MultiHeadAttention`, the baseline;
- ``"sink_logit"``: :class:`SinkLogitAttention`, softmax with one learned logit per head in the denominator,
  as gpt-oss does (``openai/gpt-oss``, ``gpt_oss/torch/model.py``, ``sdpa``: the logit is appended as an
  extra column, softmaxed with the scores and dropped): a head can give weight to "nothing";
- ``"gated"``: :class:`GatedAttention`, Qiu et al. (2025)'s output gate: each head's output is multiplied
  elementwise by :math:`\sigma(x W_g)`, computed from the same (pre-normed) input as the query, so it depends on
  the query; a head can switch itself off;
- ``"sigmoid"``: :class:`~attncourse.SigmoidAttention` with :math:`b = -\log n` (Ramapuram et al. 2024);
- ``"differential"``: :class:`~attncourse.DifferentialAttention` (Ye et al. 2024) with half as many heads of
  twice the width, so the projections are the same size.

:func:`first_token_weight` and :func:`largest_activations` measure the two symptoms.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import _validate
from .mha import MultiHeadAttention, merge_heads, repeat_kv
from .sdpa import compute_dtype, scaled_dot_product_attention
from .variants import DifferentialAttention, SigmoidAttention

__all__ = ["sink_softmax_attention", "SinkLogitAttention", "GatedAttention", "SinkStudyLM", "VARIANTS",
           "first_token_weight", "largest_activations"]

VARIANTS = ("softmax", "sink_logit", "gated", "sigmoid", "differential")


def masked_scores(q: torch.Tensor, k: torch.Tensor, scale: float, attn_mask: torch.Tensor | None,
                  is_causal: bool) -> torch.Tensor:
    """Scaled scores (B, H, Tq, Tk) with the causal mask and `attn_mask` (bool: True keeps; float: added)."""
    scores = (q @ k.transpose(-2, -1)) * scale  # (B,H,Tq,D) @ (B,H,D,Tk) -> (B,H,Tq,Tk)
    if is_causal:
        keep = torch.ones(*scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()  # (Tq, Tk)
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask.to(scores.dtype)
    return scores


def sink_softmax_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sink_logits: torch.Tensor,
                           attn_mask: torch.Tensor | None = None, *, is_causal: bool = False,
                           scale: float | None = None, return_weights: bool = False
                           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Softmax attention with a learned sink logit :math:`s_h` per head (gpt-oss):
    :math:`w_{ij} = e^{x_{ij}} / (\sum_k e^{x_{ik}} + e^{s_h})`, so a row sums to less than 1.

    Args:
        query (B, H, Tq, D), key (B, H, Tk, D), value (B, H, Tk, Dv): one head per query head (repeat GQA first).
        sink_logits (H,): one logit per head.
        attn_mask: bool (True = may attend) or float (added), broadcastable to (B, H, Tq, Tk).
        is_causal: top-left causal mask, as ``F.scaled_dot_product_attention``.
        scale: default 1/sqrt(D).
    Returns (B, H, Tq, Dv), and the weights (B, H, Tq, Tk) (without the sink's column) if `return_weights`.
    Scores and softmax run in float32 for half-precision inputs. Raises ValueError for mismatched shapes.
    """
    for name, t in (("query", query), ("key", key), ("value", value), ("sink_logits", sink_logits)):
        _validate.tensor(name, t, floating=True)
    if query.dim() != 4 or key.shape != query.shape[:2] + key.shape[2:3] + query.shape[3:] or \
            value.shape[:3] != key.shape[:3]:
        raise ValueError(f"query (B, H, Tq, D), key (B, H, Tk, D) and value (B, H, Tk, Dv) needed, got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if sink_logits.shape != (query.shape[1],):
        raise ValueError(f"sink_logits must be (H,) = ({query.shape[1]},), got {tuple(sink_logits.shape)}")
    work = compute_dtype(query.dtype)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    scores = masked_scores(query.to(work), key.to(work), scale, attn_mask, is_causal)  # (B, H, Tq, Tk)
    sink = sink_logits.to(work).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (B, H, Tq, 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # (B, H, Tq, Tk): sink dropped
    out = (weights @ value.to(work)).to(value.dtype)  # (B,H,Tq,Tk) @ (B,H,Tk,Dv) -> (B,H,Tq,Dv)
    return (out, weights) if return_weights else out


class SinkLogitAttention(MultiHeadAttention):
    """:class:`~attncourse.MultiHeadAttention` with a learned sink logit per head (``self.sinks``, (H,), zeros at
    the start). ``forward(x, *, attn_mask=None, is_causal=False, return_weights=False)``: self-attention only."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *, bias: bool = False):
        super().__init__(d_model, n_heads, n_kv_heads, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(n_heads))

    def forward(self, x: torch.Tensor, *, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                return_weights: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d_model) -> (B, T, d_model) [, weights (B, H, T, T)]."""
        q, k, v = self.project_qkv(x)  # (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)  # (B, H, T, D)
        out, weights = sink_softmax_attention(q, k, v, self.sinks, attn_mask, is_causal=is_causal,
                                              return_weights=True)  # (B, H, T, D), (B, H, T, T)
        out = self.o_proj(merge_heads(out))  # (B, H, T, D) -> (B, T, d_model)
        return (out, weights) if return_weights else out


class GatedAttention(MultiHeadAttention):
    r"""Qiu et al. (2025)'s gated attention (their G1, elementwise, head-specific): softmax attention whose output
    is multiplied by :math:`\sigma(x W_g + b_g)` before the output projection; ``gate_proj`` maps the layer's input
    (the same x the queries come from) to H x D gates. Adds ``d_model * H * D`` weights and the bias ``b_g``, which
    is this course's addition: Qiu et al.'s code and Qwen3-Next compute the gate without a bias, as extra output
    columns of the query projection.
    ``forward(x, *, attn_mask=None, is_causal=False, return_weights=False)``: self-attention only; the weights
    returned are the softmax map (before the gate), and ``self.last_gate`` keeps the gates (B, H, T, D), or
    (B, H, T, 1) head-wise.

    ``gate`` picks one of the positions and granularities of Qiu et al.'s Table 1 (their G1 and G2 rows):
    ``"elementwise"`` (G1, the default and their best), ``"headwise"`` (G1 with one scalar gate per head and
    query: ``gate_proj`` maps to H numbers) and ``"value"`` (G2: the elementwise gate multiplies the values,
    after the value projection, instead of the attention output)."""

    GATES = ("elementwise", "headwise", "value")

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *, bias: bool = False,
                 gate: str = "elementwise"):
        super().__init__(d_model, n_heads, n_kv_heads, bias=bias)
        if gate not in self.GATES:
            raise ValueError(f"gate must be one of {self.GATES}, got {gate!r}")
        if gate == "value" and self.n_kv_heads != n_heads:
            raise ValueError(f"gate='value' gates each query head's values: needs n_kv_heads == n_heads, got "
                             f"n_kv_heads={self.n_kv_heads}, n_heads={n_heads}")
        self.gate = gate
        self.gate_proj = nn.Linear(d_model, n_heads if gate == "headwise" else d_model, bias=True)
        self.last_gate: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, *, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                return_weights: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d_model) -> (B, T, d_model) [, weights (B, H, T, T)]."""
        q, k, v = self.project_qkv(x)  # (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)  # (B, H, T, D)
        gate = torch.sigmoid(self.gate_proj(x)).view(*x.shape[:2], self.n_heads, -1).transpose(1, 2)  # (B,H,T,D|1)
        self.last_gate = gate.detach()
        if self.gate == "value":  # G2: gate the values (query-independent at the keys' positions)
            v = v * gate  # (B, H, T, D)
        heads, weights = scaled_dot_product_attention(q, k, v, attn_mask, is_causal=is_causal,
                                                      return_weights=True)  # (B, H, T, D), (B, H, T, T)
        if self.gate != "value":  # G1: gate each head's output at the query's position
            heads = heads * gate  # (B, H, T, D) * (B, H, T, D or 1)
        out = self.o_proj(merge_heads(heads))  # (B, H, T, D) -> (B, T, d_model)
        return (out, weights) if return_weights else out


def _attention(kind: str, d_model: int, n_heads: int, layer: int) -> nn.Module:
    if kind == "softmax":
        return MultiHeadAttention(d_model, n_heads)
    if kind == "sink_logit":
        return SinkLogitAttention(d_model, n_heads)
    if kind == "gated":
        return GatedAttention(d_model, n_heads)
    if kind == "sigmoid":
        return SigmoidAttention(d_model, n_heads)
    return DifferentialAttention(d_model, n_heads // 2, layer=layer + 1)


class SinkStudyLM(nn.Module):
    """A tiny pre-norm causal language model (learned positions, GELU MLPs) whose attention is one of
    :data:`VARIANTS`. ``forward(tokens (B, T), return_internals=False)`` -> logits (B, T, V), and with
    `return_internals` also the attention maps (one (B, H, T, T) per layer) and the residual stream after the
    embedding and after each block (a list of (B, T, d_model)). Raises ValueError for an unknown variant or an
    odd head count with ``"differential"``."""

    def __init__(self, vocab_size: int, block_size: int, *, d_model: int = 64, n_heads: int = 4,
                 n_layers: int = 2, attention: str = "softmax"):
        super().__init__()
        if attention not in VARIANTS:
            raise ValueError(f"attention must be one of {VARIANTS}, got {attention!r}")
        if attention == "differential" and n_heads % 2:
            raise ValueError(f"differential attention needs an even n_heads (pairs of maps), got {n_heads}")
        for name, x in (("vocab_size", vocab_size), ("block_size", block_size), ("d_model", d_model),
                        ("n_heads", n_heads), ("n_layers", n_layers)):
            _validate.positive_int(name, x)
        self.attention = attention
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.norms1 = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layers))
        self.attns = nn.ModuleList(_attention(attention, d_model, n_heads, i) for i in range(n_layers))
        self.norms2 = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layers))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                                nn.Linear(4 * d_model, d_model)) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, return_internals: bool = False) -> Any:
        if tokens.dim() != 2 or tokens.is_floating_point() or tokens.shape[1] > self.pos.num_embeddings:
            raise ValueError(f"tokens must be integer ids (B, T) with T <= {self.pos.num_embeddings}, got "
                             f"{tuple(tokens.shape)} {tokens.dtype}")
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))  # (B, T, d)
        maps, states = [], [x]
        for norm1, attn, norm2, mlp in zip(self.norms1, self.attns, self.norms2, self.mlps):
            a, w = attn(norm1(x), is_causal=True, return_weights=True)  # (B, T, d), (B, H, T, T)
            x = x + a
            x = x + mlp(norm2(x))  # (B, T, d)
            maps.append(w)
            states.append(x)
        logits = self.head(self.norm(x))  # (B, T, V)
        return (logits, maps, states) if return_internals else logits


def first_token_weight(weights: torch.Tensor, *, min_query: int = 1) -> torch.Tensor:
    """The weight each head gives key 0, averaged over the batch and over queries ``t >= min_query``.

    weights (B, H, T, S) -> (H,). The raw weight, not renormalised: sigmoid, sink-logit and differential rows
    need not sum to 1, and a small weight on key 0 with a small row sum is exactly "not attending"."""
    _validate.tensor("weights", weights, floating=True)
    if weights.dim() != 4 or not 0 <= min_query < weights.shape[-2]:
        raise ValueError(f"weights must be (B, H, T, S) with min_query in [0, T), got {tuple(weights.shape)} and "
                         f"min_query={min_query}")
    return weights[:, :, min_query:, 0].float().mean(dim=(0, 2))  # (H,)


def largest_activations(states: list[torch.Tensor]) -> tuple[float, float]:
    """(the largest absolute activation anywhere in the residual streams given, that over the median absolute activation).

    states: a list of (B, T, d_model) tensors, e.g. the residual stream after each block. Sun et al. (2024) call
    activations far larger than all others (up to 100,000 times, their abstract) "massive"; a small
    model shows whether one is starting."""
    if not states:
        raise ValueError("states must be a non-empty list of (B, T, d_model) tensors")
    flat = torch.cat([s.detach().abs().flatten().float() for s in states])
    top = flat.max().item()
    return top, top / max(flat.median().item(), 1e-12)


def _bos_batch(batch_size: int, seq_len: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """BOS (id `vocab_size`) + a row of :func:`~attncourse.heads.repeated_segment_tokens`: (B, 1 + seq_len)."""
    from .heads import repeated_segment_tokens

    x, _ = repeated_segment_tokens(batch_size, seq_len, vocab_size, generator=generator)  # (B, T)
    return torch.cat([torch.full((batch_size, 1), vocab_size), x], dim=1)


def train_sink_variant(attention: str, seed: int, *, steps: int = 400, vocab_size: int = 32, seq_len: int = 24,
                       batch_size: int = 32, lr: float = 1e-2) -> dict:
    """Train :class:`SinkStudyLM` with one attention on BOS + repeated-segment sequences (chapter 12's data) and
    measure it on 128 held-out sequences (the same for every attention and seed).

    Returns ``{"loss": held-out next-token loss, "first_token": per layer, the weight each head gives BOS
    (queries 1..T, see :func:`first_token_weight`), "max_act", "max_over_median": see
    :func:`largest_activations` on the residual stream after each block, "row_mass": per layer, each head's mean
    row sum over the same queries (1 for softmax; 1 minus the sink's own weight with a sink logit), so that
    first_token / row_mass is BOS's share of the weight the row gives to real keys}``. Weights and batches depend only on
    `seed`, so every attention sees the same data."""
    if attention not in VARIANTS:
        raise ValueError(f"attention must be one of {VARIANTS}, got {attention!r}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = SinkStudyLM(vocab_size + 1, seq_len + 1, attention=attention)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    data = torch.Generator().manual_seed(1000 + seed)
    for _ in range(steps):
        x = _bos_batch(batch_size, seq_len, vocab_size, data)  # (B, 1 + T)
        loss = torch.nn.functional.cross_entropy(model(x)[:, :-1].transpose(1, 2), x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    test = _bos_batch(128, seq_len, vocab_size, torch.Generator().manual_seed(99))
    with torch.no_grad():
        logits, maps, states = model(test, return_internals=True)
        held_out = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), test[:, 1:]).item()
    top, ratio = largest_activations(states[1:])
    row_mass = [w[:, :, 1:].float().sum(-1).mean(dim=(0, 2)).tolist() for w in maps]  # per layer, (H,)
    return {"loss": held_out, "first_token": [first_token_weight(w).tolist() for w in maps], "max_act": top,
            "max_over_median": ratio, "row_mass": row_mass}
