"""Ring attention and Ulysses across real processes (gloo on 127.0.0.1) equal single-process attention.

Each world size is launched once (a module fixture) and runs every case, so the file stays fast on 2 cores.
"""

import pytest
import torch
import torch.multiprocessing as tmp
import torch.nn.functional as F

from attncourse import scaled_dot_product_attention
from attncourse.ring import (_attention_worker, distributed_attention, ring_attention, ring_bytes_per_rank,
                             run_distributed, ulysses_bytes_per_rank)

TIMEOUT = 90.0


def qkv(t, heads, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, t, 6, generator=g, dtype=torch.float64) for _ in range(3)]  # (B, H, T, D)


@pytest.fixture(scope="module")
def two_ranks():
    q, k, v = qkv(13, 2, 0)  # 13 positions over 2 ranks: blocks of 7 and 6
    return (q, k, v), distributed_attention(q, k, v, 2, methods=("ring",), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def four_ranks():
    q, k, v = qkv(12, 4, 1)
    return (q, k, v), distributed_attention(q, k, v, 4, methods=("ring", "ulysses"), timeout=TIMEOUT)


@pytest.mark.parametrize("is_causal", [False, True])
def test_ring_two_ranks_uneven_blocks(two_ranks, is_causal):
    (q, k, v), got = two_ranks
    out, sent, computed = got["ring", is_causal]
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, is_causal=is_causal), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal), rtol=1e-10, atol=1e-10)
    assert sent == [2 * 7 * 6 * 2 * 8, 2 * 6 * 6 * 2 * 8]  # one step: each rank sends its own k and v block
    assert computed == ([1, 2] if is_causal else [2, 2])  # causal: rank 0 skips the block after its own


@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_four_ranks_equal_single_process(four_ranks, method, is_causal):
    (q, k, v), got = four_ranks
    out, sent, computed = got[method, is_causal]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal), rtol=1e-10, atol=1e-10)
    if method == "ring":
        assert sent == [ring_bytes_per_rank(1, 4, 12, 6, 4, 8)] * 4
        assert computed == ([1, 2, 3, 4] if is_causal else [4] * 4)
    else:
        assert sent == [ulysses_bytes_per_rank(1, 4, 12, 6, 4, 8)] * 4


def test_byte_formulas():
    assert ring_bytes_per_rank(1, 8, 4096, 128, 1, 2) == 0
    assert ring_bytes_per_rank(2, 8, 4096, 128, 4, 2) == 2 * 3 * 2 * 8 * 1024 * 128 * 2
    assert ulysses_bytes_per_rank(1, 8, 4096, 128, 4, 2) == 4 * 8 * 1024 * 128 * 2 * 3 // 4
    with pytest.raises(ValueError, match="divisible"):
        ring_bytes_per_rank(1, 8, 10, 4, 3)
    with pytest.raises(ValueError, match="world_size"):
        ulysses_bytes_per_rank(1, 8, 12, 4, 0)


def test_bad_input_in_this_process():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(RuntimeError, match="process group"):
        ring_attention(q, q, q)
    with pytest.raises(ValueError, match=r"same positions.*\(1, 1, 4, 2\).*\(1, 1, 3, 2\)"):
        ring_attention(q, q[:, :, :3], q[:, :, :3])
    with pytest.raises(TypeError, match="is_causal"):
        ring_attention(q, q, q, is_causal=1)
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_attention_worker, 0)
    with pytest.raises(ValueError, match="importable"):
        run_distributed(lambda rank, world: rank, 2)  # defined here, not in a package module
    with pytest.raises(ValueError, match="methods"):
        distributed_attention(q, q, q, 2, methods=("star",))
    with pytest.raises(ValueError, match="at least world_size=8"):
        distributed_attention(q, q, q, 8)


def test_a_failing_rank_raises_here():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(tmp.ProcessRaisedException, match="same positions"):  # each rank gets a mismatched block
        run_distributed(_attention_worker, 2, q, q[:, :, :2], q[:, :, :2], ("ring",), (False,), timeout=TIMEOUT)
