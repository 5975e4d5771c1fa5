"""Hybrid schedules' memory at decode: the KV cache of the attention layers against the fixed state of the
linear (or state-space) layers, for published configurations.

Per sequence of T tokens, in ``bytes_per_element`` (2 for bfloat16):

- a full-attention layer caches K and V: 2 * H_kv * D * T elements (chapter 05); an MLA layer its latent and RoPE
  key: (kv_rank + rope_dim) * T;
- a sliding-window layer at most its window W: 2 * H_kv * D * min(T, W);
- a linear-attention layer holds a (Dk, Dv) matrix per head plus its short convolution's last (kernel - 1) inputs,
  whatever T; a Mamba layer its (d_inner, d_state) SSM state plus the same convolution window.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _validate


@dataclass(frozen=True)
class LayerKind:
    """One kind of layer and how many the model has. ``per_token``: elements cached per token (0 for a state);
    ``window``: the tokens kept (None: all of them); ``fixed``: elements held whatever the length."""

    name: str
    count: int
    per_token: int = 0
    window: int | None = None
    fixed: int = 0

    def elements(self, seq_len: int) -> int:
        kept = seq_len if self.window is None else min(seq_len, self.window)
        return self.count * (self.per_token * kept + self.fixed)


@dataclass(frozen=True)
class HybridConfig:
    """A model's layers grouped by kind, with where the numbers come from."""

    name: str
    kinds: tuple[LayerKind, ...]
    source: str

    @property
    def n_layers(self) -> int:
        return sum(k.count for k in self.kinds)

    def bytes(self, seq_len: int, batch_size: int = 1, bytes_per_element: int = 2) -> dict[str, int]:
        """Bytes held at decode after `seq_len` tokens, per layer kind (name -> bytes).

        Raises: TypeError/ValueError for arguments that are not positive ints.
        """
        for arg, v in (("seq_len", seq_len), ("batch_size", batch_size), ("bytes_per_element", bytes_per_element)):
            _validate.positive_int(arg, v)
        return {k.name: k.elements(seq_len) * batch_size * bytes_per_element for k in self.kinds}

    def total_bytes(self, seq_len: int, batch_size: int = 1, bytes_per_element: int = 2) -> int:
        return sum(self.bytes(seq_len, batch_size, bytes_per_element).values())


def attention_layers(name: str, count: int, n_kv_heads: int, head_dim: int, window: int | None = None) -> LayerKind:
    """Softmax-attention layers caching K and V (a sliding window if `window` is given)."""
    for arg, v in (("count", count), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        _validate.positive_int(arg, v)
    return LayerKind(name, count, per_token=2 * n_kv_heads * head_dim, window=window)


def mla_layers(name: str, count: int, kv_rank: int, rope_dim: int) -> LayerKind:
    """Multi-head latent attention layers caching the latent and the RoPE key (chapter 05)."""
    return LayerKind(name, count, per_token=kv_rank + rope_dim)


def linear_layers(name: str, count: int, n_heads: int, key_dim: int, value_dim: int, conv_channels: int = 0,
                  conv_kernel: int = 1) -> LayerKind:
    """Linear-attention layers: a (key_dim, value_dim) state per head, plus a short convolution's window."""
    for arg, v in (("count", count), ("n_heads", n_heads), ("key_dim", key_dim), ("value_dim", value_dim),
                   ("conv_kernel", conv_kernel)):
        _validate.positive_int(arg, v)
    return LayerKind(name, count, fixed=n_heads * key_dim * value_dim + conv_channels * (conv_kernel - 1))


def mamba_layers(name: str, count: int, d_inner: int, d_state: int, conv_kernel: int) -> LayerKind:
    """Mamba layers: a (d_inner, d_state) SSM state plus the convolution's last (conv_kernel - 1) inputs."""
    return LayerKind(name, count, fixed=d_inner * d_state + d_inner * (conv_kernel - 1))


# Published shapes (config.json on the Hugging Face hub of each model; the papers named).
HYBRID_CONFIGS: tuple[HybridConfig, ...] = (
    HybridConfig("Qwen3-Next-80B-A3B", (
        attention_layers("gated attention (GQA)", 12, n_kv_heads=2, head_dim=256),
        # 16 key heads shared by 32 value heads: the state is (128, 128) per value head; conv over q, k, v
        linear_layers("Gated DeltaNet", 36, n_heads=32, key_dim=128, value_dim=128,
                      conv_channels=2 * 16 * 128 + 32 * 128, conv_kernel=4)),
        "Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers, full_attention_interval 4"),
    HybridConfig("Kimi Linear 48B-A3B", (
        mla_layers("MLA", 7, kv_rank=512, rope_dim=64),
        linear_layers("Kimi Delta Attention", 20, n_heads=32, key_dim=128, value_dim=128,
                      conv_channels=3 * 32 * 128, conv_kernel=4)),
        "moonshotai/Kimi-Linear-48B-A3B-Instruct config.json: 27 layers, full_attn_layers 4, 8, ..., 24, 27; "
        "Kimi Linear report, arXiv:2510.26692"),
    HybridConfig("Jamba-v0.1 52B", (
        attention_layers("attention (GQA)", 4, n_kv_heads=8, head_dim=128),
        mamba_layers("Mamba", 28, d_inner=8192, d_state=16, conv_kernel=4)),
        "ai21labs/Jamba-v0.1 config.json: 32 layers, attn_layer_period 8; Lieber et al. 2024, arXiv:2403.19887"),
    HybridConfig("Gemma 3 27B", (
        attention_layers("global attention", 10, n_kv_heads=16, head_dim=128),
        attention_layers("sliding window 1024", 52, n_kv_heads=16, head_dim=128, window=1024)),
        "google/gemma-3-27b config.json: 62 layers, 5 local per global; Gemma 3 report, arXiv:2503.19786"),
    HybridConfig("gpt-oss-120b", (
        attention_layers("full attention", 18, n_kv_heads=8, head_dim=64),
        attention_layers("sliding window 128", 18, n_kv_heads=8, head_dim=64, window=128)),
        "openai/gpt-oss-120b config.json: 36 layers alternating; OpenAI, gpt-oss-120b & gpt-oss-20b model card (2025)"),
)


def hybrid_config(name: str) -> HybridConfig:
    """The entry of :data:`HYBRID_CONFIGS` called `name`. Raises ValueError for an unknown name."""
    for cfg in HYBRID_CONFIGS:
        if cfg.name == name:
            return cfg
    raise ValueError(f"no hybrid config named {name!r}; known: {[c.name for c in HYBRID_CONFIGS]}")


def all_attention(cfg: HybridConfig) -> HybridConfig:
    """The same model with every layer a full-attention layer shaped like its first attention kind (the baseline
    the hybrid's savings are measured against)."""
    base = next(k for k in cfg.kinds if k.per_token)
    return HybridConfig(f"{cfg.name}, all layers {base.name}",
                        (LayerKind(base.name, cfg.n_layers, per_token=base.per_token),), cfg.source)
