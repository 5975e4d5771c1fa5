r"""KIVI's point about layout, measured: quantise cached keys **per channel** and values **per token**, because keys
have outlier channels and values do not (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache", section 3, Figure 2).

:func:`fake_quantize` is KIVI's asymmetric quantiser: each group of numbers (along `dim`) is mapped to the
:math:`2^b` levels between its own minimum and maximum, :math:`\hat x = \mathrm{round}((x - m) / s)\, s + m` with
:math:`s = (M - m) / (2^b - 1)`. Along the tokens (``dim=-2``: one scale and zero point per channel) it is KIVI's key
layout; along the channels (``dim=-1``: one per token) its value layout. A key's outlier channel is large in every
token, so a per-token scale is set by that one channel and the step :math:`s` swallows every other channel of the
token; per channel, the outlier only sets its own channel's step.

:func:`quantized_eval` runs the KIVI cache on a model: the prompt is prefilled in full precision, its keys and
values are then quantised (keys along `key_axis`, values per token) and the continuation is decoded from that cache,
its own new keys and values kept in full precision (KIVI's full-precision residual of the newest tokens). An optional
`key_offset` is added to every key before it is cached: outlier channels planted in a model that has none.
"""

from __future__ import annotations

import torch

from . import _validate

__all__ = ["fake_quantize", "quantized_eval"]


def fake_quantize(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """`x` rounded to `bits`-bit asymmetric levels, one (scale, minimum) per slice along `dim`, returned dequantised
    (same shape and dtype). A constant slice comes back exactly. Raises TypeError for a non-float tensor and
    ValueError for bits outside 1..16."""
    _validate.tensor("x", x, min_rank=1, floating=True)
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16:
        raise ValueError(f"bits must be an int in 1..16, got {bits!r}")
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    step = ((hi - lo) / (2 ** bits - 1)).clamp_min(torch.finfo(x.dtype).tiny)
    return torch.clamp(torch.round((x - lo) / step), 0, 2 ** bits - 1) * step + lo


def quantized_eval(model, tokens: torch.Tensor, prompt_len: int, *, bits: int, key_axis: str = "channel",
                   key_offset: torch.Tensor | None = None) -> dict:
    """Next-token accuracy of the decode steps (queries at prompt_len .. T-2, teacher-forced) reading a prompt cache
    quantised to `bits` bits: keys per channel (``key_axis="channel"``, KIVI) or per token (``"token"``), values per
    token; the continuation's keys and values stay in full precision.

    model: an :class:`~attncourse.heads.AttnOnlyTransformer`. tokens: (B, T) ids. key_offset: None or a tensor
    broadcastable to (B, T, Hkv, D) added to every layer's keys (in the prefill too). Returns ``{"accuracy",
    "per_step", "bytes"}``: bytes of the prompt's quantised K and V per sequence (`bits` per number plus float16
    scales and minima)."""
    if key_axis not in ("channel", "token"):
        raise ValueError(f"key_axis must be 'channel' or 'token', got {key_axis!r}")
    _validate.tensor("tokens", tokens, min_rank=2)
    b, t = tokens.shape
    if not 1 <= prompt_len < t - 1:
        raise ValueError(f"prompt_len must leave a continuation: 1 <= prompt_len < T - 1 = {t - 1}, got {prompt_len}")
    fake_quantize(torch.zeros(1), bits, 0)  # validates bits
    if key_offset is not None:
        _validate.tensor("key_offset", key_offset, min_rank=4, floating=True)
    layers = model.attns
    h, d = layers[0].n_kv_heads, layers[0].head_dim
    cached, hooks = {}, []

    def keys(module, args, out, layer):
        x = out.view(b, -1, h, d)  # (B, T, Hkv, D)
        if key_offset is not None:
            x = x + key_offset[:, :x.shape[1]]  # its T axis may be 1 (one offset for every token)
        return store(x, ("k", layer), -3 if key_axis == "channel" else -1)

    def values(module, args, out, layer):
        return store(out.view(b, -1, h, d), ("v", layer), -1)

    def store(x, key, dim):  # prefill: remember the prompt's K or V; decode: read them back quantised
        if x.shape[1] == prompt_len:
            cached[key] = fake_quantize(x, bits, dim)
            return x.reshape(b, prompt_len, h * d)
        x = torch.cat([cached[key], x[:, prompt_len:]], 1)  # (B, T, Hkv, D): quantised prompt, exact residual
        return x.reshape(b, -1, h * d)

    with torch.no_grad():
        try:
            for i, a in enumerate(layers):
                hooks.append(a.k_proj.register_forward_hook(lambda m_, a_, o, i=i: keys(m_, a_, o, i)))
                hooks.append(a.v_proj.register_forward_hook(lambda m_, a_, o, i=i: values(m_, a_, o, i)))
            model(tokens[:, :prompt_len])  # the prefill, in full precision; fills `cached`
            logits = model(tokens)  # (B, T, V): the continuation reads the quantised prompt cache
        finally:
            for hook in hooks:
                hook.remove()
    hits = (logits[:, prompt_len:-1].argmax(-1) == tokens[:, prompt_len + 1:]).double()  # (B, decode steps)
    scales = (d if key_axis == "channel" else prompt_len) + prompt_len  # key groups + value groups, per head
    n_bytes = len(layers) * h * (2 * prompt_len * d * bits / 8 + scales * 2 * 2)  # + fp16 scale and minimum
    return {"accuracy": hits.mean().item(), "per_step": hits.mean(0).tolist(), "bytes": n_bytes}
