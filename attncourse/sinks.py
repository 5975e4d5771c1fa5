r"""Attention sinks as a phenomenon (StreamingLLM, Xiao et al. 2023), on the course's tiny GPT.

A model trained with full causal attention always sees the first token of its sequence. Xiao et al. found
that trained LLMs park a large share of their attention there (an *attention sink*); a window cache that
evicts those first tokens changes every attention distribution and the loss blows up, while keeping a few
of them (4 + a window) keeps the loss where it was. Positions are numbered **inside the cache**, so a model
with relative positions never meets a distance longer than its cache.

Two ways to run a stream through a bounded cache, equal to each other (tests/test_sinks.py):

* :func:`stream_decode_logits`: token by token through one :class:`~attncourse.kv_cache.SinkWindowCache`
  per layer (``reindex=True``), as a server would;
* :func:`streaming_logits`: one forward whose mask and ALiBi bias say, for every query, which keys its
  cache holds and at which in-cache distance. Fast enough for a lesson.

:func:`sink_experiment` trains the sine models of chapter 07 and measures the loss of each cache policy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import _validate
from .gpt import GPT
from .kv_cache import SinkWindowCache
from .masks import attention_sink, materialize, materialize_at
from .mha import merge_heads, repeat_kv
from .positions import apply_rope
from .sdpa import safe_softmax


def with_bos(tokens: torch.Tensor, bos: int) -> torch.Tensor:
    """Prepend a beginning-of-sequence token to every row: (B, T) -> (B, T + 1)."""
    _validate.tensor("tokens", tokens, min_rank=2)
    if tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError(f"tokens must be integer ids (B, T), got shape {tuple(tokens.shape)}, dtype {tokens.dtype}")
    return torch.cat([torch.full((tokens.shape[0], 1), bos, dtype=tokens.dtype, device=tokens.device), tokens], 1)


def streaming_caches(model: GPT, batch_size: int, window: int, n_sink: int, *, reindex: bool = True
                     ) -> list[SinkWindowCache]:
    """One sink + window cache per layer of `model` (positions inside the cache by default)."""
    c = model.config
    return [SinkWindowCache(batch_size, c.n_kv_heads or c.n_heads, c.d_model // c.n_heads, window, n_sink,
                            reindex=reindex) for _ in range(c.n_layers)]


def in_cache_positions(seq_len: int, window: int, n_sink: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a stream through a sink + window cache looks like from inside the cache.

    Returns ``visible`` bool (T, T) (query i sees sink keys j < n_sink and keys i - window + 1 .. i),
    ``key_pos`` long (T, T) (key j's index inside query i's cache, where visible) and ``query_pos`` long
    (T,) (query i's own index: the number of keys it sees, minus one).
    """
    visible = materialize(attention_sink(n_sink, window), seq_len, seq_len)  # (T, T)
    key_pos = visible.long().cumsum(-1) - 1  # (T, T): rank among the keys the cache holds
    query_pos = visible.long().sum(-1) - 1  # (T,): the query is the newest entry
    return visible, key_pos, query_pos


def _rope_block(block, x: torch.Tensor, visible: torch.Tensor, query_pos: torch.Tensor, n_sink: int
                ) -> torch.Tensor:
    """One pre-norm block of a RoPE model whose queries see their cache with positions inside it.

    With RoPE a score depends on the distance between the query's and the key's positions. Inside a
    sink + window cache a window key is as far from the query as in the stream (i - j), but a sink j sits
    at distance ``query_pos[i] - j``: the sink scores come from queries rotated at their in-cache position.
    """
    attn = block.attn
    q, k, v = attn.project_qkv(block.norm1(x))  # (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D)
    q_stream, k = attn.rotate(q, k, 0)  # rotated at stream positions 0 .. T-1
    q_cache = apply_rope(q, query_pos.to(q.device), inv_freq=attn.inv_freq) * attn.rope_factor  # (B, H, T, D)
    k, v = repeat_kv(k, attn.n_rep), repeat_kv(v, attn.n_rep)  # (B, H, T, D)
    scale = attn.head_dim ** -0.5
    s_stream = q_stream @ k.transpose(-2, -1) * scale  # (B, H, T, D) @ (B, H, D, T) -> (B, H, T, T)
    s_cache = q_cache @ k.transpose(-2, -1) * scale  # (B, H, T, T)
    is_sink = (torch.arange(x.shape[1], device=x.device) < n_sink)[None, :]  # (1, T) over keys
    scores = torch.where(is_sink, s_cache, s_stream).masked_fill(~visible, float("-inf"))  # (B, H, T, T)
    out = safe_softmax(scores) @ v  # (B, H, T, T) @ (B, H, T, D) -> (B, H, T, D)
    x = x + attn.o_proj(merge_heads(out))  # (B, T, d)
    return x + block.ff(block.norm2(x))


