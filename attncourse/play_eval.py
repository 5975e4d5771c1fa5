r"""KV-cache policies run on the text model of :mod:`attncourse.play_lm`: what chapter 11's eviction, sink and
quantisation ideas cost in next-character loss on held-out *Coriolanus*.

Each function runs the model's layers itself (the same weights, attention computed here in float32), so a cache
policy is a mask, a position rule or a rounding on the keys and values a query reads:

* :func:`streaming_forward` is a rolling cache on a stream: each query reads the newest `window` keys, and with
  ``n_sink > 0`` also the first `n_sink` tokens (StreamingLLM, Xiao et al. 2024, section 3.2). With ``reindex=True``
  the positions are the cache's, as StreamingLLM assigns them: a window key keeps its true distance to the query
  (RoPE sees only distances), and a sink at slot j of a full cache of ``n_sink + window`` slots sits
  ``n_sink + window - 1 - j`` positions back instead of ``t - j``. ``heads`` makes some heads stream and the rest
  read everything (DuoAttention's split, Xiao et al. 2025). ``tests/test_play_eval.py`` checks it against a real
  token-by-token decode that evicts and re-rotates.
* :func:`recompute_losses` is StreamingLLM's "sliding window with re-computation" baseline: every character is
  predicted by a fresh forward over the `window` characters before it.
* :func:`compressed_forward` compresses a prompt's cache once after the prefill (the setting of SnapKV, Li et al.
  2024): keep `budget` of its keys per layer and head by recency, H2O's accumulated attention or SnapKV's
  observation-window vote, or keep them all but rounded to `bits` bits (KIVI, Liu et al. 2024: keys per channel in
  groups of `group` tokens, values per token). The continuation's own keys are kept in full, as these papers do.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _validate
from .kv_compress import h2o_keep, snapkv_keep
from .kv_quant import fake_quantize
from .mha import merge_heads
from .positions import apply_rope

__all__ = ["compressed_forward", "losses", "recompute_losses", "sink_mass", "streaming_forward"]
METHODS = ("full", "window", "h2o", "snapkv", "kivi")


def _tokens(tokens: torch.Tensor) -> int:
    _validate.tensor("tokens", tokens, min_rank=2)
    if tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError(f"tokens must be integer ids (B, T), got shape {tuple(tokens.shape)}, dtype {tokens.dtype}")
    return tokens.shape[1]


def _qkv(block, x: torch.Tensor, pos: torch.Tensor):
    """Queries, keys and values (B, H, T, D) of `block` on x (B, T, d); q, k rotated at `pos`, plus q unrotated."""
    q, k, v = block.attn.project_qkv(block.norm1(x))  # (B, H, T, D) each
    inv = block.attn.inv_freq
    return apply_rope(q, pos, inv_freq=inv), apply_rope(k, pos, inv_freq=inv), v, q


def _finish(block, x: torch.Tensor, weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The block's output for attention `weights` (B, H, T, S) over values `v` (B, H, S, D)."""
    out = (weights @ v.float()).to(x.dtype)  # (B, H, T, S) @ (B, H, S, D) -> (B, H, T, D)
    x = x + block.attn.o_proj(merge_heads(out))  # (B, T, d)
    return x + block.ff(block.norm2(x))


def _softmax(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)


