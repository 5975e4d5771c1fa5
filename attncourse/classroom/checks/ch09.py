"""Checks for chapter 09, FlashAttention by tiling (solutions/09_flash_attention.ipynb)."""

from __future__ import annotations

import math

import torch

from attncourse.flash import causal_block_counts, flash_attention_forward, hbm_traffic_flash, hbm_traffic_standard
from attncourse.sdpa import apply_mask, scaled_dot_product_attention
from . import Case, exercise

HBM_QUESTION = dict(seq_len=4096, head_dim=128, sram=65536)  # the values the exercise asks about


def _state_check(out_expected: torch.Tensor, lse_expected: torch.Tensor):
    """Compare a returned (m, l, acc) by what it means: acc / l is the output, m + log l the lse.

    (m itself may be any value that keeps the exponentials finite, so it is not compared directly.)"""

    def compare(got) -> str | None:
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            return f"expected a tuple (m, l, acc) of 3 tensors, got {type(got).__name__}"
        m, l, acc = got
        for name, x, shape in (("m", m, lse_expected.shape + (1,)), ("l", l, lse_expected.shape + (1,)),
                               ("acc", acc, out_expected.shape)):
            if not isinstance(x, torch.Tensor):
                return f"{name} should be a tensor, got {type(x).__name__}"
            if tuple(x.shape) != tuple(shape):
                return (f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} "
                        "(keep the last dim with keepdim=True)")
            if not torch.isfinite(x).all():
                return (f"{name} holds NaN or inf: did you subtract the new running max before exp, "
                        "and handle the empty state m = -inf?")
        out = acc.double() / l.double()
        if not torch.allclose(out, out_expected.double(), rtol=1e-6, atol=1e-8):
            bad = (~torch.isclose(out, out_expected.double(), rtol=1e-6, atol=1e-8)).nonzero()[0].tolist()
            return (f"acc / l is not the attention output over all keys seen so far; first difference at "
                    f"index {tuple(bad)}: expected {out_expected[tuple(bad)].item():.6g}, got "
                    f"{out[tuple(bad)].item():.6g}")
        lse = (m.double() + torch.log(l.double())).squeeze(-1)
        if not torch.allclose(lse, lse_expected.double(), rtol=1e-6, atol=1e-8):
            bad = (~torch.isclose(lse, lse_expected.double(), rtol=1e-6, atol=1e-8)).nonzero()[0].tolist()
            return (f"m + log(l) is not the log-sum-exp of the scores seen so far; first difference at index "
                    f"{tuple(bad)}: expected {lse_expected[tuple(bad)].item():.6g}, got {lse[tuple(bad)].item():.6g}")
        return None

    return compare


@exercise("09-tile-update", "tile_update", points=3,
          forbid=("torch.nn.functional.scaled_dot_product_attention",),
          hint="m_new = max(m, rowmax(s)); p = exp(s - m_new); alpha = exp(m - m_new); "
               "l_new = alpha * l + rowsum(p); acc_new = alpha * acc + p @ v_tile")
def _tile_update():
    """One step of the tiled forward's inner loop: fold a tile of scores into (m, l, acc)."""
    gen = torch.Generator().manual_seed(9)
    cases = []
    n, bq, d, dv = 3, 5, 8, 4
    for name, (n_prev, n_tile, mult, masked) in {
        "first tile: empty state (m = -inf, l = 0, acc = 0)": (0, 6, 1.0, False),
        "second tile of 7 keys after 6": (6, 7, 1.0, False),
        "huge scores (x 300): exp overflows even in float64 unless shifted": (6, 7, 300.0, False),
        "a tile whose keys are all masked (-inf) for some rows": (6, 7, 1.0, True),
    }.items():
        q = torch.randn(n, bq, d, generator=gen, dtype=torch.float64) * mult
        k = torch.randn(n, n_prev + n_tile, d, generator=gen, dtype=torch.float64)
        v = torch.randn(n, n_prev + n_tile, dv, generator=gen, dtype=torch.float64)
        keep = torch.ones(bq, n_prev + n_tile, dtype=torch.bool)
        if masked:
            keep[1:4, n_prev:] = False  # rows 1..3 see nothing in the new tile
            keep[2, n_prev + 3] = True  # ... except row 2, which sees one key
        scores = apply_mask(q @ k.transpose(1, 2) / math.sqrt(d), keep)  # (N, Bq, D) @ (N, D, T) -> (N, Bq, T)
        prev, tile = scores[..., :n_prev], scores[..., n_prev:]
        if n_prev == 0:
            m = torch.full((n, bq, 1), float("-inf"), dtype=torch.float64)
            l = torch.zeros(n, bq, 1, dtype=torch.float64)
            acc = torch.zeros(n, bq, dv, dtype=torch.float64)
        else:
            m = prev.amax(-1, keepdim=True)  # (N, Bq, 1)
            p = torch.exp(prev - m)  # (N, Bq, n_prev)
            l, acc = p.sum(-1, keepdim=True), p @ v[:, :n_prev]  # (N, Bq, 1), (N, Bq, Dv)
        out = scaled_dot_product_attention(q, k, v, keep)  # the oracle over all keys seen
        if masked:
            lse = torch.logsumexp(scores, dim=-1)
        else:
            lse = flash_attention_forward(q, k, v, block_q=2, block_k=4)[1]
        cases.append(Case(name, (m, l, acc, tile.contiguous(), v[:, n_prev:].contiguous()),
                          compare=_state_check(out, lse)))
    return cases


