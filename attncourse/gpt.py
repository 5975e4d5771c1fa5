r"""A tiny GPT: token embedding, optional position encoding, pre-norm Transformer blocks, a linear head.

One small causal language model for chapters 06 and 07. Its attention is
:class:`~attncourse.mha.MultiHeadAttention` (inside :class:`~attncourse.transformer.TransformerBlock`),
so MHA, GQA and MQA are one config field apart. Positions are one of

* ``"learned"``: a trained vector per absolute position, up to ``block_size`` (GPT-2);
* ``"sinusoidal"``: the fixed table of Vaswani et al., defined at any position;
* ``"alibi"``: no position vector at all; a per-head linear bias on the scores (Press et al.);
* ``"rope"``: no position vector; q and k rotated by position in every layer (Su et al.), base
  ``rope_base``, rescaled by ``rope_scaling`` (set it later with :meth:`GPT.set_rope_scaling` to extend
  a trained model's context);
* ``"none"``: nothing (NoPE): a causal model can still infer positions (Haviv et al. 2022).

The attention pattern is causal, or a sliding window (``window``), or sinks + window (``n_sink``). The
model builds every mask and bias itself from **absolute positions**, so a forward pass with KV caches
(one per layer, :mod:`attncourse.kv_cache`) gives the same logits as a forward over the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate
from .kv_cache import caches_for
from .masks import MaskMod, attention_sink, causal, materialize_at
from .positions import alibi_bias_at, alibi_slopes, sinusoidal_positions
from .transformer import TransformerBlock

POSITIONS = ("learned", "sinusoidal", "alibi", "none", "rope")


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 256  # longest sequence with learned positions; the others can run longer
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int | None = None  # None = MHA, 1 = MQA, in between = GQA
    n_layers: int = 2
    d_ff: int | None = None  # FFN width; None = 4 * d_model
    position: str = "learned"  # one of POSITIONS ("none": no position information at all)
    window: int | None = None  # sliding window: each query sees itself and window - 1 keys before
    n_sink: int = 0  # with a window: the first n_sink tokens stay visible to every query (StreamingLLM)
    rope_base: float = 10000.0  # with position="rope"
    rope_scaling: dict | None = None  # with position="rope": see positions.rope_inv_freq

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "d_model", "n_heads", "n_layers"):
            _validate.positive_int(name, getattr(self, name))
        if self.position not in POSITIONS:
            raise ValueError(f"position must be one of {POSITIONS}, got {self.position!r}")
        if self.window is not None:
            _validate.positive_int("window", self.window)
        if self.n_sink and self.window is None:
            raise ValueError(f"n_sink={self.n_sink} needs a window (sinks + window), got window=None")
        if self.rope_scaling is not None and self.position != "rope":
            raise ValueError(f"rope_scaling needs position='rope', got position={self.position!r}")
        if self.position == "rope" and (self.d_model // self.n_heads) % 2:
            raise ValueError(f"position='rope' needs an even head dim, got d_model={self.d_model}, "
                             f"n_heads={self.n_heads}")


class GPT(nn.Module):
    """tokens (B, T) -> next-token logits (B, T, vocab_size); see the module docstring."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = c = config
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.block_size, c.d_model) if c.position == "learned" else None
        self.blocks = nn.ModuleList(
            TransformerBlock(c.d_model, c.n_heads, c.d_ff, n_kv_heads=c.n_kv_heads, norm_first=True,
                             activation="gelu") for _ in range(c.n_layers))
        self.norm = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.register_buffer("slopes", alibi_slopes(c.n_heads), persistent=False)  # (H,), used by "alibi"
        if c.position == "rope":
            for block in self.blocks:
                block.attn.set_rope(c.rope_base, c.rope_scaling)

    def set_rope_scaling(self, scaling: dict | None) -> None:
        """Rescale RoPE in every layer (None: plain RoPE), e.g. ``{"type": "linear", "factor": 4}``."""
        if self.config.position != "rope":
            raise ValueError(f"set_rope_scaling needs position='rope', got {self.config.position!r}")
        for block in self.blocks:
            block.attn.set_rope(self.config.rope_base, scaling)
        self.config.rope_scaling = self.blocks[0].attn.rope_scaling

    @property
    def mask_mod(self) -> MaskMod:
        c = self.config
        return causal if c.window is None else attention_sink(c.n_sink, c.window)

    def attn_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bool (Tq, Tk) keep-mask, or with ALiBi a float (H, Tq, Tk) bias with -inf where blocked."""
        keep = materialize_at(self.mask_mod, q_pos, k_pos)  # (Tq, Tk)
        if self.config.position != "alibi":
            return keep
        bias = alibi_bias_at(self.slopes, q_pos, k_pos)  # (H, Tq, Tk): slope_h * (j - i)
        return bias.masked_fill(~keep, float("-inf"))

    def embed(self, tokens: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Token embeddings plus position vectors: (B, T) -> (B, T, d_model)."""
        c, x = self.config, self.tok(tokens)  # (B, T, d)
        if c.position == "learned":
            if int(q_pos[-1]) >= c.block_size:
                raise ValueError(f"learned positions stop at block_size={c.block_size}; got position "
                                 f"{int(q_pos[-1])} (tokens {tuple(tokens.shape)})")
            x = x + self.pos(q_pos)  # (B, T, d) + (T, d)
        elif c.position == "sinusoidal":
            x = x + sinusoidal_positions(int(q_pos[-1]) + 1, c.d_model)[q_pos].to(x)  # (T, d)
        return x

    def forward(self, tokens: torch.Tensor, caches: list | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V). With `caches` (one per layer), tokens continue the cached ones."""
        _validate.tensor("tokens", tokens, min_rank=2)
        if tokens.dim() != 2 or tokens.is_floating_point():
            raise ValueError(f"tokens must be integer ids (B, T), got shape {tuple(tokens.shape)}, "
                             f"dtype {tokens.dtype}")
        t = tokens.shape[1]
        if caches is None:
            q_pos = k_pos = torch.arange(t)  # (T,)
        else:
            if len(caches) != len(self.blocks):
                raise ValueError(f"need one cache per layer ({len(self.blocks)}), got {len(caches)}")
            q_pos, k_pos = caches[0].query_positions(t), caches[0].key_positions(t)  # (T,), (S,)
        mask = self.attn_mask(q_pos.to(tokens.device), k_pos.to(tokens.device))  # (T, S) or (H, T, S)
        x = self.embed(tokens, q_pos.to(tokens.device))  # (B, T, d)
        for i, block in enumerate(self.blocks):
            x = block(x, attn_mask=mask, kv_cache=None if caches is None else caches[i])  # (B, T, d)
        return self.head(self.norm(x))  # (B, T, d) -> (B, T, V)

    def new_caches(self, batch_size: int, max_len: int) -> list:
        """One cache per layer: preallocated to `max_len`, or rolling/sink when the config has a window."""
        w = self.head.weight
        return caches_for(self.config, batch_size, max_len, dtype=w.dtype, device=w.device)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, n_new: int, *, use_cache: bool = True,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, generator: torch.Generator | None = None,
                 return_logits: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Continue `prompt` (B, T0) by `n_new` tokens -> (B, T0 + n_new); greedy when temperature is 0.

        Without the cache every step re-runs the whole sequence (quadratic); with it, the prompt is run
        once (prefill) and each new token costs one position (decode). With ``temperature > 0`` each token is
        drawn from softmax(logits / temperature) after :func:`filter_logits` (`top_k`, `top_p`, `min_p`), with
        `generator`. ``return_logits=True`` also returns the filtered, scaled logits each step sampled from
        (B, n_new, V), -inf where a filter removed a token (the raw logits when greedy).

        Raises:
            ValueError: `n_new` not a positive int, a negative temperature, or a bad filter (see filter_logits).
        """
        _validate.positive_int("n_new", n_new)
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
        seq = prompt
        caches = self.new_caches(prompt.shape[0], prompt.shape[1] + n_new) if use_cache else None
        logits = self(prompt, caches)  # prefill: (B, T0, V)
        used = []
        for step in range(n_new):
            last = logits[:, -1]  # (B, V)
            if temperature > 0:
                last = filter_logits(last / temperature, top_k=top_k, top_p=top_p, min_p=min_p)  # (B, V)
                nxt = torch.multinomial(F.softmax(last, -1), 1, generator=generator)  # (B, 1)
            else:
                nxt = last.argmax(-1, keepdim=True)  # (B, 1)
            used.append(last)
            seq = torch.cat([seq, nxt], dim=1)  # (B, T + 1)
            if step < n_new - 1:
                logits = self(nxt, caches) if use_cache else self(seq)  # (B, 1, V) or (B, T + 1, V)
        return (seq, torch.stack(used, dim=1)) if return_logits else seq


