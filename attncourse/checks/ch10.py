"""Checks for chapter 10, FlashAttention in Triton (solutions/10_flash_attention_triton.ipynb).

Everything here is plain PyTorch: the exercises are about what one Triton program computes, and the checks
must load (in every notebook's `check` and in the grader) without importing Triton.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..online_softmax import AttentionState, online_attention_update
from ..sdpa import causal_mask, scaled_dot_product_attention
from . import Case, exercise


def _tile_mask(pid_q: int, start_k: int, block_q: int, block_k: int, t_q: int, t_k: int,
               is_causal: bool) -> torch.Tensor:
    """Reference: cut the tile out of the whole (Tq, Tk) mask, padded with False past the ends."""
    allowed = causal_mask(t_q, t_k) if is_causal else torch.ones(t_q, t_k, dtype=torch.bool)  # (Tq, Tk)
    rows, cols = pid_q * block_q + block_q, start_k + block_k
    padded = torch.zeros(max(rows, t_q), max(cols, t_k), dtype=torch.bool)
    padded[:t_q, :t_k] = allowed
    return padded[pid_q * block_q: rows, start_k: cols]  # (BLOCK_Q, BLOCK_K)


@exercise("10-tile-mask", "tile_mask", points=2,
          hint="rows = pid_q * block_q + arange(block_q), cols = start_k + arange(block_k); a pair is valid when "
               "row < t_q and col < t_k, and (with is_causal) col <= row: combine with broadcasting "
               "rows[:, None], cols[None, :]")
def _tile_mask_cases():
    """The (BLOCK_Q, BLOCK_K) mask of valid (query, key) pairs in one tile of a program."""
    cases = []
    for name, args in {
        "first tile, no padding, not causal": (0, 0, 4, 4, 8, 8, False),
        "diagonal tile, causal": (1, 4, 4, 4, 8, 8, True),
        "last query block past Tq = 10 (causal)": (2, 8, 4, 4, 10, 10, True),
        "key block past Tk = 6, Tq != Tk": (1, 4, 4, 4, 7, 6, False),
        "block_q != block_k, causal": (1, 0, 8, 4, 12, 12, True),
        "T = 1": (0, 0, 16, 16, 1, 1, True),
    }.items():
        cases.append(Case(name, args, expected=_tile_mask(*args), compare="equal"))
    return cases


def _online_update(m, l, acc, s, v):
    """Reference: one key block of the online softmax (chapter 08's update, natural exp), per query row."""
    return tuple(online_attention_update(AttentionState(m, l, acc), s, v))  # (BQ,), (BQ,), (BQ, D)


@exercise("10-online-update", "online_update", points=3,
          forbid=("torch.nn.functional.scaled_dot_product_attention", "torch.softmax"),
          hint="m_new = max(m, row max of s); alpha = exp(m - m_new) rescales l and acc; p = exp(s - m_new[:, None]); "
               "l_new = alpha * l + p.sum(-1); acc_new = alpha[:, None] * acc + p @ v")
def _online_update_cases():
    """The inner loop's update of (m, l, acc) for one block of scores, with the rescaling."""
    gen = torch.Generator().manual_seed(10)
    bq, bk, d = 4, 5, 3
    s1 = torch.randn(bq, bk, generator=gen, dtype=torch.float64)
    v1 = torch.randn(bk, d, generator=gen, dtype=torch.float64)
    start = (torch.full((bq,), float("-inf"), dtype=torch.float64), torch.zeros(bq, dtype=torch.float64),
             torch.zeros(bq, d, dtype=torch.float64))
    after1 = _online_update(*start, s1, v1)
    s2 = torch.randn(bq, bk, generator=gen, dtype=torch.float64) + 3.0  # larger scores: the max moves up
    v2 = torch.randn(bk, d, generator=gen, dtype=torch.float64)
    s3 = s2.clone()
    s3[1] = float("-inf")  # row 1 sees no key of this block (causal or padding)
    s3[2, 3:] = float("-inf")
    cases = [
        Case("first block (m = -inf, l = 0, acc = 0)", (*start, s1, v1), expected=after1),
        Case("second block, larger scores: alpha < 1", (*after1, s2, v2), expected=_online_update(*after1, s2, v2)),
        Case("second block with masked (-inf) scores", (*after1, s3, v2), expected=_online_update(*after1, s3, v2)),
    ]
    # After all blocks, acc / l must be the attention output: the update is checked against the oracle too.
    q = torch.randn(bq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(2 * bk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(2 * bk, d, generator=gen, dtype=torch.float64)
    scores = q @ k.T / math.sqrt(d)  # (BQ, D) @ (D, 2 BK) -> (BQ, 2 BK)
    m, l, acc = _online_update(*start, scores[:, :bk], v[:bk])
    m, l, acc = _online_update(m, l, acc, scores[:, bk:], v[bk:])
    torch.testing.assert_close(acc / l[:, None], scaled_dot_product_attention(q, k, v))  # the reference is right
    big = s1 * 50
    cases.append(Case("large scores (x 50): no overflow", (*start, big, v1), expected=_online_update(*start, big, v1)))
    return cases


@exercise("10-causal-blocks", "causal_key_blocks", points=2,
          hint="query rows of program pid_q run up to min((pid_q + 1) * block_q, t_q) - 1 and row i needs keys "
               "0..i, so keys below hi = min(t_k, t_q, (pid_q + 1) * block_q) are needed: ceil(hi / block_k) blocks")
def _causal_blocks_cases():
    """How many key blocks one causal program visits: the skip bound of the kernel's loop."""
    cases = []
    for args in ((0, 32, 32, 100, 100), (3, 32, 32, 100, 100), (1, 64, 16, 100, 100), (2, 16, 64, 100, 100),
                 (0, 16, 16, 1, 1), (3, 32, 32, 100, 40), (1, 32, 16, 40, 100)):
        pid_q, block_q, block_k, t_q, t_k = args
        # Reference: count the key blocks holding at least one allowed (row, key) pair of this program's rows.
        n_blocks = math.ceil(t_k / block_k)
        needed = sum(bool(_tile_mask(pid_q, b * block_k, block_q, block_k, t_q, t_k, True).any())
                     for b in range(n_blocks))
        cases.append(Case(f"pid_q={pid_q}, BLOCK_Q={block_q}, BLOCK_K={block_k}, Tq={t_q}, Tk={t_k}", args,
                          expected=needed, compare="equal"))
    return cases


@exercise("10-tflops", "attention_tflops", points=1,
          hint="two matmuls (Q K^T and P V), each 2 * Tq * Tk * D FLOPs per (batch, head); halve it when causal; "
               "TFLOP/s = FLOPs / (ms * 1e-3) / 1e12")
def _tflops_cases():
    """Throughput of an attention forward from its timing: FLOPs / seconds, in TFLOP/s."""
    cases = []
    for batch, heads, t, d, causal, ms in ((4, 16, 4096, 64, False, 1.5), (4, 16, 4096, 64, True, 0.9),
                                           (1, 1, 1024, 128, False, 0.01), (2, 8, 16384, 128, True, 12.0)):
        q = torch.empty(batch, heads, t, d, device="meta")  # no memory: only shapes, for PyTorch's FLOP counter
        with FlopCounterMode(display=False) as counter:
            q @ q.transpose(-2, -1) @ q  # the two matmuls of attention, (T, D) @ (D, T) then (T, T) @ (T, D)
        flops = counter.get_total_flops() * (0.5 if causal else 1.0)  # causal: half the (query, key) pairs
        cases.append(Case(f"B={batch}, H={heads}, T={t}, D={d}, causal={causal}, {ms} ms",
                          (batch, heads, t, d, causal, ms), expected=flops / (ms * 1e-3) / 1e12,
                          rtol=1e-6, atol=1e-9))
    return cases
