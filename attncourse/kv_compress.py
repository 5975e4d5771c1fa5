r"""KV-cache compression beyond sinks: a quantised cache (KIVI's layout, in int8) and two ways to evict prompt keys,
H2O's heavy hitters and SnapKV's observation-window vote, measured on a model whose needs are known.

* **Quantisation** (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", section 3):
  keys have outlier *channels*, values do not, so KIVI quantises keys **per channel** (one scale per head dimension,
  over the tokens) and values **per token** (one scale per token, over its dimensions). KIVI goes to 2 bits with
  zero points and keeps the newest tokens in full precision; :func:`quantize_kv` uses the same layout in symmetric
  int8 (scale = absmax / 127, no zero point), so each stored element is one byte plus the scales.
* **H2O** (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
  Models", section 3): keep the most recent keys and the "heavy hitters", the keys with the largest attention
  accumulated over the queries so far. :func:`h2o_keep` applies it once, to the prompt.
* **SnapKV** (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", section 4): the last
  `window` queries of the prompt (the observation window) vote with their attention for the earlier keys; the votes
  are pooled along the keys (so a kept key brings its neighbours) and the top ones are kept with the window. The
  reference code (FasterDecoding/SnapKV, ``snapkv_utils.py``) defaults to average pooling with kernel 5
  (``pool="avg", kernel=5`` here) over the earlier keys' votes only (``pool_window=False`` here; by default the
  window's own keys' votes are pooled too, which moves the keys next to the window); this course's default,
  max-pooling with kernel 7, is our choice.

:func:`compressed_eval` runs an :class:`~attncourse.heads.AttnOnlyTransformer` on prompts followed by teacher-forced
continuations, with every layer's prompt keys compressed as a server would compress them once the prefill is done,
and reports next-token accuracy on the continuation and the bytes the compressed cache holds.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _validate

__all__ = ["quantize_kv", "dequantize", "h2o_keep", "snapkv_keep", "compressed_eval", "retrieval_batch"]


def _int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.clamp(torch.round(x / scale), -127, 127).to(torch.int8), scale


def quantize_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                           tuple[torch.Tensor, torch.Tensor]]:
    """KIVI's layout in symmetric int8: keys per channel, values per token.

    k, v: (..., T, D) float. Returns ``((k_int8, k_scale), (v_int8, v_scale))`` with k_scale (..., 1, D) (one scale
    per channel, over the T tokens) and v_scale (..., T, 1) (one per token, over its D dimensions); the stored value
    is ``int8 * scale``. Raises TypeError for non-float tensors, ValueError for mismatched shapes."""
    _validate.tensor("k", k, min_rank=2, floating=True)
    _validate.tensor("v", v, min_rank=2, floating=True)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must share (..., T), got k {tuple(k.shape)}, v {tuple(v.shape)}")
    return _int8(k, -2), _int8(v, -1)


def _fp8(x: torch.Tensor) -> torch.Tensor:
    """`x` stored as float8 e4m3 with one scale for the whole tensor (its largest magnitude maps to 448, the format's
    largest), returned dequantised: vLLM's ``kv_cache_dtype="fp8_e4m3"`` keeps one such scale for the keys and one for
    the values of each layer."""
    scale = x.abs().amax().clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 values times their scales, in `dtype`."""
    return q.to(dtype) * scale.to(dtype)


def _check_maps(weights: torch.Tensor, budget: int, window: int, sinks: int = 0) -> int:
    _validate.tensor("weights", weights, min_rank=2, floating=True)
    t = weights.shape[-1]
    if weights.shape[-2] != t:
        raise ValueError(f"weights must be the prompt's causal maps (..., T, T), got {tuple(weights.shape)}")
    _validate.positive_int("budget", budget)
    _validate.positive_int("window", window)
    if window > budget:
        raise ValueError(f"window={window} must be at most budget={budget}")
    _check_sinks(sinks, budget - window)
    return t


def _check_sinks(sinks: int, room: int) -> None:
    if not isinstance(sinks, int) or isinstance(sinks, bool) or not 0 <= sinks <= room:
        raise ValueError(f"sinks must be an int in 0..{room} (the budget left beside the window), got {sinks!r}")


def _keep_top(scores: torch.Tensor, window: int, budget: int, sinks: int = 0) -> torch.Tensor:
    """bool (..., T): the first `sinks` keys and the last `window` keys, then the best-scoring others up to
    `budget` keys in all."""
    t = scores.shape[-1]
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if budget >= t:
        return ~keep
    keep[..., t - window:] = True
    scores = scores[..., :t - window].clone()
    scores[..., :sinks] = float("inf")  # the sink tokens win every vote, so they are among the top
    top = scores.topk(budget - window, dim=-1).indices
    return keep.scatter(-1, top, True)


