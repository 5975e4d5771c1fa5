"""Associative recall: how much a fixed-size state remembers, untrained and trained.

- :func:`memory_recall`: write N random (key, value) pairs into one memory, read every key back, count the exact
  recalls. The memory is a softmax over the stored keys (the KV cache), the outer-product sum of linear attention,
  or the delta rule's state. No training: the capacity of the update rule itself.
- :func:`needle_recall`: the same memories in a needle-in-a-haystack test (RULER's single-needle task, untrained):
  one pair is asked back at a chosen depth of a haystack of L pairs, as a function of L and the depth.
- :func:`mqar_batch`, :class:`RecallModel`, :func:`train_recall`: multi-query associative recall in the style of
  Zoology (Arora et al. 2023, arXiv:2312.04927): N key-value pairs, then the N keys again in a random order; the
  model must name each key's value. Small models of each layer type are trained on it from a seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _validate
from . import linear_attention as la
from .sdpa import scaled_dot_product_attention

RULES = ("softmax", "linear", "delta")
NEEDLE_RULES = ("softmax", "linear", "delta", "gated delta")
MIXERS = ("softmax", "linear", "gla", "deltanet", "gated_deltanet", "kda", "mamba2")


# ----------------------------------------------------------------------------- untrained: the update rule alone


def memory_recall(rule: str, n_pairs: int, dim: int, seed: int, temperature: float = 30.0, beta: float = 1.0) -> float:
    """Fraction of N stored pairs read back exactly (the value closest to what the memory returns is the right one).

    Keys are N random unit vectors in `dim` dimensions, values N random unit vectors; the pairs are written in
    order, then each key is used as a query. ``"softmax"``: attention over the stored keys with scores scaled by
    `temperature`; ``"linear"``: the state :math:`\\sum_i k_i v_i^T`; ``"delta"``: the delta rule with step size
    `beta` (default 1; used by ``"delta"`` only).

    Raises: ValueError for an unknown rule, TypeError/ValueError for sizes that are not positive ints.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    _validate.positive_int("n_pairs", n_pairs)
    _validate.positive_int("dim", dim)
    if not isinstance(beta, (int, float)) or not 0 < beta <= 1:
        raise ValueError(f"beta must be a number in (0, 1], got {beta!r}")
    gen = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(1, 1, n_pairs, dim, generator=gen, dtype=torch.float64), dim=-1)  # (1,1,N,d)
    values = F.normalize(torch.randn(1, 1, n_pairs, dim, generator=gen, dtype=torch.float64), dim=-1)
    if rule == "softmax":
        read = scaled_dot_product_attention(keys, keys, values, scale=temperature)  # (1,1,N,d): queries = keys
    else:
        steps = torch.full((1, 1, n_pairs), float(beta), dtype=torch.float64) if rule == "delta" else None
        _, state = la.chunked(keys, keys, values, beta=steps, chunk_size=64, scale=1.0)  # (1,1,d,d)
        read = keys @ state  # (1,1,N,d) @ (1,1,d,d): S^T k for every key
    nearest = (read @ values.transpose(-2, -1)).argmax(-1)  # (1,1,N) the stored value closest to each read
    return float((nearest == torch.arange(n_pairs)).double().mean())