@exercise("09-rescale-bug", "fixed_tiled_attention", points=2,
          forbid=("torch.nn.functional.scaled_dot_product_attention",),
          hint="when the running max grows, everything accumulated so far was weighted by e^(s - m_old): "
               "multiply acc (not only l) by alpha = exp(m_old - m_new) before adding the new tile")
def _rescale_bug():
    """Find and fix the bug in a tiled attention that forgets to rescale its accumulator."""
    gen = torch.Generator().manual_seed(10)
    cases = []
    for name, (lead, tq, tk, d, block_k) in {
        "(2, 3, 6, 8) over 20 keys, blocks of 4": ((2, 3), 6, 20, 8, 4),
        "(1, 1, 3, 16) over 7 keys, blocks of 3 (ragged last block)": ((1, 1), 3, 7, 16, 3),
        "one block of keys (block_k >= T_k)": ((2,), 4, 5, 8, 8),
        "blocks of 1 key": ((1, 2), 5, 9, 4, 1),
    }.items():
        q = torch.randn(*lead, tq, d, generator=gen, dtype=torch.float64)
        k = torch.randn(*lead, tk, d, generator=gen, dtype=torch.float64)
        v = torch.randn(*lead, tk, d, generator=gen, dtype=torch.float64)
        k = k * torch.linspace(0.5, 3.0, tk, dtype=torch.float64)[:, None]  # later keys score higher
        cases.append(Case(name, (q, k, v, block_k), expected=scaled_dot_product_attention(q, k, v),
                          rtol=1e-7, atol=1e-9))
    return cases


@exercise("09-causal-skip", "count_skipped_tiles", points=2,
          hint="query i sees keys 0..i; a tile is skipped when its first key comes after its last query: "
               "k_start > min(q_start + block_q, q_len) - 1")
def _causal_skip():
    """Count the tiles a causal tiled pass never visits."""
    cases = []
    for args in [(8, 8, 4, 4), (1024, 1024, 128, 128), (1000, 1000, 128, 64), (10, 7, 3, 2), (7, 10, 2, 3),
                 (5, 5, 8, 8), (300, 300, 1, 100)]:
        cases.append(Case(f"q_len={args[0]}, k_len={args[1]}, block_q={args[2]}, block_k={args[3]}", args,
                          expected=causal_block_counts(*args)["skipped"], compare="equal"))
    return cases


@exercise("09-predict-hbm", "hbm_prediction", kind="value", points=2,
          hint="standard: reads 3Nd + 2N^2, writes 2N^2 + Nd. Flash: B_c = ceil(M / 4d), T_c = ceil(N / B_c); "
               "reads 2Nd + T_c (2Nd + 2N), writes Nd + 2N + T_c (Nd + 2N)")
def _predict_hbm():
    """Predict the HBM elements moved by standard attention and FlashAttention for N=4096, d=128, M=65536."""
    n, d, m = HBM_QUESTION["seq_len"], HBM_QUESTION["head_dim"], HBM_QUESTION["sram"]
    expected = (hbm_traffic_standard(n, d).total, hbm_traffic_flash(n, d, m).total)
    return [Case("(standard total, flash total) for N=4096, d=128, M=65536", expected=expected, compare="equal")]