@torch.no_grad()
def streaming_logits(model: GPT, tokens: torch.Tensor, window: int, n_sink: int, *, reindex: bool = True
                     ) -> torch.Tensor:
    """Logits (B, T, V) of `tokens` (B, T) streamed through a sink + window cache, in one forward.

    Equal to decoding token by token through the cache (:func:`stream_decode_logits`; for RoPE, through ring
    buffers that store keys before rotating them, as StreamingLLM's does: tests/test_sinks.py). With
    ``reindex=False`` the keys keep their stream positions (the mask alone bounds the cache).
    """
    _validate.tensor("tokens", tokens, min_rank=2)
    _validate.positive_int("window", window)
    t = tokens.shape[1]
    visible, key_pos, query_pos = in_cache_positions(t, window, n_sink)
    c = model.config
    if not reindex:
        query_pos = torch.arange(t)
        key_pos = query_pos[None, :].expand(t, t)
    if c.position == "rope" and reindex:
        if not model.blocks[0].norm_first:
            raise ValueError("streaming_logits supports the GPT's pre-norm blocks only")
        x = model.embed(tokens, torch.arange(t, device=tokens.device))  # (B, T, d): no position vector
        for block in model.blocks:
            x = _rope_block(block, x, visible.to(tokens.device), query_pos, n_sink)
        return model.head(model.norm(x))
    if c.position == "alibi":
        bias = model.slopes[:, None, None] * (key_pos - query_pos[:, None]).to(model.slopes)  # (H, T, T)
        mask = bias.masked_fill(~visible, float("-inf"))
    elif c.position in ("none", "rope") or not reindex:
        mask = visible
    else:
        raise ValueError(f"streaming_logits re-indexes RoPE, ALiBi or position-free models, got position="
                         f"{c.position!r}")
    x = model.embed(tokens, query_pos.to(tokens.device))  # (B, T, d)
    for block in model.blocks:
        x = block(x, attn_mask=mask.to(tokens.device))  # (B, T, d)
    return model.head(model.norm(x))  # (B, T, V)


def _rope_decode_block(block, x: torch.Tensor, cache: SinkWindowCache) -> torch.Tensor:
    """One pre-norm block of a RoPE model for one new token x (B, 1, d), through a cache of **unrotated** keys.

    StreamingLLM's RoPE cache: the cache stores keys before rotation; at every step the query is rotated at its
    position inside the cache and every cached key at its own (:meth:`SinkWindowCache.key_positions` with
    ``reindex=True``: ranks, in the ring's slot order), so no distance exceeds the cache.
    """
    attn = block.attn
    q_pos, k_pos = cache.query_positions(1), cache.key_positions(1)  # (1,), (S,) inside the cache
    mask = materialize_at(attention_sink(cache.n_sink, cache.window), q_pos, k_pos)  # (1, S)
    q, k, v = attn.project_qkv(block.norm1(x))  # (B, H, 1, D), (B, Hkv, 1, D), (B, Hkv, 1, D): not rotated
    keys, values = cache.update(k, v)  # (B, Hkv, S, D): views of the ring buffer, unrotated
    q = apply_rope(q, q_pos.to(q.device), inv_freq=attn.inv_freq) * attn.rope_factor  # (B, H, 1, D)
    keys = apply_rope(keys, k_pos.to(q.device), inv_freq=attn.inv_freq) * attn.rope_factor  # re-rotated copy
    keys, values = repeat_kv(keys, attn.n_rep), repeat_kv(values, attn.n_rep)  # (B, H, S, D)
    scores = (q @ keys.transpose(-2, -1)) * attn.head_dim ** -0.5  # (B, H, 1, S)
    out = safe_softmax(scores.masked_fill(~mask.to(q.device), float("-inf"))) @ values  # (B, H, 1, D)
    x = x + attn.o_proj(merge_heads(out))  # (B, 1, d)
    return x + block.ff(block.norm2(x))