def h2o_keep(weights: torch.Tensor, budget: int, recent: int, sinks: int = 0) -> torch.Tensor:
    """H2O on a prompt: keep the `recent` newest keys and the heavy hitters, the earlier keys with the most attention
    accumulated over all the prompt's queries, `budget` keys per head in all; with ``sinks > 0`` the first `sinks`
    keys are kept whatever their score (StreamingLLM's sink tokens), inside the same budget.

    weights: (..., T, T) the prompt's causal attention maps. Returns bool (..., T), True = kept. Raises ValueError
    for maps that are not square, a budget below the window or more sinks than the budget leaves."""
    _check_maps(weights, budget, recent, sinks)
    return _keep_top(weights.sum(-2), recent, budget, sinks)


def snapkv_keep(weights: torch.Tensor, budget: int, window: int, kernel: int = 7, *, pool: str = "max",
                sinks: int = 0, pool_window: bool = True) -> torch.Tensor:
    """SnapKV on a prompt: the last `window` queries vote (their attention summed over the window), the votes are
    pooled along the keys with an odd `kernel`, and the `budget - window` best earlier keys are kept with the
    window's own keys.

    weights: (..., T, T) the prompt's causal attention maps. budget, window: keys kept per head, and how many of them
    are the observation window. kernel: odd pooling width. pool: ``"max"`` (this course's default) or ``"avg"``
    (the reference code's default, with zero padding counted, as ``F.avg_pool1d`` does). sinks: the first `sinks`
    keys are kept whatever the vote, inside the budget. pool_window: pool the votes along all T keys (this course's
    convention), or, when False, along the T - window earlier keys only, zero beyond both ends (the reference
    code's). Returns bool (..., T), True = kept. Raises ValueError for an even kernel, an unknown pool, a budget
    below the window or more sinks than the budget leaves."""
    t = _check_maps(weights, budget, window, sinks)
    _validate.positive_int("kernel", kernel)
    if kernel % 2 == 0:
        raise ValueError(f"kernel must be odd, got {kernel}")
    if pool not in ("max", "avg"):
        raise ValueError(f"pool must be 'max' or 'avg', got {pool!r}")
    if budget >= t:
        return torch.ones(weights.shape[:-1], dtype=torch.bool, device=weights.device)
    votes = weights[..., t - window:, :].sum(-2)  # (..., T)
    n = t if pool_window else t - window  # the keys pooled: all, or the earlier ones only
    lead = votes.shape[:-1]
    pooler = F.max_pool1d if pool == "max" else F.avg_pool1d
    pooled = pooler(votes[..., :n].reshape(-1, 1, n), kernel, stride=1, padding=kernel // 2).reshape(*lead, n)
    return _keep_top(F.pad(pooled, (0, t - n)), window, budget, sinks)  # the window is kept whatever it scores


def retrieval_batch(generator: torch.Generator, batch: int, seg_len: int, vocab: int, question: int, answer: int
                    ) -> tuple[torch.Tensor, int]:
    """Prompts "segment, then `question` tokens copied from a random place in it", continued by the `answer` tokens
    that follow that place in the segment. Returns (tokens (batch, seg_len + question + answer), prompt length)."""
    for name, x in (("batch", batch), ("seg_len", seg_len), ("vocab", vocab), ("question", question),
                    ("answer", answer)):
        _validate.positive_int(name, x)
    if question + answer > seg_len:
        raise ValueError(f"question + answer = {question + answer} must fit in seg_len={seg_len}")
    seg = torch.stack([torch.randperm(vocab, generator=generator)[:seg_len] for _ in range(batch)])  # distinct
    start = torch.randint(0, seg_len - question - answer + 1, (batch, 1), generator=generator)
    span = torch.gather(seg, 1, start + torch.arange(question + answer))  # (batch, question + answer)
    return torch.cat([seg, span], 1), seg_len + question


def compressed_eval(model, tokens: torch.Tensor, prompt_len: int, method: str = "full", *, budget: int | None = None,
                    window: int = 4, kernel: int = 7, pool: str = "max", sinks: int = 0) -> dict:
    """Next-token accuracy of the decode steps (queries at positions prompt_len .. T-2, each predicting the next
    token; the first continuation token comes from the prefill, which saw the whole prompt) with every
    layer's prompt keys and values compressed by `method`, and the cache's bytes for the prompt.

    `method`: "full" (no compression), "int8" (:func:`quantize_kv` on every key and value, prompt and continuation),
    "fp8" (float8 e4m3 with one scale per layer for the keys and one for the values, as vLLM's fp8 KV cache),
    "recent" (the last `budget` prompt keys), "h2o" (:func:`h2o_keep`, `window` recent keys) or "snapkv"
    (:func:`snapkv_keep`, with `kernel` and `pool`; ``kernel=5, pool="avg"`` is the reference code's); `sinks`:
    the first `sinks` prompt keys are kept by "recent", "h2o" and "snapkv" whatever their score, inside the budget
    (StreamingLLM's sink tokens; "recent" then keeps the `budget - sinks` newest). Kept keys keep the positions they
    were computed at (this model adds learned absolute positions before every layer, so a key cannot be re-indexed
    after the fact; H2O and SnapKV keep original positions too, StreamingLLM re-indexes, chapter 07). The
    continuation is teacher-forced (every decode query is fed the true previous token; for the model's own tokens fed
    back, wrap this in :func:`attncourse.kv_evict.free_running`). Evicted keys are hidden from the continuation's queries only (the prompt was prefilled
    with all of them), as when a server compresses after the prefill. Bytes: keys and values of the prompt per layer
    and KV head, float16 for kept keys (int8 plus float16 scales for "int8"). Returns ``{"accuracy", "per_step"
    (the accuracy of each decode step, over the batch), "bytes", "full_bytes", "logits" (B, T, V)}``."""
    methods = ("full", "int8", "fp8", "recent", "h2o", "snapkv")
    if method not in methods:
        raise ValueError(f"method must be one of {methods}, got {method!r}")
    _validate.tensor("tokens", tokens, min_rank=2)
    b, t = tokens.shape
    if not 1 <= prompt_len < t - 1:
        raise ValueError(f"prompt_len must leave a continuation: 1 <= prompt_len < T - 1 = {t - 1}, got {prompt_len}")
    if method in ("recent", "h2o", "snapkv") and (budget is None or not 1 <= budget):
        raise ValueError(f"method {method!r} needs a budget >= 1, got {budget!r}")
    if sinks:
        if method not in ("recent", "h2o", "snapkv"):
            raise ValueError(f"sinks={sinks} needs an eviction method ('recent', 'h2o', 'snapkv'), got {method!r}")
        _check_sinks(sinks, min(budget, prompt_len) - (0 if method == "recent" else min(window, budget, prompt_len)))
    layers, hooks = model.attns, []
    h, d = layers[0].n_kv_heads, layers[0].head_dim
    full_bytes = len(layers) * h * prompt_len * 2 * d * 2  # K and V, float16
    with torch.no_grad():
        _, maps = model(tokens[:, :prompt_len], return_weights=True)  # the prefill's own maps, (B, H, P, P) each
        masks = []
        for m in maps:
            if method == "h2o":
                keep = h2o_keep(m, min(budget, prompt_len), min(window, budget, prompt_len), sinks)
            elif method == "snapkv":
                keep = snapkv_keep(m, min(budget, prompt_len), min(window, budget, prompt_len), kernel, pool=pool,
                                   sinks=sinks)
            elif method == "recent":
                keep = torch.zeros(m.shape[:-1], dtype=torch.bool)
                keep[..., max(0, prompt_len - budget + sinks):] = True
                keep[..., :sinks] = True
            else:
                keep = torch.ones(m.shape[:-1], dtype=torch.bool)
            allowed = torch.ones(b, m.shape[1], t, t, dtype=torch.bool).tril()
            allowed[:, :, prompt_len:, :prompt_len] &= keep[:, :, None, :]  # the continuation sees kept keys only
            masks.append(allowed)
        kept = sum(int(mask[:, :, -1, :prompt_len].sum()) for mask in masks) / b  # per sequence, all layers, heads
        if method == "int8":
            def fake_quant(module, args, out, per_channel):
                x = out.view(b, t, h, d).transpose(1, 2)  # (B, Hkv, T, D)
                q, s = _int8(x, -2 if per_channel else -1)
                return dequantize(q, s, x.dtype).transpose(1, 2).reshape(b, t, h * d)
            for a in layers:
                hooks.append(a.k_proj.register_forward_hook(lambda m_, a_, o, f=fake_quant: f(m_, a_, o, True)))
                hooks.append(a.v_proj.register_forward_hook(lambda m_, a_, o, f=fake_quant: f(m_, a_, o, False)))
            byte_count = len(layers) * h * (prompt_len * 2 * d + (d + prompt_len) * 2)  # int8 + fp16 scales
        elif method == "fp8":
            for a in layers:
                hooks.append(a.k_proj.register_forward_hook(lambda m_, a_, o: _fp8(o)))  # (B, T, Hkv * D), one scale
                hooks.append(a.v_proj.register_forward_hook(lambda m_, a_, o: _fp8(o)))
            byte_count = len(layers) * (h * prompt_len * 2 * d + 2 * 4)  # one byte each + two float32 scales per layer
        else:
            byte_count = int(kept * 2 * d * 2)
        try:
            x = model.tok(tokens) + model.pos(torch.arange(t))
            for norm, attn, mask in zip(model.norms, layers, masks):
                x = x + attn(norm(x), attn_mask=mask)
            logits = model.head(model.norm(x))  # (B, T, V)
        finally:
            for hook in hooks:
                hook.remove()
    pred = logits[:, prompt_len:-1].argmax(-1)  # the tokens decoded from the compressed cache
    hits = (pred == tokens[:, prompt_len + 1:]).double()  # (B, decode steps)
    return {"accuracy": hits.mean().item(), "per_step": hits.mean(0).tolist(), "bytes": byte_count,
            "full_bytes": full_bytes, "logits": logits}
