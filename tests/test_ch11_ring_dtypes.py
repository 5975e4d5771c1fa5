"""Ring attention's mixed dtypes over real processes (gloo, 2 ranks): K and V travel in bfloat16, dK and dV are
summed and sent in float32 (`grad_dtype`), as ring-flash-attention does. The gradients equal autograd's on the same
bfloat16 inputs within bfloat16's rounding, and the bytes each rank hands to ``dist.isend`` equal what exercise 5's
checker measures with its stand-in process group (one launch, a few seconds)."""

import pytest
import torch
import torch.nn.functional as F

from attncourse.classroom.checks.ch11_ring import ring_bytes_measured
from attncourse.ring import ring_bytes_per_rank
from attncourse.ring_train import distributed_training_step

TIMEOUT = 90.0


def test_bfloat16_blocks_float32_gradients_on_two_ranks():
    g = torch.Generator().manual_seed(5)
    q, k, v, grad = (torch.randn(1, 2, 32, 8, generator=g).to(torch.bfloat16) for _ in range(4))  # (B, H, T, D)
    got = distributed_training_step(q, k, v, grad, 2, is_causal=True, timeout=TIMEOUT, grad_dtype=torch.float32)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]  # the same rounded inputs, exact arithmetic
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    (out * grad.double()).sum().backward()
    assert all(got[name].dtype == torch.bfloat16 for name in ("out", "dq", "dk", "dv"))  # returned as the inputs
    torch.testing.assert_close(got["out"].double(), out.detach(), rtol=1.6e-2, atol=1e-2)
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        torch.testing.assert_close(got[name].double(), leaf.grad, rtol=1.6e-2, atol=1e-2, msg=name)
    # forward: W - 1 = 1 block of K and V in bfloat16; backward: that block again, and W = 2 blocks of dK, dV in float32
    block = 1 * 2 * 16 * 8  # B * Hkv * (T / W) * D elements of K (or V)
    assert got["bytes"] == [ring_bytes_per_rank(1, 2, 32, 8, 2, 2)] * 2 == [2 * block * 2] * 2
    assert got["bytes_backward"] == [2 * block * 2 + 2 * 2 * block * 4] * 2
    assert got["bytes_backward"][0] == ring_bytes_measured(1, 2, 32, 8, 2, 2, grad_bytes=4)[1]


def test_grad_dtype_rejected_before_launch():
    x = torch.zeros(1, 1, 4, 2)
    with pytest.raises(TypeError, match="grad_dtype"):
        distributed_training_step(x, x, x, x, 2, grad_dtype="float32")
    with pytest.raises(TypeError, match="grad_dtype"):
        distributed_training_step(x, x, x, x, 2, grad_dtype=torch.int32)