def split_heads_recall(rule: str, n_pairs: int, seed: int, heads: int = 2, dim: int = 32) -> float:
    """:func:`memory_recall` at a trained layer's layout: keys and values of `dim` dims split into `heads` heads with
    one (dim/heads x dim/heads) state each, the heads' reads side by side (``"linear"`` or ``"delta"`` at beta = 1).

    Raises: ValueError for another rule or a `dim` that `heads` does not divide; TypeError/ValueError for sizes."""
    if rule not in ("linear", "delta"):
        raise ValueError(f"rule must be 'linear' or 'delta', got {rule!r}")
    for name, v in (("n_pairs", n_pairs), ("heads", heads), ("dim", dim)):
        _validate.positive_int(name, v)
    if dim % heads:
        raise ValueError(f"heads={heads} must divide dim={dim}")
    gen = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(n_pairs, dim, generator=gen, dtype=torch.float64), dim=-1)  # (N, dim)
    values = F.normalize(torch.randn(n_pairs, dim, generator=gen, dtype=torch.float64), dim=-1)
    kh = keys.view(n_pairs, heads, dim // heads).transpose(0, 1)[None]  # (1, heads, N, dim / heads)
    vh = values.view(n_pairs, heads, dim // heads).transpose(0, 1)[None]
    beta = torch.ones(1, heads, n_pairs, dtype=torch.float64) if rule == "delta" else None
    _, state = la.chunked(kh, kh, vh, beta=beta, chunk_size=64, scale=1.0)  # (1, heads, dim/heads, dim/heads)
    read = (kh @ state)[0].transpose(0, 1).reshape(n_pairs, dim)  # (N, dim): the heads' reads side by side
    return float(((read @ values.T).argmax(-1) == torch.arange(n_pairs)).double().mean())


def needle_recall(rule: str, length: int, depth: float, dim: int, seed: int, trials: int = 32,
                  temperature: float = 30.0, decay: float = 0.95) -> float:
    """Fraction of `trials` haystacks whose needle is read back exactly, the needle at `depth` of `length` pairs.

    Each trial writes `length` pairs of random unit keys and values in order (the haystack); the pair at position
    ``round(depth * (length - 1))`` is the needle, and its key is the query. A read is right when the stored value
    closest to what the memory returns is the needle's. ``"softmax"``, ``"linear"`` and ``"delta"`` are
    :func:`memory_recall`'s memories; ``"gated delta"`` is the delta rule with a constant decay `decay` per step
    (Gated DeltaNet with a fixed gate). The trials are one batch, drawn from `seed`.

    Raises: ValueError for an unknown rule, a depth outside [0, 1] or a decay outside (0, 1]; TypeError/ValueError
    for sizes that are not positive ints.
    """
    if rule not in NEEDLE_RULES:
        raise ValueError(f"rule must be one of {NEEDLE_RULES}, got {rule!r}")
    for name, x in (("length", length), ("dim", dim), ("trials", trials)):
        _validate.positive_int(name, x)
    if not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if not 0.0 < float(decay) <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    gen = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(trials, 1, length, dim, generator=gen, dtype=torch.float64), dim=-1)  # (B,1,L,d)
    values = F.normalize(torch.randn(trials, 1, length, dim, generator=gen, dtype=torch.float64), dim=-1)
    pos = round(float(depth) * (length - 1))
    query = keys[:, :, pos:pos + 1]  # (B,1,1,d)
    if rule == "softmax":
        read = scaled_dot_product_attention(query, keys, values, scale=temperature)  # (B,1,1,d)
    else:
        beta = None if rule == "linear" else torch.ones(trials, 1, length, dtype=torch.float64)
        g = torch.full((trials, 1, length), math.log(decay), dtype=torch.float64) if rule == "gated delta" else None
        _, state = la.chunked(keys, keys, values, g, beta, chunk_size=64, scale=1.0)  # (B,1,d,d)
        read = query @ state  # (B,1,1,d)
    nearest = (read @ values.transpose(-2, -1)).argmax(-1)  # (B,1,1) the stored value closest to the read
    return float((nearest == pos).double().mean())


# ----------------------------------------------------------------------------- the trained task


def mqar_batch(gen: torch.Generator, batch_size: int, n_pairs: int, n_keys: int = 64,
               n_values: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of multi-query associative recall.

    Position i < N holds pair i (key id and value id, embedded together); position N + j holds the j-th query, one
    of the N keys in a random order. Returns ``keys`` (B, 2N), ``values`` (B, 2N) (value ids at pair positions,
    ``n_values`` elsewhere: "no value") and ``targets`` (B, N): the value of each query's key.
    """
    for name, x in (("batch_size", batch_size), ("n_pairs", n_pairs), ("n_keys", n_keys), ("n_values", n_values)):
        _validate.positive_int(name, x)
    if n_pairs > n_keys:
        raise ValueError(f"n_pairs ({n_pairs}) cannot exceed n_keys ({n_keys}): keys are distinct")
    key_ids = torch.rand(batch_size, n_keys, generator=gen).argsort(-1)[:, :n_pairs]  # (B,N) distinct keys
    val_ids = torch.randint(0, n_values, (batch_size, n_pairs), generator=gen)  # (B,N)
    order = torch.rand(batch_size, n_pairs, generator=gen).argsort(-1)  # (B,N) the query order
    query_ids = key_ids.gather(1, order)  # (B,N)
    keys = torch.cat([key_ids, query_ids], dim=1)  # (B,2N)
    values = torch.cat([val_ids, torch.full_like(val_ids, n_values)], dim=1)  # (B,2N)
    return keys, values, val_ids.gather(1, order)


class Mixer(nn.Module):
    r"""One sequence-mixing layer: softmax attention or one of the linear-attention family, (B, T, d) -> (B, T, d).

    Linear kinds L2-normalise q and k per head (as DeltaNet and Gated DeltaNet do); ``"gla"`` and ``"kda"`` have a
    decay per key channel, ``"gated_deltanet"`` one per head; the delta kinds have a write strength beta per head.
    ``"mamba2"`` is Mamba-2's recurrence (SSD; Dao and Gu 2024, arXiv:2405.21060) in the same frame: one scalar decay
    per head :math:`a_t = e^{-A \Delta_t}` with :math:`\Delta_t = \mathrm{softplus}(w^\top x_t + b)`, the write
    scaled by :math:`\Delta_t` (:math:`S_t = a_t S_{t-1} + \Delta_t k_t v_t^\top`), no delta correction; q, k
    play C, B and are L2-normalised like the other kinds' (Mamba-2 leaves them unnormalised), so that Gated
    DeltaNet differs from it only by the delta update. A and the bias of :math:`\Delta` start as mamba_ssm's
    defaults: A uniform in [1, 16], :math:`\Delta` log-uniform in [0.001, 0.1]. As in Mamba-2's layer, the output is
    RMS-normalised (per head here, with a learned weight; Mamba-2 also gates it) before the output projection: the
    write is scaled by :math:`\Delta_t`, so without the norm the read is as small as :math:`\Delta`.
    """

    def __init__(self, kind: str, d_model: int, n_heads: int, chunk_size: int = 32):
        super().__init__()
        if kind not in MIXERS:
            raise ValueError(f"kind must be one of {MIXERS}, got {kind!r}")
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.kind, self.h, self.dh, self.chunk = kind, n_heads, d_model // n_heads, chunk_size
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        n_gate = {"gla": d_model, "kda": d_model, "gated_deltanet": n_heads, "mamba2": n_heads}.get(kind, 0)
        self.gate = nn.Linear(d_model, n_gate) if n_gate else None
        if kind == "mamba2":  # mamba_ssm's initialisation: A in [1, 16], dt = softplus(bias) in [0.001, 0.1]
            self.A_log = nn.Parameter(torch.empty(n_heads).uniform_(1, 16).log())
            self.norm = nn.RMSNorm(self.dh)  # Mamba-2's norm before the output projection, per head
            dt = torch.exp(torch.empty(n_heads).uniform_(math.log(1e-3), math.log(1e-1)))
            with torch.no_grad():
                self.gate.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # the inverse of softplus
        elif self.gate is not None:  # start with decays near 1 (e^-0.007 per step): forget slowly until trained
            nn.init.constant_(self.gate.bias, 5.0)
        self.beta = nn.Linear(d_model, n_heads) if kind in ("deltanet", "gated_deltanet", "kda") else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.h, self.dh).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))  # (B,H,T,dh)
        if self.kind == "softmax":
            o = scaled_dot_product_attention(q, k, v, is_causal=True)  # (B,H,T,dh)
        else:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
            g = beta = None
            if self.kind == "mamba2":
                dt = F.softplus(self.gate(x)).transpose(1, 2)  # (B,H,T) step size Delta_t > 0
                g = -torch.exp(self.A_log)[:, None] * dt  # (B,H,T) log-decay -A Delta_t
                v = v * dt[..., None]  # the write Delta_t k_t v_t^T (B's discretisation)
            elif self.gate is not None:
                g = F.logsigmoid(self.gate(x))  # (B,T,H or d) log-decay in (-inf, 0)
                g = g.transpose(1, 2) if self.kind == "gated_deltanet" else \
                    g.view(B, T, self.h, self.dh).transpose(1, 2)  # (B,H,T) or (B,H,T,dh)
            if self.beta is not None:
                beta = torch.sigmoid(self.beta(x)).transpose(1, 2)  # (B,H,T) in (0, 1)
            o, _ = la.chunked(q, k, v, g, beta, chunk_size=self.chunk, scale=1.0)
            if self.kind == "mamba2":
                o = self.norm(o)  # (B,H,T,dh)
        return self.out(o.transpose(1, 2).reshape(B, T, -1))  # (B,T,d)


class RecallModel(nn.Module):
    """Embeddings of (key, value) ids, a stack of pre-norm residual mixers, and a read-out over values.

    ``layers`` names the mixer of each layer, e.g. ``("gated_deltanet",) * 3 + ("softmax",)`` for a 3:1 hybrid.
    """

    def __init__(self, layers: tuple[str, ...], d_model: int = 64, n_heads: int = 2, n_keys: int = 64,
                 n_values: int = 64):
        super().__init__()
        self.key_emb = nn.Embedding(n_keys, d_model)
        self.value_emb = nn.Embedding(n_values + 1, d_model)  # the last id: "no value" (a query position)
        self.mixers = nn.ModuleList(Mixer(kind, d_model, n_heads) for kind in layers)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in layers)
        self.head = nn.Linear(d_model, n_values)

    def forward(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        x = self.key_emb(keys) + self.value_emb(values)  # (B,T,d)
        for norm, mixer in zip(self.norms, self.mixers):
            x = x + mixer(norm(x))
        return self.head(x)  # (B,T,n_values)


@dataclass(frozen=True)
class RecallRun:
    """What one training run measured."""

    layers: tuple[str, ...]
    n_pairs: int
    seed: int
    accuracy: float  # fraction of the held-out queries answered right
    n_params: int


def train_recall(layers: tuple[str, ...], n_pairs: int, seed: int, steps: int = 300, batch_size: int = 32,
                 d_model: int = 32, n_heads: int = 2, lr: float = 3e-3, eval_batches: int = 4,
                 vocab: int = 64) -> RecallRun:
    """Train a :class:`RecallModel` on MQAR with `n_pairs` pairs from `seed`; return the held-out accuracy.

    Raises: TypeError/ValueError for sizes that are not positive ints or an unknown layer kind.
    """
    for name, x in (("n_pairs", n_pairs), ("steps", steps), ("batch_size", batch_size)):
        _validate.positive_int(name, x)
    torch.manual_seed(seed)
    model = RecallModel(tuple(layers), d_model=d_model, n_heads=n_heads, n_keys=vocab, n_values=vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(10_000 + seed)
    for _ in range(steps):
        keys, values, targets = mqar_batch(gen, batch_size, n_pairs, vocab, vocab)
        logits = model(keys, values)[:, n_pairs:]  # (B,N,n_values) the query positions
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    test = torch.Generator().manual_seed(20_000 + seed)  # held-out sequences
    right = total = 0
    with torch.no_grad():
        for _ in range(eval_batches):
            keys, values, targets = mqar_batch(test, 64, n_pairs, vocab, vocab)
            right += int((model(keys, values)[:, n_pairs:].argmax(-1) == targets).sum())
            total += targets.numel()
    return RecallRun(tuple(layers), n_pairs, seed, right / total, sum(p.numel() for p in model.parameters()))


def recall_sweep(models: dict[str, tuple[str, ...]], n_pairs: tuple[int, ...], seeds: tuple[int, ...],
                 **train_kwargs) -> dict[str, list[list[float]]]:
    """Held-out accuracy of every model (name -> layers) at every number of pairs, for every seed:
    name -> one row per seed, one accuracy per entry of `n_pairs`. Keyword arguments go to :func:`train_recall`."""
    return {name: [[train_recall(layers, n, seed, **train_kwargs).accuracy for n in n_pairs] for seed in seeds]
            for name, layers in models.items()}