@torch.no_grad()
def streaming_forward(model, tokens: torch.Tensor, n_sink: int = 0, window: int | None = None, *,
                      reindex: bool = True, heads: torch.Tensor | None = None, return_weights: bool = False):
    """Logits (B, T, V) of `model` on `tokens` (B, T) when each query reads a rolling cache: its `window` newest keys
    (itself included) and the first `n_sink` keys; ``window=None`` reads every earlier key (dense). ``reindex``: the
    sinks' positions are the cache slots (StreamingLLM), else their true positions. ``heads``: bool (n_layers, H),
    True where a head reads the rolling cache, False where it reads everything (default: every head rolls). With
    `return_weights`, also the attention weights of each layer, (B, H, T, T) each."""
    t = _tokens(tokens)
    blocks = model.blocks
    n_heads = blocks[0].attn.n_heads
    if window is None:
        if n_sink:
            raise ValueError(f"n_sink={n_sink} needs a window; got window=None (dense)")
        window = t
    _validate.positive_int("window", window)
    if not isinstance(n_sink, int) or n_sink < 0:
        raise ValueError(f"n_sink must be an int >= 0, got {n_sink!r}")
    if heads is None:
        heads = torch.ones(len(blocks), n_heads, dtype=torch.bool)
    if heads.shape != (len(blocks), n_heads) or heads.dtype != torch.bool:
        raise ValueError(f"heads must be bool (n_layers, H) = ({len(blocks)}, {n_heads}), got "
                         f"{tuple(heads.shape)} {heads.dtype}")
    pos = torch.arange(t, device=tokens.device)
    i, j = pos[:, None], pos[None, :]
    causal = j <= i  # (T, T)
    rolling = causal & ((j > i - window) | (j < n_sink))  # (T, T)
    x, maps = model.tok(tokens), []
    for layer, block in enumerate(blocks):
        q, k, v, q_raw = _qkv(block, x, pos)
        scale = 1 / math.sqrt(q.shape[-1])
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, H, T, T)
        if reindex and n_sink:  # a full cache's newest slot is n_sink + window - 1
            q_cache = apply_rope(q_raw, pos.clamp(max=n_sink + window - 1), inv_freq=block.attn.inv_freq)
            sink = (q_cache.float() @ k[..., :n_sink, :].float().transpose(-1, -2)) * scale  # (B, H, T, n_sink)
            roll = heads[layer][:, None, None]  # (H, 1, 1)
            scores[..., :n_sink] = torch.where(roll, sink, scores[..., :n_sink])
        keep = torch.where(heads[layer][:, None, None], rolling, causal)  # (H, T, T)
        w = _softmax(scores, keep)
        maps.append(w)
        x = _finish(block, x, w, v)
    logits = model.head(model.norm(x))
    return (logits, maps) if return_weights else logits


def losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (B, T - 1) in nats: logits at t against tokens at t + 1."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(),
                           reduction="none").view(tokens.shape[0], -1)


@torch.no_grad()
def recompute_losses(model, stream: torch.Tensor, window: int, batch_size: int = 64, every: int = 1) -> torch.Tensor:
    """Per-character loss (T - 1,) on a 1-D `stream` when character t + 1 is predicted by a fresh forward over
    characters ``max(0, t - window + 1) .. t`` (no cache kept between characters). Past the first window only every
    `every`-th prediction is made (NaN elsewhere): each costs a whole forward."""
    _validate.positive_int("window", window)
    _validate.positive_int("every", every)
    if stream.dim() != 1 or stream.is_floating_point() or len(stream) <= window:
        raise ValueError(f"stream must be 1-D ids longer than window={window}, got shape {tuple(stream.shape)}")
    out = torch.full((len(stream) - 1,), float("nan"))
    out[:window - 1] = losses(model(stream[None, :window]), stream[None, :window])[0]  # the first window - 1
    rows = stream.unfold(0, window + 1, 1)  # (T - window, window + 1): a window and the character after it
    idx = torch.arange(0, len(rows), every)
    for chunk in idx.split(batch_size):
        logits = model(rows[chunk, :-1])[:, -1]  # (b, V): the last character's prediction
        out[chunk + window - 1] = F.cross_entropy(logits.float(), rows[chunk, -1], reduction="none")
    return out


@torch.no_grad()
def sink_mass(model, tokens: torch.Tensor, start: int = 32) -> torch.Tensor:
    """(n_layers, H): the mean attention weight each head gives key 0, over queries ``start .. T - 1``."""
    t = _tokens(tokens)
    if not 1 <= start < t:
        raise ValueError(f"start must be in 1..T-1 = {t - 1}, got {start}")
    _, maps = streaming_forward(model, tokens, return_weights=True)
    return torch.stack([w[..., start:, 0].mean((0, 2)) for w in maps])


