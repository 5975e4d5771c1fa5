"""attncourse: reference implementations, masks, plots and exercise checks for the attention course.

Lessons import from here; nothing here is generated from notebooks. See README.md for the chapter map.
`attncourse.triton_flash` (chapter 10) is not imported here: importing Triton fixes its interpreter or GPU mode,
so chapter 10 imports it itself, after setting TRITON_INTERPRET.
"""

from . import masks
from .classroom.checks import check
from .chunked import chunked_prefill, peak_tensor_bytes
from .flash import (
    causal_block_counts, causal_tile_map, flash_attention, flash_attention_forward, hbm_traffic_flash,
    hbm_traffic_standard, HBMTraffic, theorem2_bound,
)
from .flash import flash_attention_backward
from .gpt import GPT, GPTConfig
from .gqa import grouped_attention, kv_cache_bytes, mha_to_gqa, MODEL_CONFIGS, ModelConfig
from .heads import (
    attention_maps, AttnOnlyConfig, AttnOnlyTransformer, induction_scores, previous_token_scores,
    repeated_segment_tokens, repeated_tokens, sink_scores,
)
from .kv_cache import KVCache, SinkWindowCache
from .mha import merge_heads, MultiHeadAttention, repeat_kv, split_heads
from .mla import mla_cache_bytes, MultiHeadLatentAttention
from .online_softmax import (
    AttentionState, finalize_attention_state, fold_sink_logit, logsumexp_from_state, merge_attention_states,
    merge_softmax_states, naive_softmax, one_pass_softmax, online_attention, online_attention_update,
    online_softmax_state, online_softmax_trace, softmax_state, SoftmaxState, three_pass_softmax,
    two_pass_softmax,
)
from .paged_cache import memory_waste, paged_attention, PagedKVCache
from .positions import alibi_bias, alibi_slopes, sinusoidal_positions
from .positions import apply_rope, rope_attention_factor, rope_inv_freq, rope_permutation, yarn_ramp
from .ring import distributed_attention, ring_attention, run_distributed, ulysses_attention
from .rnn_attention import AdditiveAttention, LuongAttention
from .sdpa import causal_mask, safe_softmax, scaled_dot_product_attention
from .sparse import bigbird, count_scored_pairs, dilated, gathered_attention, log_dilated, longformer
from .block_sparse import block_sparse_attention, tile_states
from .prefix_cache import PrefixCache
from .transformer import FeedForward, TransformerBlock
from .utils import device, env_report, print_env_report, set_seed
from .variants import (
    diff_lambda_init, differential_attention, DifferentialAttention, sigmoid_attention, SigmoidAttention,
)
from .vit import patchify, shape_images, TinyViT, unpatchify

__version__ = "0.1.0"

__all__ = [
    "AdditiveAttention",
    "alibi_bias",
    "alibi_slopes",
    "attention_maps",
    "AttentionState",
    "AttnOnlyConfig",
    "AttnOnlyTransformer",
    "bigbird",
    "causal_block_counts",
    "causal_mask",
    "causal_tile_map",
    "check",
    "chunked_prefill",
    "count_scored_pairs",
    "device",
    "diff_lambda_init",
    "differential_attention",
    "DifferentialAttention",
    "dilated",
    "distributed_attention",
    "env_report",
    "FeedForward",
    "finalize_attention_state",
    "flash_attention",
    "flash_attention_forward",
    "flash_attention_backward",
    "gathered_attention",
    "GPT",
    "GPTConfig",
    "grouped_attention",
    "hbm_traffic_flash",
    "hbm_traffic_standard",
    "HBMTraffic",
    "induction_scores",
    "kv_cache_bytes",
    "KVCache",
    "log_dilated",
    "logsumexp_from_state",
    "longformer",
    "LuongAttention",
    "masks",
    "memory_waste",
    "merge_attention_states",
    "merge_heads",
    "merge_softmax_states",
    "mha_to_gqa",
    "MODEL_CONFIGS",
    "ModelConfig",
    "MultiHeadAttention",
    "naive_softmax",
    "one_pass_softmax",
    "online_attention",
    "fold_sink_logit",
    "online_attention_update",
    "online_softmax_state",
    "online_softmax_trace",
    "paged_attention",
    "PagedKVCache",
    "patchify",
    "peak_tensor_bytes",
    "previous_token_scores",
    "print_env_report",
    "repeat_kv",
    "repeated_segment_tokens",
    "repeated_tokens",
    "ring_attention",
    "run_distributed",
    "safe_softmax",
    "scaled_dot_product_attention",
    "set_seed",
    "shape_images",
    "sigmoid_attention",
    "SigmoidAttention",
    "sink_scores",
    "SinkWindowCache",
    "sinusoidal_positions",
    "softmax_state",
    "SoftmaxState",
    "split_heads",
    "theorem2_bound",
    "three_pass_softmax",
    "TinyViT",
    "TransformerBlock",
    "two_pass_softmax",
    "ulysses_attention",
    "unpatchify",
    "block_sparse_attention",
    "tile_states",
    "PrefixCache",
    "apply_rope",
    "rope_attention_factor",
    "rope_inv_freq",
    "yarn_ramp",
    "rope_permutation",
    "mla_cache_bytes",
    "MultiHeadLatentAttention",
]