@torch.no_grad()
def stream_decode_logits(model: GPT, tokens: torch.Tensor, window: int, n_sink: int, *, reindex: bool = True
                         ) -> torch.Tensor:
    """The same logits (B, T, V), one token at a time through :func:`streaming_caches` (slow; the reference).

    A RoPE model with `reindex` decodes as StreamingLLM does: its caches hold keys **before** rotation and
    every step rotates them by their position inside the cache (:func:`_rope_decode_block`); otherwise the
    model's own cached forward runs (keys rotated once, at their stream positions)."""
    _validate.tensor("tokens", tokens, min_rank=2)
    caches = streaming_caches(model, tokens.shape[0], window, n_sink, reindex=reindex)
    if model.config.position == "rope" and reindex:
        if not model.blocks[0].norm_first:
            raise ValueError("stream_decode_logits re-rotates RoPE keys for the GPT's pre-norm blocks only")
        out = []
        for i in range(tokens.shape[1]):
            x = model.embed(tokens[:, i:i + 1], torch.tensor([i], device=tokens.device))  # (B, 1, d)
            for block, cache in zip(model.blocks, caches):
                x = _rope_decode_block(block, x, cache)
            out.append(model.head(model.norm(x)))  # (B, 1, V)
        return torch.cat(out, dim=1)
    return torch.cat([model(tokens[:, i:i + 1], caches) for i in range(tokens.shape[1])], dim=1)


@torch.no_grad()
def recompute_logits(model: GPT, tokens: torch.Tensor, window: int, bos: int | None = None) -> torch.Tensor:
    """Next-token logits (B, T - window + 1, V): each from a fresh forward over the last `window` tokens
    (after a `bos` token if given), StreamingLLM's "sliding window with re-computation" baseline.
    Row r predicts the token after position r + window - 1."""
    b, t = tokens.shape
    views = tokens.unfold(1, window, 1).reshape(-1, window)  # (B * (T - window + 1), window)
    if bos is not None:
        views = with_bos(views, bos)
    return model(views)[:, -1].reshape(b, t - window + 1, -1)  # (B, T - window + 1, V)


def next_token_nll(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T - 1) per-position loss (nats) of logits (B, T, V) predicting tokens[:, 1:]."""
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, v), tokens[:, 1:].reshape(-1),
                           reduction="none").view(tokens.shape[0], -1)


@torch.no_grad()
def first_token_attention(model: GPT, tokens: torch.Tensor, start: int = 1) -> torch.Tensor:
    """(n_layers, H): mean attention weight that queries ``start ..`` put on key 0, per layer and head."""
    t = tokens.shape[1]
    pos = torch.arange(t)
    x = model.embed(tokens, pos)
    mask, out = model.attn_mask(pos, pos), []
    for block in model.blocks:
        x, w = block(x, attn_mask=mask, return_weights=True)  # w: (B, H, T, T)
        out.append(w[:, :, start:, 0].mean(dim=(0, 2)))  # (H,)
    return torch.stack(out)


def full_run() -> bool:
    """True when the environment asks for the long version of the lessons' experiments (``FULL=1``)."""
    return os.environ.get("FULL", "0") not in ("", "0")