def _prompt_keep(method: str, w: torch.Tensor, budget: int, recent: int, sinks: int, kernel: int) -> torch.Tensor:
    """bool (B, H, P): the prompt keys a method keeps, from the prefill's maps w (B, H, P, P)."""
    p = w.shape[-1]
    if method == "window":
        keep = torch.zeros(w.shape[:-1], dtype=torch.bool, device=w.device)
        keep[..., p - budget + sinks:] = True
        keep[..., :sinks] = True
        return keep
    if method == "h2o":
        return h2o_keep(w, budget, recent, sinks)
    return snapkv_keep(w, budget, recent, kernel, pool="avg", sinks=sinks)


@torch.no_grad()
def compressed_forward(model, tokens: torch.Tensor, prompt_len: int, method: str = "full", *, budget: int = 0,
                       recent: int = 8, sinks: int = 0, kernel: int = 5, bits: int = 4, group: int = 32,
                       key_axis: str = "channel") -> torch.Tensor:
    """Logits (B, T, V) when the prompt ``tokens[:, :prompt_len]`` is prefilled in full and its cache is then
    compressed once; the queries at prompt_len .. T - 1 read the compressed prompt and every continuation key.

    method: "full" (nothing dropped), "window" (the `budget` newest prompt keys, the first `sinks` among them),
    "h2o" (the `recent` newest and the heaviest by attention summed over all prompt queries), "snapkv" (the `recent`
    newest and the best by the last `recent` queries' vote, average-pooled over `kernel` keys, as the reference
    code), or "kivi" (every prompt key kept, rounded to `bits` bits: keys ``key_axis="channel"`` per channel in
    groups of `group` tokens, or ``"token"`` per token; values per token)."""
    t = _tokens(tokens)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not 1 <= prompt_len < t:
        raise ValueError(f"prompt_len must be in 1..T-1 = {t - 1}, got {prompt_len}")
    if method in ("window", "h2o", "snapkv") and not 1 <= budget <= prompt_len:
        raise ValueError(f"budget must be in 1..prompt_len={prompt_len} for {method}, got {budget}")
    if key_axis not in ("channel", "token"):
        raise ValueError(f"key_axis must be 'channel' or 'token', got {key_axis!r}")
    _validate.positive_int("group", group)
    pos = torch.arange(t, device=tokens.device)
    causal = pos[None, :] <= pos[:, None]  # (T, T)
    x = model.tok(tokens)
    for block in model.blocks:
        q, k, v, _ = _qkv(block, x, pos)
        scale = 1 / math.sqrt(q.shape[-1])
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, H, T, T)
        w = _softmax(scores, causal)  # the prefill's rows (< prompt_len) are final
        if method == "kivi":
            kq, vq = k.clone(), v.clone()
            keys = k[..., :prompt_len, :]  # (B, H, P, D)
            if key_axis == "channel":
                kq[..., :prompt_len, :] = torch.cat([fake_quantize(c, bits, -2) for c in keys.split(group, -2)], -2)
            else:
                kq[..., :prompt_len, :] = fake_quantize(keys, bits, -1)
            vq[..., :prompt_len, :] = fake_quantize(v[..., :prompt_len, :], bits, -1)
            late = _softmax((q.float() @ kq.float().transpose(-1, -2)) * scale, causal)  # (B, H, T, T)
            out_late = (late[..., prompt_len:, :] @ vq.float())  # (B, H, T - P, D)
            out = torch.cat([w[..., :prompt_len, :] @ v.float(), out_late], -2).to(x.dtype)
            x = x + block.attn.o_proj(merge_heads(out))
            x = x + block.ff(block.norm2(x))
            continue
        if method != "full":
            keep_p = _prompt_keep(method, w[..., :prompt_len, :prompt_len], budget, recent, sinks, kernel)
            keep = causal.expand(*w.shape).clone()  # (B, H, T, T)
            keep[..., prompt_len:, :prompt_len] = keep_p[..., None, :]
            w = _softmax(scores, keep)
        x = _finish(block, x, w, v)
    return model.head(model.norm(x))
