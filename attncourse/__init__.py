"""attncourse: reference implementations, masks, plots and exercise checks for the attention course.

Lessons import from here; nothing here is generated from notebooks. See README.md for the chapter map.
"""

from . import masks
from .checks import check
from .flash import (HBMTraffic, causal_block_counts, causal_tile_map, flash_attention, flash_attention_forward, hbm_traffic_flash, hbm_traffic_standard, theorem2_bound)  # noqa: E501
from .gpt import GPT, GPTConfig
from .heads import AttnOnlyConfig, AttnOnlyTransformer, attention_maps, induction_scores, previous_token_scores, repeated_segment_tokens, repeated_tokens, sink_scores  # noqa: E501
from .gqa import MODEL_CONFIGS, ModelConfig, grouped_attention, kv_cache_bytes, mha_to_gqa
from .kv_cache import KVCache, SinkWindowCache
from .mha import MultiHeadAttention, merge_heads, repeat_kv, split_heads
from .rnn_attention import AdditiveAttention, LuongAttention
from .online_softmax import (AttentionState, SoftmaxState, finalize_attention_state, logsumexp_from_state, merge_attention_states, merge_softmax_states, naive_softmax, one_pass_softmax, online_attention, online_attention_update, online_softmax_state, online_softmax_trace, softmax_state, three_pass_softmax, two_pass_softmax)  # noqa: E501
from .positions import alibi_bias, alibi_slopes, sinusoidal_positions
from .sdpa import causal_mask, safe_softmax, scaled_dot_product_attention
from .sparse import bigbird, count_scored_pairs, dilated, gathered_attention, log_dilated, longformer  # noqa: E501
from .paged_cache import PagedKVCache, memory_waste, paged_attention
from .chunked import chunked_prefill, peak_tensor_bytes
from .ring import distributed_attention, ring_attention, run_distributed, ulysses_attention
from .transformer import FeedForward, TransformerBlock
from .utils import device, env_report, print_env_report, set_seed
from .variants import DifferentialAttention, SigmoidAttention, diff_lambda_init, differential_attention, sigmoid_attention  # noqa: E501
from .vit import TinyViT, patchify, shape_images, unpatchify

__version__ = "0.1.0"

__all__ = [
    "HBMTraffic",
    "causal_block_counts",
    "causal_tile_map",
    "flash_attention",
    "flash_attention_forward",
    "hbm_traffic_flash",
    "hbm_traffic_standard",
    "theorem2_bound",
    "AdditiveAttention",
    "LuongAttention",
    "alibi_bias",
    "alibi_slopes",
    "GPT",
    "GPTConfig",
    "KVCache",
    "SinkWindowCache",
    "sinusoidal_positions",
    "check",
    "causal_mask",
    "device",
    "env_report",
    "FeedForward",
    "grouped_attention",
    "kv_cache_bytes",
    "masks",
    "mha_to_gqa",
    "MODEL_CONFIGS",
    "ModelConfig",
    "merge_heads",
    "MultiHeadAttention",
    "repeat_kv",
    "split_heads",
    "print_env_report",
    "safe_softmax",
    "scaled_dot_product_attention",
    *("AttentionState", "SoftmaxState", "finalize_attention_state", "logsumexp_from_state", "merge_attention_states", "merge_softmax_states", "naive_softmax", "one_pass_softmax", "online_attention", "online_attention_update", "online_softmax_state", "online_softmax_trace", "softmax_state", "three_pass_softmax", "two_pass_softmax"),  # noqa: E501
    "set_seed",
    *("bigbird", "count_scored_pairs", "dilated", "gathered_attention", "log_dilated", "longformer", "PagedKVCache", "memory_waste", "paged_attention", "chunked_prefill", "peak_tensor_bytes", "distributed_attention", "ring_attention", "run_distributed", "ulysses_attention"),  # noqa: E501 (chapter 11)
    "TransformerBlock",
    *("AttnOnlyConfig", "AttnOnlyTransformer", "attention_maps", "induction_scores", "previous_token_scores", "repeated_segment_tokens", "repeated_tokens", "sink_scores"),  # noqa: E501
    *("DifferentialAttention", "SigmoidAttention", "diff_lambda_init", "differential_attention", "sigmoid_attention"),  # noqa: E501
    *("TinyViT", "patchify", "shape_images", "unpatchify"),
]
