"""Ring attention (forward and backward rings, contiguous and zigzag layouts) and Ulysses across real processes
(gloo on 127.0.0.1) equal single-process attention and its gradients.

Each world size is launched a few times (module fixtures run every case of a launch), so the file stays fast on
2 cores.
"""

import pytest
import torch
import torch.multiprocessing as tmp
import torch.nn.functional as F

from attncourse import scaled_dot_product_attention
from attncourse.ring import (_attention_worker, distributed_attention, ring_attention, ring_bytes_per_rank,
                             ring_chunks, ring_pair_work, run_distributed, ulysses_bytes_per_rank)
from attncourse.classroom.checks.ch11_ring import ring_bytes_measured
from attncourse.ring_train import distributed_training_step, ring_overlap_timing

TIMEOUT = 90.0


def qkv(t, heads, seed, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, t, 6, generator=g, dtype=torch.float64) for _ in range(n)]  # (B, H, T, D)


@pytest.fixture(scope="module")
def four_ranks():
    q, k, v = qkv(16, 4, 1)
    return (q, k, v), distributed_attention(q, k, v, 4, methods=("ring", "ulysses"), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def zigzag_two_ranks():
    q, k, v = qkv(12, 2, 2)
    return (q, k, v), distributed_attention(q, k, v, 2, methods=("ring",), layout="zigzag", timeout=TIMEOUT)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_four_ranks_equal_single_process(four_ranks, method, is_causal):
    (q, k, v), got = four_ranks
    out, sent, pairs = got[method, is_causal]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, is_causal=is_causal), rtol=1e-10, atol=1e-10)
    if method == "ring":
        assert sent == [ring_bytes_per_rank(1, 4, 16, 6, 4, 8)] * 4
        c = 4  # positions per rank
        assert pairs == ([c * (c + 1) // 2 + r * c * c for r in range(4)] if is_causal else [16 * 4] * 4)
    else:
        assert sent == [ulysses_bytes_per_rank(1, 4, 16, 6, 4, 8)] * 4


@pytest.mark.parametrize("is_causal", [False, True])
def test_zigzag_equals_single_process_and_balances(zigzag_two_ranks, is_causal):
    (q, k, v), got = zigzag_two_ranks
    out, sent, pairs = got["ring", is_causal]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal), rtol=1e-10, atol=1e-10)
    assert pairs == ring_pair_work(12, 2, is_causal=is_causal, layout="zigzag")
    assert len(set(pairs)) == 1  # every rank scores as many pairs
    assert sum(pairs) == (12 * 13 // 2 if is_causal else 144)


@pytest.mark.parametrize("world,layout,is_causal,overlap", [(2, "contiguous", True, True), (2, "zigzag", False, True),
                                                            (4, "zigzag", True, True), (4, "contiguous", False, True),
                                                            (3, "zigzag", True, False)])
def test_backward_ring_gradients_equal_single_process(world, layout, is_causal, overlap):
    q, k, v, g = qkv(24, 2, 3 + world, n=4)
    got = distributed_training_step(q, k, v, g, world, is_causal=is_causal, layout=layout, timeout=TIMEOUT,
                                    overlap=overlap)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=is_causal)
    (out * g).sum().backward()
    torch.testing.assert_close(got["out"], out.detach(), rtol=1e-10, atol=1e-10)
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        torch.testing.assert_close(got[name], leaf.grad, rtol=1e-9, atol=1e-10, msg=name)
    assert got["pairs"] == ring_pair_work(24, world, is_causal=is_causal, layout=layout)
    # bytes counted at dist.isend on every rank, forward and backward, against the formula and against the
    # checker's measurement (the same function run with a stand-in process group on the meta device)
    assert got["bytes"] == [ring_bytes_per_rank(1, 2, 24, 6, world, 8)] * world
    assert got["bytes_backward"] == [ring_bytes_measured(1, 2, 24, 6, world, 8)[1]] * world  # either layout


