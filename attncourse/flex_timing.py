"""MoBA's selection as a FlexAttention ``BlockMask``, compiled on the CPU and timed (chapter 14, stored run).

Chapter 14 builds the selection's ``BlockMask`` and runs ``flex_attention`` eagerly, which computes every score and
masks. Compiled, the kernel visits only the key blocks the mask lists for each tile of queries. This script compiles
``flex_attention`` once (``torch.compile``, inductor's CPU backend) and times, in one process and on one thread:

- the compiled kernel with MoBA's ``BlockMask`` (queries an AR(1) sequence, so that neighbouring queries choose alike
  and a tile's union of choices is a fraction of the causal blocks; lesson section 2);
- the same compiled kernel with a causal ``BlockMask`` (every causal block listed): the kernel's dense work;
- PyTorch's fused dense causal attention (``F.scaled_dot_product_attention``, the baseline to beat; timing only).

Each is checked against dense attention under the same token mask first. Times are medians of interleaved runs on
one thread of a shared CPU: the ratios, not the milliseconds, are the result, and they are this machine's. The
compile itself takes tens of seconds to minutes, so neither the lesson's default run nor the tests compile:
``FULL=1 python -m attncourse.flex_timing`` writes ``notebooks/results/ch14_flex_compiled.json``.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .learned_sparse import blocks_to_mask, moba_gate

T, H, D, BLOCK, TOP_K = 4096, 4, 64, 128, 4


def ar1_queries(rho: float, seed: int, shape=(1, H, T, D)) -> torch.Tensor:
    """Queries along the sequence as an AR(1) process with correlation `rho` between neighbours (unit variance)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*shape, generator=g)
    q = torch.empty_like(z)
    q[..., 0, :] = z[..., 0, :]
    for t in range(1, shape[-2]):
        q[..., t, :] = rho * q[..., t - 1, :] + (1 - rho ** 2) ** 0.5 * z[..., t, :]
    return q


def moba_block_mask(selected: torch.Tensor, block: int):
    """The ``BlockMask`` of a selection (B, H, T, nB): per tile of `block` queries the union of the blocks its
    queries chose; inside a block, the query's own choice and causality."""
    from torch.nn.attention.flex_attention import BlockMask

    B, Hh, Tq, nB = selected.shape
    union = selected.view(B, Hh, Tq // block, block, nB).any(3)  # (B, H, tiles, nB)
    order = union.int().argsort(dim=-1, descending=True, stable=True).int()

    def mask_mod(b, h, q_idx, kv_idx):
        return selected[b, h, q_idx, kv_idx // block] & (kv_idx <= q_idx)

    return BlockMask.from_kv_blocks(union.sum(-1).int(), order, BLOCK_SIZE=(block, block), mask_mod=mask_mod), union


def median_ms(fns: dict, runs: int = 5) -> dict:
    """Median milliseconds of each function, the runs interleaved so that a change of load hits all alike."""
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {name: sorted(ts)[runs // 2] for name, ts in times.items()}


def main(path: str | Path = "notebooks/results/ch14_flex_compiled.json", rhos=(0.99, 0.999), seed: int = 0) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.set_num_threads(1)
    compiled = torch.compile(flex_attention)
    k, v = torch.randn(2, 1, H, T, D, generator=torch.Generator().manual_seed(seed + 100)).unbind(0)
    causal = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, T, T, device="cpu", BLOCK_SIZE=BLOCK)
    result = {"config": {"T": T, "heads": H, "head_dim": D, "block": BLOCK, "top_k": TOP_K, "seed": seed,
                         "threads": 1, "torch": torch.__version__, "machine": platform.machine(),
                         "processor": platform.processor() or "unknown",
                         "load_average": [round(x, 1) for x in os.getloadavg()]}, "runs": {}}
    q0 = ar1_queries(rhos[0], seed)
    t0 = time.perf_counter()
    out = compiled(q0, k, v, block_mask=causal)  # the first call compiles
    result["compile_s"] = round(time.perf_counter() - t0, 1)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q0, k, v, is_causal=True), rtol=1e-4, atol=1e-4)
    n_tiles = T // BLOCK
    causal_blocks = H * n_tiles * (n_tiles + 1) // 2  # (query tile, key block) pairs of causal attention, all heads
    for rho in rhos:
        q = ar1_queries(rho, seed)
        sel = moba_gate(q, k, BLOCK, TOP_K)  # (1, H, T, nB)
        mask, union = moba_block_mask(sel, BLOCK)
        t0 = time.perf_counter()
        out = compiled(q, k, v, block_mask=mask)  # a new mask_mod: may recompile
        first_s = time.perf_counter() - t0
        err = float((out - F.scaled_dot_product_attention(q, k, v, attn_mask=blocks_to_mask(sel, BLOCK, T))).abs().max())
        assert err < 1e-4, err
        ms = median_ms({"moba": lambda: compiled(q, k, v, block_mask=mask),
                        "causal": lambda: compiled(q, k, v, block_mask=causal),
                        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)})
        result["runs"][str(rho)] = {"listed_blocks": int(union.sum()), "causal_blocks": causal_blocks,
                                    "max_abs_err": err, "first_call_s": round(first_s, 1),
                                    "ms": {name: round(t, 2) for name, t in ms.items()}}
        print(rho, result["runs"][str(rho)], flush=True)
        Path(path).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    if os.environ.get("FULL") != "1":
        raise SystemExit("set FULL=1: compiling flex_attention takes tens of seconds to minutes")
    main(os.environ.get("OUT", "notebooks/results/ch14_flex_compiled.json"))
