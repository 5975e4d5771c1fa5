r"""Grouped-query attention beyond the module: KV-cache sizes of real models, the grouped formulation
that never copies K/V, converting MHA checkpoints to GQA (Ainslie et al.), and a decode cost model.

KV cache of one sequence: keys and values, for every layer, KV head, position and head-dim element:

.. math:: \text{bytes} = 2 \cdot L \cdot H_{kv} \cdot D \cdot T \cdot B \cdot \text{bytes per element}
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import _validate
from .mha import grouped_attention, MultiHeadAttention  # noqa: F401  (grouped_attention re-exported)


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, batch_size: int = 1,
                   bytes_per_element: int = 2) -> int:
    """Bytes of the keys and values cached for `batch_size` sequences of `seq_len` tokens (2 = K and V)."""
    for name, v in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                    ("seq_len", seq_len), ("batch_size", batch_size), ("bytes_per_element", bytes_per_element)):
        _validate.positive_int(name, v)
    return 2 * n_layers * n_kv_heads * head_dim * seq_len * batch_size * bytes_per_element


@dataclass(frozen=True)
class ModelConfig:
    """The attention shape of a published model, with where the numbers come from."""

    name: str
    n_params: float  # total parameters as published (nominal), for the decode cost model
    n_layers: int
    d_model: int
    n_heads: int  # query heads
    n_kv_heads: int  # 1 = MQA, n_heads = MHA, in between = GQA
    head_dim: int  # not always d_model / n_heads: PaLM 540B has 48 heads of 256 and d_model 18432
    context: int  # training context length in tokens
    source: str  # paper or model card with the numbers

    @property
    def attention(self) -> str:
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else f"GQA-{self.n_kv_heads}"

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    def kv_cache_bytes(self, seq_len: int, batch_size: int = 1, bytes_per_element: int = 2) -> int:
        return kv_cache_bytes(self.n_layers, self.n_kv_heads, self.head_dim, seq_len, batch_size,
                              bytes_per_element)


MODEL_CONFIGS: tuple[ModelConfig, ...] = (
    ModelConfig("GPT-3 175B", 175e9, 96, 12288, 96, 96, 128, 2048,
                "Brown et al. 2020, Table 2.1, https://arxiv.org/abs/2005.14165"),
    ModelConfig("LLaMA-1 65B", 65.2e9, 80, 8192, 64, 64, 128, 2048,
                "Touvron et al. 2023, Table 2, https://arxiv.org/abs/2302.13971"),
    ModelConfig("LLaMA-2 7B", 6.7e9, 32, 4096, 32, 32, 128, 4096,
                "Touvron et al. 2023b, https://arxiv.org/abs/2307.09288; config.json of meta-llama/Llama-2-7b-hf"),
    ModelConfig("LLaMA-2 70B", 69e9, 80, 8192, 64, 8, 128, 4096,
                "Touvron et al. 2023b, Table 1 and sec. 2.2, https://arxiv.org/abs/2307.09288; "
                "config.json of meta-llama/Llama-2-70b-hf"),
    ModelConfig("LLaMA-3 8B", 8.03e9, 32, 4096, 32, 8, 128, 8192,
                "Meta Llama 3 model card and config.json of meta-llama/Meta-Llama-3-8B, "
                "https://github.com/meta-llama/llama3/blob/main/MODEL_CARD.md"),
    ModelConfig("Mistral 7B", 7.24e9, 32, 4096, 32, 8, 128, 8192,
                "Jiang et al. 2023, Table 1, https://arxiv.org/abs/2310.06825"),
    ModelConfig("Falcon-7B", 7e9, 32, 4544, 71, 1, 64, 2048,
                "tiiuae/falcon-7b model card, https://huggingface.co/tiiuae/falcon-7b; Almazrouei et al. 2023, "
                "https://arxiv.org/abs/2311.16867"),
    ModelConfig("Falcon-40B", 40e9, 60, 8192, 128, 8, 64, 2048,
                "tiiuae/falcon-40b model card, https://huggingface.co/tiiuae/falcon-40b; Almazrouei et al. 2023"),
    ModelConfig("PaLM 540B", 540e9, 118, 18432, 48, 1, 256, 2048,
                "Chowdhery et al. 2022, Table 1 and sec. 2, https://arxiv.org/abs/2204.02311; head size 256 as "
                "in Pope et al. 2022, https://arxiv.org/abs/2211.05102"),
)


# Published models the lesson's table leaves out (chapter 05's exercises ask about them).
OTHER_CONFIGS: tuple[ModelConfig, ...] = (
    ModelConfig("Falcon-180B", 180e9, 80, 14848, 232, 8, 64, 2048,
                "config.json of tiiuae/falcon-180B (hidden_size 14848, 232 heads, num_kv_heads 8, 80 layers); "
                "Almazrouei et al. 2023, https://arxiv.org/abs/2311.16867"),
    ModelConfig("LLaMA-3.1 405B", 405e9, 126, 16384, 128, 8, 128, 131072,
                "Llama Team 2024, The Llama 3 Herd of Models, Table 3, https://arxiv.org/abs/2407.21783"),
    ModelConfig("Gemma 7B", 8.54e9, 28, 3072, 16, 16, 256, 8192,
                "Gemma Team 2024, Table 1 (16 heads and 16 KV heads of size 256), https://arxiv.org/abs/2403.08295"),
)


def model_config(name: str) -> ModelConfig:
    """Look a config up by name, e.g. ``model_config("Mistral 7B")`` (in MODEL_CONFIGS or OTHER_CONFIGS)."""
    for cfg in MODEL_CONFIGS + OTHER_CONFIGS:
        if cfg.name == name:
            return cfg
    raise ValueError(f"no model config named {name!r}; known: {[c.name for c in MODEL_CONFIGS + OTHER_CONFIGS]}")


def mha_to_gqa(mha: MultiHeadAttention, n_kv_heads: int, method: str = "mean") -> MultiHeadAttention:
    """A GQA copy of an MHA layer: queries and output projection kept, K/V heads merged per group.

    method: "mean" (Ainslie et al.: average the K and V projection heads of each group), "first" (keep
    each group's first head), or "random" (fresh K/V projections, a baseline).
    """
    if not isinstance(mha, MultiHeadAttention):
        raise TypeError(f"mha must be a MultiHeadAttention, got {type(mha).__name__}")
    if mha.n_kv_heads != mha.n_heads:
        raise ValueError(f"mha must be MHA (n_kv_heads == n_heads), got n_heads={mha.n_heads}, "
                         f"n_kv_heads={mha.n_kv_heads}")
    if method not in ("mean", "first", "random"):
        raise ValueError(f"method must be 'mean', 'first' or 'random', got {method!r}")
    bias = mha.q_proj.bias is not None
    w = mha.q_proj.weight
    gqa = MultiHeadAttention(mha.d_model, mha.n_heads, n_kv_heads, bias=bias, rope_base=mha.rope_base,
                             rope_scaling=mha.rope_scaling).to(w.device, w.dtype)
    gqa.q_proj.load_state_dict(mha.q_proj.state_dict())
    gqa.o_proj.load_state_dict(mha.o_proj.state_dict())
    if method == "random":
        return gqa
    g, d = mha.n_heads // n_kv_heads, mha.head_dim
    with torch.no_grad():
        for src, dst in ((mha.k_proj, gqa.k_proj), (mha.v_proj, gqa.v_proj)):
            for name, p in src.named_parameters():  # weight (H*D, d_model) or bias (H*D,)
                grouped = p.view(n_kv_heads, g, d, *p.shape[1:])  # (Hkv, G, D, ...)
                merged = grouped.mean(dim=1) if method == "mean" else grouped[:, 0]  # (Hkv, D, ...)
                getattr(dst, name).copy_(merged.reshape(n_kv_heads * d, *p.shape[1:]))
    return gqa


def decode_attention_cost(n_heads: int, n_kv_heads: int, head_dim: int, context_len: int,
                          bytes_per_element: int = 2) -> dict[str, float]:
    """One layer, one sequence, one generated token: attention FLOPs, K/V bytes read, and their ratio.

    FLOPs: 2 H S D for q.k and 2 H S D for the weighted sum of V. Bytes: the whole cache, 2 Hkv S D
    elements. Arithmetic intensity = 2 G / bytes_per_element FLOPs per byte: G times MHA's.
    """
    for name, v in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                    ("context_len", context_len), ("bytes_per_element", bytes_per_element)):
        _validate.positive_int(name, v)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} must be divisible by n_kv_heads={n_kv_heads}")
    flops = 4 * n_heads * context_len * head_dim
    kv_bytes = kv_cache_bytes(1, n_kv_heads, head_dim, context_len, 1, bytes_per_element)
    return {"flops": flops, "kv_bytes": kv_bytes, "flops_per_byte": flops / kv_bytes}


def decode_step_bytes(cfg: ModelConfig, context_len: int, batch_size: int = 1,
                      bytes_per_element: int = 2) -> dict[str, int]:
    """Bytes read from memory per decoding step (one token for each of `batch_size` sequences).

    A decode step is memory-bound: every weight is read once per step (shared by the batch), and each
    sequence's whole KV cache is read once. Their sum divided by memory bandwidth bounds the step time.
    """
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    weights = int(cfg.n_params) * bytes_per_element
    kv = cfg.kv_cache_bytes(context_len, batch_size, bytes_per_element)
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def with_kv_heads(cfg: ModelConfig, n_kv_heads: int) -> ModelConfig:
    """The same model with `n_kv_heads` KV heads. Its parameter count changes by the K and V projections,
    ``2 L d_model D (n_kv_heads - cfg.n_kv_heads)``: LLaMA-2 70B as MHA has 9.4 billion more weights."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    _validate.positive_int("n_kv_heads", n_kv_heads)
    if cfg.n_heads % n_kv_heads:
        raise ValueError(f"n_heads={cfg.n_heads} must be divisible by n_kv_heads={n_kv_heads}")
    extra = 2 * cfg.n_layers * cfg.d_model * cfg.head_dim * (n_kv_heads - cfg.n_kv_heads)
    return replace(cfg, name=f"{cfg.name} with {n_kv_heads} KV heads", n_kv_heads=n_kv_heads,
                   n_params=cfg.n_params + extra)


@dataclass(frozen=True)
class Hardware:
    """Accelerators serving one model with tensor parallelism: weights and KV heads split across devices."""

    name: str
    n_devices: int
    memory_bytes: float  # per device
    bandwidth: float  # bytes/s per device

    @property
    def total_memory(self) -> float:
        return self.n_devices * self.memory_bytes

    @property
    def total_bandwidth(self) -> float:
        return self.n_devices * self.bandwidth


H100_X8 = Hardware("8 x H100 SXM 80 GB (80 GiB), tensor parallel", 8, 80 * 2**30, 3.35e12)  # NVIDIA H100 datasheet
# (HBM3): its "80 GB" of HBM3 are 80 GiB = 85.9e9 bytes (the driver keeps a little for itself; we model all of it)


def serving_bytes(cfg: ModelConfig, hw: Hardware, context_len: int, batch_size: int = 1,
                  bytes_per_element: int = 2) -> dict[str, float]:
    """Bytes held (and read by every decode step) on `hw`: the weights once, and each sequence's cache.

    With fewer KV heads than devices, each KV head is stored on ``n_devices / n_kv_heads`` devices (tensor
    parallelism splits heads; Pope et al. 2022 shard MQA's cache over the batch instead), so MQA on 8
    devices holds 8 copies of its one head.
    """
    if not isinstance(hw, Hardware):
        raise TypeError(f"hw must be a Hardware, got {type(hw).__name__}")
    b = decode_step_bytes(cfg, context_len, batch_size, bytes_per_element)
    copies = max(1.0, hw.n_devices / cfg.n_kv_heads)
    kv = b["kv_cache"] * copies
    return {"weights": b["weights"], "kv_cache": kv, "total": b["weights"] + kv}


def max_batch(cfg: ModelConfig, hw: Hardware, context_len: int, bytes_per_element: int = 2) -> int:
    """How many sequences of `context_len` tokens fit in `hw`'s memory next to the weights (0 if none)."""
    one = serving_bytes(cfg, hw, context_len, 1, bytes_per_element)
    return max(0, int((hw.total_memory - one["weights"]) // one["kv_cache"]))


def decode_throughput(cfg: ModelConfig, hw: Hardware, context_len: int, batch_size: int,
                      bytes_per_element: int = 2) -> float | None:
    """Upper bound on generated tokens/s (memory-bound decode), or None when the batch does not fit."""
    if batch_size > max_batch(cfg, hw, context_len, bytes_per_element):
        return None
    step = serving_bytes(cfg, hw, context_len, batch_size, bytes_per_element)["total"] / hw.total_bandwidth
    return batch_size / step