def test_overlap_timing_returns_both_modes():
    got = ring_overlap_timing(2, seq_len=8, n_heads=1, head_dim=4, repeats=3, timeout=TIMEOUT)
    assert set(got) == {"overlap", "serial", "overlap_wait", "serial_wait"}
    assert all(len(v) == 3 and all(0 <= x < 60 for x in v) for v in got.values())
    assert all(w <= t for w, t in zip(got["serial_wait"], got["serial"]))  # blocked time is part of the step
    with pytest.raises(ValueError, match="divisible"):
        ring_overlap_timing(3, seq_len=8)


def test_pair_work_contiguous_is_unbalanced_zigzag_is_not():
    contiguous = ring_pair_work(4096, 8, layout="contiguous")
    zigzag = ring_pair_work(4096, 8, layout="zigzag")
    assert sum(contiguous) == sum(zigzag) == 4096 * 4097 // 2  # the same causal pairs, split differently
    assert contiguous[-1] > 14 * contiguous[0] and len(set(zigzag)) == 1
    assert ring_pair_work(64, 4, is_causal=False) == [64 * 16] * 4
    assert ring_chunks(3, "zigzag") == [[0, 5], [1, 4], [2, 3]]


def test_byte_formulas():
    assert ring_bytes_per_rank(1, 8, 4096, 128, 1, 2) == 0
    assert ring_bytes_per_rank(2, 8, 4096, 128, 4, 2) == 2 * 3 * 2 * 8 * 1024 * 128 * 2
    # (W-1)/W of each local block: q and out with H heads, k and v with Hkv heads
    assert ulysses_bytes_per_rank(1, 8, 4096, 128, 4, 2) == 4 * 8 * 1024 * 128 * 2 * 3 // 4
    assert ulysses_bytes_per_rank(1, 8, 4096, 128, 4, 2, n_kv_heads=4) == (2 * 8 + 2 * 4) * 1024 * 128 * 2 * 3 // 4
    with pytest.raises(ValueError, match="divisible"):
        ring_bytes_per_rank(1, 8, 10, 4, 3)
    with pytest.raises(ValueError, match="world_size"):
        ulysses_bytes_per_rank(1, 8, 12, 4, 0)
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        ulysses_bytes_per_rank(1, 8, 16, 4, 4, n_kv_heads=2)


def test_bad_input_in_this_process():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(RuntimeError, match="process group"):
        ring_attention(q, q, q)
    with pytest.raises(ValueError, match=r"same positions.*\(1, 1, 4, 2\).*\(1, 1, 3, 2\)"):
        ring_attention(q, q[:, :, :3], q[:, :, :3])
    with pytest.raises(TypeError, match="is_causal"):
        ring_attention(q, q, q, is_causal=1)
    with pytest.raises(ValueError, match="layout"):
        ring_attention(q, q, q, layout="striped")
    with pytest.raises(TypeError, match="overlap"):
        ring_attention(q, q, q, overlap=1)
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_attention_worker, 0)
    with pytest.raises(ValueError, match="importable"):
        run_distributed(lambda rank, world: rank, 2)  # defined here, not in a package module
    with pytest.raises(ValueError, match="methods"):
        distributed_attention(q, q, q, 2, methods=("star",))
    with pytest.raises(ValueError, match="at least world_size=8"):
        distributed_attention(q, q, q, 8)
    with pytest.raises(ValueError, match="divisible by 4 chunks"):
        distributed_training_step(q[:, :, :3], q[:, :, :3], q[:, :, :3], q[:, :, :3], 2, layout="zigzag")


def test_a_failing_rank_raises_here():
    x = torch.randn(1, 1, 5, 2)  # 5 positions over 2 ranks: blocks of 3 and 2, which the ring refuses on every rank
    with pytest.raises(tmp.ProcessRaisedException, match="same number of positions"):
        run_distributed(_attention_worker, 2, x, x, x, ("ring",), (False,), timeout=TIMEOUT)
