"""MoE decode arithmetic: distinct experts touched (formula against simulation), published layouts, bytes."""

import math

import pytest
import torch

from attncourse.moe_decode import (BITS, DEEPSEEK_V3, GPT_OSS_120B, expected_experts_touched, expert_intensity,
                                   simulate_experts_touched, weight_bytes_per_step)


def test_formula_limits():
    assert expected_experts_touched(256, 8, 1) == pytest.approx(8)
    assert expected_experts_touched(256, 8, 10_000) == pytest.approx(256)
    assert expected_experts_touched(4, 4, 3) == pytest.approx(4)          # k = E: every expert at once
    touched = [expected_experts_touched(64, 2, b) for b in (1, 2, 4, 8, 16, 32)]
    assert all(a < b for a, b in zip(touched, touched[1:]))               # grows with the batch
    assert all(t <= 2 * b for t, b in zip(touched, (1, 2, 4, 8, 16, 32)))  # never more than B k


@pytest.mark.parametrize("e,k,b", [(16, 2, 3), (64, 4, 8), (128, 4, 40)])
def test_formula_matches_simulation(e, k, b):
    g = torch.Generator().manual_seed(0)
    sim = simulate_experts_touched(e, k, b, trials=400, generator=g)
    se = float(sim.std()) / math.sqrt(400)
    assert abs(float(sim.mean()) - expected_experts_touched(e, k, b)) < 4 * se + 1e-6


def test_skewed_router_touches_fewer():
    g = torch.Generator().manual_seed(1)
    pop = 1.0 / torch.arange(1, 65, dtype=torch.float64)                  # Zipf-like popularity over 64 experts
    sim = simulate_experts_touched(64, 4, 16, trials=300, generator=g, popularity=pop)
    assert float(sim.mean()) < expected_experts_touched(64, 4, 16) - 3


def test_published_layouts_reproduce_active_parameters():
    assert DEEPSEEK_V3.active_params == pytest.approx(DEEPSEEK_V3.n_active, rel=0.02)
    assert GPT_OSS_120B.active_params == pytest.approx(GPT_OSS_120B.n_active, rel=0.01)


def test_bytes_and_intensity():
    one = weight_bytes_per_step(GPT_OSS_120B, 1)
    assert one["total"] == pytest.approx(2 * GPT_OSS_120B.active_params)
    many = weight_bytes_per_step(GPT_OSS_120B, 100_000)
    assert many["total"] == pytest.approx(2 * (GPT_OSS_120B.n_params - GPT_OSS_120B.embedding_params))
    q = weight_bytes_per_step(GPT_OSS_120B, 8, bits=BITS["int4 (g128)"])
    assert q["total"] == pytest.approx(weight_bytes_per_step(GPT_OSS_120B, 8)["total"] * 4.125 / 16)
    assert expert_intensity(DEEPSEEK_V3, 1) == pytest.approx(1.0)        # 2 FLOPs per 2-byte weight
    assert expert_intensity(DEEPSEEK_V3, 10_000) == pytest.approx(2 * 10_000 * 8 / (256 * 2))


def test_bad_input():
    with pytest.raises(ValueError, match="top_k"):
        expected_experts_touched(4, 5, 1)
    with pytest.raises(TypeError, match="batch_size"):
        expected_experts_touched(4, 2, 1.5)
    with pytest.raises(ValueError, match="popularity"):
        simulate_experts_touched(4, 2, 3, 5, popularity=torch.ones(3))
    with pytest.raises(TypeError, match="cfg"):
        weight_bytes_per_step("DeepSeek-V3", 1)
    with pytest.raises(ValueError, match="bits"):
        weight_bytes_per_step(DEEPSEEK_V3, 1, bits=0)
