"""KV caches of models released in 2024-25 (lesson 05's second table), from their published ``config.json`` files.

GQA models are :class:`~attncourse.gqa.ModelConfig` rows. Gemma 3 adds sliding-window layers: five local layers
(window 1,024 tokens) to every global one, so only the global layers' caches grow with the context
(:func:`local_global_cache_bytes`). Kimi K2 is MLA with DeepSeek-V3's latent and RoPE key and half its heads
(:data:`KIMI_K2`).
"""
from __future__ import annotations

from . import _validate
from .gqa import ModelConfig

MODELS_2025: tuple[ModelConfig, ...] = (
    ModelConfig("Llama-3.1 70B", 70.6e9, 80, 8192, 64, 8, 128, 131_072,
                "config.json of meta-llama/Llama-3.1-70B (80 layers, 64 heads, num_key_value_heads 8); "
                "Llama Team 2024, The Llama 3 Herd of Models, Table 3, https://arxiv.org/abs/2407.21783"),
    ModelConfig("Qwen2.5-72B", 72.7e9, 80, 8192, 64, 8, 128, 131_072,
                "config.json of Qwen/Qwen2.5-72B (80 layers, 64 heads, num_key_value_heads 8); Qwen Team 2024, "
                "Qwen2.5 Technical Report, Table 1, https://arxiv.org/abs/2412.15115"),
    ModelConfig("Qwen3-32B", 32.8e9, 64, 5120, 64, 8, 128, 131_072,
                "config.json of Qwen/Qwen3-32B (64 layers, 64 heads, 8 KV heads, head_dim 128); Qwen Team 2025, "
                "Qwen3 Technical Report, Table 1, https://arxiv.org/abs/2505.09388"),
    ModelConfig("Qwen3-235B-A22B", 235e9, 94, 4096, 64, 4, 128, 131_072,
                "config.json of Qwen/Qwen3-235B-A22B (94 layers, 64 heads, 4 KV heads, head_dim 128); Qwen Team "
                "2025, Qwen3 Technical Report, Table 2, https://arxiv.org/abs/2505.09388"),
    ModelConfig("Gemma 3 27B", 27.4e9, 62, 5376, 32, 16, 128, 131_072,
                "config.json of google/gemma-3-27b-pt (62 layers, 32 heads, 16 KV heads, head_dim 128, "
                "sliding_window 1024, every sixth layer global); Gemma Team 2025, Gemma 3 Technical Report, "
                "section 2, https://arxiv.org/abs/2503.19786"),
)
GEMMA3_WINDOW, GEMMA3_LOCAL_PER_GLOBAL = 1024, 5
# Kimi K2 (MLA): config.json of moonshotai/Kimi-K2-Instruct; Kimi Team 2025, Kimi K2: Open Agentic Intelligence,
# https://arxiv.org/abs/2507.20534 (64 attention heads where DeepSeek-V3 has 128).
KIMI_K2 = dict(n_layers=61, d_model=7168, n_heads=64, kv_rank=512, q_rank=1536, head_dim=128, rope_dim=64)


def n_global_layers(n_layers: int, local_per_global: int = GEMMA3_LOCAL_PER_GLOBAL) -> int:
    """Global layers when every ``(local_per_global + 1)``-th layer is global (Gemma 3: layers 6, 12, ...)."""
    _validate.positive_int("n_layers", n_layers)
    _validate.positive_int("local_per_global", local_per_global)
    return n_layers // (local_per_global + 1)


def local_global_cache_bytes(cfg: ModelConfig, seq_len: int, window: int = GEMMA3_WINDOW,
                             local_per_global: int = GEMMA3_LOCAL_PER_GLOBAL, bytes_per_element: int = 2) -> int:
    """One sequence's cache when global layers keep every token and local layers only the last `window`."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    for name, v in (("seq_len", seq_len), ("window", window), ("bytes_per_element", bytes_per_element)):
        _validate.positive_int(name, v)
    n_global = n_global_layers(cfg.n_layers, local_per_global)
    per_layer_token = 2 * cfg.n_kv_heads * cfg.head_dim * bytes_per_element  # K and V
    return per_layer_token * (n_global * seq_len + (cfg.n_layers - n_global) * min(seq_len, window))