def filter_logits(logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None,
                  min_p: float | None = None) -> torch.Tensor:
    """Set to -inf the logits (..., V) of the tokens a sampling filter removes; the rest are unchanged.

    Applied in this order, each on what the previous one kept:

    * `top_k`: keep the k largest logits of each row (ties with the k-th are kept too);
    * `top_p` (nucleus sampling, Holtzman et al. 2020): keep the smallest set of most likely tokens whose
      probabilities sum to at least p (the token that crosses p is kept; so is the most likely one);
    * `min_p`: keep the tokens whose probability is at least ``min_p`` times the most likely one's.

    Raises:
        TypeError: `logits` not a floating tensor.
        ValueError: top_k not a positive int, top_p or min_p outside (0, 1].
    """
    _validate.tensor("logits", logits, min_rank=1, floating=True)
    out = logits
    if top_k is not None:
        top_k = _validate.positive_int("top_k", top_k)
        kth = out.topk(min(top_k, out.shape[-1]), dim=-1).values[..., -1:]  # (..., 1)
        out = out.masked_fill(out < kth, float("-inf"))
    for name, value in (("top_p", top_p), ("min_p", min_p)):
        if value is not None and not (isinstance(value, (int, float)) and 0 < value <= 1):
            raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    if top_p is not None:
        probs = F.softmax(out.float(), dim=-1)  # (..., V)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the more likely tokens
        drop_sorted = before >= top_p  # the nucleus is complete before this token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
        out = out.masked_fill(drop, float("-inf"))
    if min_p is not None:
        probs = F.softmax(out.float(), dim=-1)
        out = out.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return out


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of `model` on tokens (B, T): predict t+1 from 0..t."""
    logits = model(tokens[:, :-1])  # (B, T-1, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train_lm(model: nn.Module, sample_batch, steps: int, *, lr: float = 3e-3, progress: bool = False
             ) -> list[float]:
    """AdamW on :func:`lm_loss` for `steps` batches from ``sample_batch(step) -> (B, T)``; returns losses."""
    _validate.positive_int("steps", steps)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    losses = []
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="training", leave=False)
    model.train()
    for step in it:
        loss = lm_loss(model, sample_batch(step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def next_token_accuracy(model: nn.Module, series: torch.Tensor, start: int, context: int,
                        batch_size: int = 256) -> float:
    """Greedy next-token accuracy on a 1-D token `series`: for every target position t in
    ``start .. len(series) - 1``, predict series[t] from the `context` tokens series[t - context : t].

    Every prediction sees the same amount of context (the training length, say), whatever t is, so a
    held-out tail of the series (``start`` = where it begins) is scored fairly.
    """
    _validate.tensor("series", series)
    if series.dim() != 1 or series.is_floating_point():
        raise ValueError(f"series must be a 1-D integer tensor, got shape {tuple(series.shape)}, "
                         f"dtype {series.dtype}")
    for name, v in (("start", start), ("context", context), ("batch_size", batch_size)):
        _validate.positive_int(name, v)
    if not context <= start < len(series):
        raise ValueError(f"need context <= start < len(series), got context={context}, start={start}, "
                         f"series {tuple(series.shape)}")
    windows = series.unfold(0, context + 1, 1)[start - context:]  # (N, context + 1): row n ends at start + n
    hits = 0
    for chunk in windows.split(batch_size):
        pred = model(chunk[:, :-1])[:, -1].argmax(-1)  # (b, context) -> (b, context, V) -> (b,)
        hits += int((pred == chunk[:, -1]).sum())
    return hits / len(windows)