@dataclass
class SinkResult:
    """Mean next-token loss (nats) over the stream, per seed, for each cache policy (see :func:`sink_losses`)."""

    losses: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.losses.setdefault(name, []).append(float(value))

    def summary(self) -> dict[str, tuple[float, float, float]]:
        """{policy: (mean, min, max) over seeds}."""
        return {k: (sum(v) / len(v), min(v), max(v)) for k, v in self.losses.items()}


@torch.no_grad()
def sink_losses(model: GPT, stream: torch.Tensor, cache: int, n_sink: int, bos: int, start: int
                ) -> dict[str, float]:
    """Mean next-token loss on `stream` (1-D tokens, a BOS is put in front) from position `start` on, for:

    * ``"full cache"``: full causal attention over the whole stream (the cache grows);
    * ``"window"``: a cache of `cache` keys that evicts the oldest, BOS included;
    * ``"sinks + window"``: the first `n_sink` tokens (BOS first) plus the last ``cache - n_sink``;
    * ``"sinks, absolute positions"``: the same cache without re-indexing (distances keep growing);
    * ``"recompute window"``: a fresh forward over BOS + the last ``cache - 1`` tokens for every token.
    """
    seq = with_bos(stream[None], bos)  # (1, T + 1)
    out = {"full cache": next_token_nll(model(seq), seq)}
    out["window"] = next_token_nll(streaming_logits(model, seq, cache, 0), seq)
    out["sinks + window"] = next_token_nll(streaming_logits(model, seq, cache - n_sink, n_sink), seq)
    out["sinks, absolute positions"] = next_token_nll(
        streaming_logits(model, seq, cache - n_sink, n_sink, reindex=False), seq)
    w = cache - 1
    rec = recompute_logits(model, stream[None, :-1], w, bos=bos)[0]  # (N - w, V): row r predicts stream[r + w]
    recomputed = torch.full((1, len(stream)), float("nan"))
    recomputed[0, w:] = F.cross_entropy(rec, stream[w:], reduction="none")  # aligned with the others
    out["recompute window"] = recomputed
    return {k: float(v[0, start:].nanmean()) for k, v in out.items()}


@torch.no_grad()
def windowed_accuracy(model: GPT, series: torch.Tensor, start: int, context: int, bos: int | None = None,
                      batch_size: int = 256) -> float:
    """Greedy next-token accuracy on a 1-D token `series` from position `start` on, each token predicted from
    the `context` tokens before it (after a `bos` token if given, as in training)."""
    _validate.tensor("series", series)
    if series.dim() != 1 or series.is_floating_point():
        raise ValueError(f"series must be a 1-D integer tensor, got shape {tuple(series.shape)}, dtype {series.dtype}")
    _validate.positive_int("context", context)
    if not context <= start < len(series):
        raise ValueError(f"need context <= start < len(series), got context={context}, start={start}, "
                         f"series {tuple(series.shape)}")
    windows = series.unfold(0, context + 1, 1)[start - context:]  # (N, context + 1): row n ends at start + n
    hits = 0
    for chunk in windows.split(batch_size):
        inputs = chunk[:, :-1] if bos is None else with_bos(chunk[:, :-1], bos)  # (b, context [+ 1])
        hits += int((model(inputs)[:, -1].argmax(-1) == chunk[:, -1]).sum())
    return hits / len(windows)


@torch.no_grad()
def greedy_decode(model: GPT, prompt: torch.Tensor, n_new: int, caches: list) -> tuple[torch.Tensor, list[int]]:
    """Greedy continuation of `prompt` (B, T0) by `n_new` tokens through the given caches (one per layer):
    returns the new tokens (B, n_new) and the first cache's length after each step."""
    _validate.positive_int("n_new", n_new)
    logits, out, sizes = model(prompt, caches), [], []
    for _ in range(n_new):
        nxt = logits[:, -1:].argmax(-1)  # (B, 1)
        out.append(nxt)
        sizes.append(len(caches[0]))
        logits = model(nxt, caches)  # (B, 1, V)
    return torch.cat(out, dim=1), sizes
