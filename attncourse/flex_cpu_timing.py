r"""``python -m attncourse.flex_cpu_timing``: compiled FlexAttention on a CPU, block-sparse masks against causal and
no mask, stored in ``notebooks/results/ch11_flex_cpu.json`` for lesson 11 (section 2), which never compiles in its
default run: each new mask or length costs tens of seconds of compilation on a small CPU.

For every (length, mask) the script builds the ``BlockMask`` (tiles of 128), times the first compiled call (wall
clock: compilation included) and then 5 calls (CPU time, one thread), checks the compiled output against the
course's own attention on the materialised mask, and records the tiles the block mask visits
(:func:`attncourse.block_sparse.tile_states`). One process, one thread, one run: the times are this machine's.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

from . import masks
from .block_sparse import EMPTY, tile_states
from .sdpa import scaled_dot_product_attention
from .sparse import longformer

RESULTS = Path(__file__).resolve().parent.parent / "notebooks" / "results" / "ch11_flex_cpu.json"
LENGTHS, BLOCK, HEADS, DIM, REPEATS = (1024, 2048), 128, 4, 64, 5
MASKS = {"no mask": None, "causal": masks.causal, "sliding window 256": masks.sliding_window(256),
         "Longformer 256, 16 global": longformer(256, 16)}


def run() -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    torch.set_num_threads(1)
    torch.manual_seed(0)
    compiled = torch.compile(flex_attention)
    rows = []
    for t in LENGTHS:
        q, k, v = torch.randn(3, 1, HEADS, t, DIM).unbind(0)  # (B, H, T, D) each, float32
        for name, mod in MASKS.items():
            bm = None if mod is None else create_block_mask(mod, None, None, t, t, device="cpu", BLOCK_SIZE=BLOCK)
            start = time.perf_counter()
            out = compiled(q, k, v, block_mask=bm)
            first = time.perf_counter() - start
            dense = None if mod is None else masks.materialize(mod, t, t)
            torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, dense), rtol=1e-4, atol=1e-4)
            cpu = []
            for _ in range(REPEATS):
                start = time.process_time()
                compiled(q, k, v, block_mask=bm)
                cpu.append(time.process_time() - start)
            tiles = (t // BLOCK) ** 2 if mod is None else int((tile_states(mod, t, t, BLOCK, BLOCK) != EMPTY).sum())
            rows.append({"seq_len": t, "mask": name, "tiles_visited": tiles, "first_call_s": round(first, 2),
                         "cpu_s": [round(c, 5) for c in cpu]})
            print(rows[-1], flush=True)
    return {"date": date.today().isoformat(), "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, "
            "1 thread, shared with other jobs", "torch": torch.__version__, "heads": HEADS, "head_dim": DIM,
            "block": BLOCK, "rows": rows}


if __name__ == "__main__":
    record = run()
    RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {RESULTS}", file=sys.stderr)
