"""The per-step decode timer of chapter 07: one time per step, positive, and the rate is the median's."""

import pytest
import torch

from attncourse.bench_decode import decode_step_times, prefill_vs_decode
from attncourse.gpt import GPT, GPTConfig


def test_decode_step_times_shape_and_validation():
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=11, block_size=64, d_model=16, n_heads=2, n_layers=1)).eval()
    steps = decode_step_times(m, 10, 4, repeats=2)
    assert steps.shape == (8,) and steps.dtype == torch.float64 and bool((steps > 0).all())
    rates = prefill_vs_decode(m, 10, 4, repeats=2)
    assert 0 < rates["decode_tokens_per_s"] < float("inf")
    with pytest.raises(ValueError, match="n_new"):
        decode_step_times(m, 10, 0)
