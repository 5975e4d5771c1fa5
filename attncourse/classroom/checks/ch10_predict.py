"""Chapter 10's prediction (solutions/10_flash_attention_triton.ipynb, exercise 4): the programs and K/V bytes of a
decode step, written as a rule of the step's configuration (the guarded-function form: plain integers, no tensor
operation, the package's decode_work and this module's reference refused)."""

from __future__ import annotations

import torch

from . import Case, exercise
from .ch10 import _triton_decode


DECODE_QUESTION = dict(batch=2, heads=64, kv_heads=8, k_len=8192, head_dim=128, num_splits=16, bytes_per_element=2)
DECODE_PARTS = ("programs, one per query head", "programs, one per KV head", "K and V bytes, one per query head",
                "K and V bytes, one per KV head", "programs, one per KV head and split",
                "keys per program, with splits")


def _decode_expected(batch, heads, kv_heads, k_len, head_dim, num_splits, bytes_per_element):
    """The six parts from the package's decode_work (the checker's reference: the learner may not call it)."""
    td = _triton_decode()
    args = (batch, heads, kv_heads, k_len, head_dim)
    plain = td.decode_work(*args, pack_gqa=False, bytes_per_element=bytes_per_element)
    packed = td.decode_work(*args, bytes_per_element=bytes_per_element)
    split = td.decode_work(*args, num_splits=num_splits, bytes_per_element=bytes_per_element)
    return (plain["programs"], packed["programs"], plain["kv_bytes"], packed["kv_bytes"], split["programs"],
            split["keys_per_program"])


@exercise("10-predict-decode", "decode_prediction", points=2, category="predict", parts=DECODE_PARTS,
          forbid=("attncourse.triton_decode.decode_work", "attncourse.triton_decode.default_num_splits",
                  "attncourse.triton_decode.decode_configs"),
          allow=(), ops=("torch",),
          prop_doc="the prediction is a count in plain integers, written as a function of the model's shape, the "
                   "cache length, the splits and the element size so that no package call (decode_work, the "
                   "checker's reference) can stand in for it: equal counts on every configuration are the skill",
          hint="one program per query head reads its KV head's whole cache, so a KV head is read once per query "
               "head of its group; one program per KV head reads it once. Bytes: K and V, every cached position, "
               "every head dim, bytes_per_element each, times the number of readers. Splitting multiplies the "
               "programs and divides the keys each one streams (a cache that does not divide evenly leaves the "
               "last split short: the busiest program streams the rounded-up share)")
def _predict_decode_cases():
    """Predict (programs and K/V bytes of the plain and the packed grid, programs and keys per program with splits)
    of one decode step, as a function of (batch, heads, kv_heads, k_len, head_dim, num_splits, bytes_per_element)."""
    gen = torch.Generator().manual_seed(104)  # two more configurations, drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    configs = [("B=2, H=64, Hkv=8, Tk=8192, D=128, float16, 16 splits (the exercise's step)", DECODE_QUESTION)]
    for _ in range(2):
        kv_heads = 2 ** pick(0, 3)
        splits = pick(2, 40)
        cfg = dict(batch=pick(1, 8), heads=kv_heads * 2 ** pick(0, 3), kv_heads=kv_heads,
                   k_len=splits * pick(16, 512) + pick(1, splits - 1), head_dim=32 * pick(1, 8), num_splits=splits,
                   bytes_per_element=2 ** pick(0, 2))
        configs.append((", ".join(f"{k}={v}" for k, v in cfg.items()), cfg))
    return [Case(name, tuple(cfg.values()), expected=_decode_expected(**cfg), compare="equal")
            for name, cfg in configs]
