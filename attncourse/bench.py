"""Benchmarks of the attention implementations: time and peak extra memory against sequence length.

    python -m attncourse.bench flash                      # T = 1024..8192, B=1, H=8, D=64, float32, causal
    python -m attncourse.bench flash --lengths 512 1024 --mode fwd --threads 1

For each T it times our tiled `flash_attention` ("ours"), the course's plain attention that builds the
T x T weights ("naive", :func:`attncourse.scaled_dot_product_attention`) and PyTorch's fused kernel
("torch", ``F.scaled_dot_product_attention``), forward and forward+backward, and measures the peak
memory each needs beyond its inputs in a fresh Python process (so nothing allocated earlier hides or
inflates a peak). Chapter 09 calls :func:`time_attention` and :func:`peak_extra_memory` in ignored cells.

Memory is the process's peak resident set size during one call minus its size just before (Linux:
the high-water mark is reset through /proc/self/clear_refs before each call; elsewhere the child
uses ``ru_maxrss`` deltas, valid because peaks grow with T). The child runs with
``MALLOC_MMAP_THRESHOLD_`` set so that freed buffers go back to the OS at once and the resident size
tracks the live tensors.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from . import _validate
from .flash import default_block_sizes, flash_attention
from .sdpa import scaled_dot_product_attention

IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "ours": flash_attention,
    "naive": scaled_dot_product_attention,
    "torch": F.scaled_dot_product_attention,
}


def _impl(name: str) -> Callable[..., torch.Tensor]:
    if name not in IMPLS:
        raise ValueError(f"impl must be one of {sorted(IMPLS)}, got {name!r}")
    return IMPLS[name]


def _inputs(seq_len: int, batch: int, heads: int, head_dim: int, requires_grad: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq_len, head_dim, generator=g).requires_grad_(requires_grad)
            for _ in range(3)]  # (B, H, T, D) each


def _run_once(fn, q, k, v, causal: bool, backward: bool) -> None:
    if backward:
        out = fn(q, k, v, is_causal=causal)  # (B, H, T, D)
        out.backward(torch.ones_like(out))
        for x in (q, k, v):
            x.grad = None
    else:
        with torch.no_grad():
            fn(q, k, v, is_causal=causal)


def time_attention(impl: str, seq_len: int, *, backward: bool = False, batch: int = 1, heads: int = 8,
                   head_dim: int = 64, causal: bool = True, repeats: int = 5) -> float:
    """Best-of-`repeats` seconds of one call (forward, or forward + backward), after one warm-up call.

    A call slower than 5 s is timed once more only (the naive version at large T)."""
    for name, value in (("seq_len", seq_len), ("batch", batch), ("heads", heads), ("head_dim", head_dim),
                        ("repeats", repeats)):
        _validate.positive_int(name, value)
    fn = _impl(impl)
    q, k, v = _inputs(seq_len, batch, heads, head_dim, backward)
    start = time.perf_counter()
    _run_once(fn, q, k, v, causal, backward)  # warm-up
    if time.perf_counter() - start > 5:
        repeats = 1
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _run_once(fn, q, k, v, causal, backward)
        best = min(best, time.perf_counter() - start)
    return best


# ----------------------------------------------------------------------------- memory, in a child process


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
        return int(match.group(1)) * 1024 if match else None
    except OSError:
        return None


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter to the current RSS (Linux >= 4.0); False if unavailable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmHWM") is not None
    except OSError:
        return False


def _maxrss_bytes() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, kilobytes on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _measure_in_this_process(impl: str, lengths: list[int], backward: bool, batch: int, heads: int,
                             head_dim: int, causal: bool) -> list[int]:
    fn = _impl(impl)
    _run_once(fn, *_inputs(128, batch, heads, head_dim, backward), causal, backward)  # load kernels, pools
    extras = []
    for seq_len in lengths:
        q, k, v = _inputs(seq_len, batch, heads, head_dim, backward)
        gc.collect()
        if _reset_peak():
            before = _status_bytes("VmRSS")
            _run_once(fn, q, k, v, causal, backward)
            extras.append(max(0, _status_bytes("VmHWM") - before))
        else:
            before = _maxrss_bytes()
            _run_once(fn, q, k, v, causal, backward)
            extras.append(max(0, _maxrss_bytes() - before))
        del q, k, v
    return extras


def peak_extra_memory(impl: str, lengths: list[int], *, backward: bool = False, batch: int = 1,
                      heads: int = 8, head_dim: int = 64, causal: bool = True,
                      threads: int | None = None) -> list[int]:
    """Peak bytes one call needs beyond its inputs, for each length, measured in one fresh process.

    The gradients of q, k and v (allocated by the backward) count as extra memory."""
    for seq_len in lengths:
        _validate.positive_int("lengths", seq_len)
    _impl(impl)
    cmd = [sys.executable, "-m", "attncourse.bench", "_memory", impl, *map(str, lengths), "--batch", str(batch),
           "--heads", str(heads), "--dim", str(head_dim), "--threads", str(threads or torch.get_num_threads())]
    cmd += ["--backward"] if backward else []
    cmd += [] if causal else ["--no-causal"]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory measurement of {impl} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _naive_bytes_estimate(seq_len: int, batch: int, heads: int, backward: bool) -> int:
    # about 3 live T x T float32 buffers in the forward (scores, exp, weights), 6 with autograd's
    return batch * heads * seq_len * seq_len * 4 * (6 if backward else 3)


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return int(re.search(r"MemAvailable:\s+(\d+) kB", f.read()).group(1)) * 1024
    except (OSError, AttributeError):
        return None


# ----------------------------------------------------------------------------- the table


def flash_table(lengths: list[int], *, modes=("fwd", "fwd+bwd"), batch: int = 1, heads: int = 8,
                head_dim: int = 64, repeats: int = 5, memory: bool = True, print_rows: bool = True) -> list[dict]:
    """Rows {mode, T, time_<impl>, mem_<impl>, ...} for the flash benchmark (see the module docstring)."""
    available = _available_bytes()
    rows = []
    if print_rows:
        print(f"{'mode':8} {'T':>5} {'ours ms':>9} {'naive ms':>9} {'torch ms':>9} {'ours/torch':>10} "
              f"{'ours MiB':>9} {'naive MiB':>9} {'torch MiB':>9} {'naive/ours mem':>14}", flush=True)
    for mode in modes:
        backward = mode == "fwd+bwd"
        skip_naive = {t for t in lengths if available is not None
                      and _naive_bytes_estimate(t, batch, heads, backward) > 0.6 * available}
        mem = {}
        if memory:
            for impl in IMPLS:
                todo = [t for t in lengths if not (impl == "naive" and t in skip_naive)]
                mem[impl] = dict(zip(todo, peak_extra_memory(impl, todo, backward=backward, batch=batch,
                                                             heads=heads, head_dim=head_dim)))
        for t in lengths:
            row = {"mode": mode, "T": t}
            for impl in IMPLS:
                skip = impl == "naive" and t in skip_naive
                row[f"time_{impl}"] = None if skip else time_attention(
                    impl, t, backward=backward, batch=batch, heads=heads, head_dim=head_dim, repeats=repeats)
                row[f"mem_{impl}"] = mem.get(impl, {}).get(t)
            rows.append(row)
            if print_rows:
                print(_format_row(row), flush=True)
    return rows


def _format_row(row: dict) -> str:
    def ms(x):
        return f"{x * 1e3:9.1f}" if x is not None else f"{'skipped':>9}"

    def mib(x):
        return f"{x / 2**20:9.1f}" if x is not None else f"{'-':>9}"

    ratio = row["time_ours"] / row["time_torch"]
    mem_ratio = (f"{row['mem_naive'] / row['mem_ours']:14.1f}" if row["mem_naive"] and row["mem_ours"]
                 else f"{'-':>14}")
    return (f"{row['mode']:8} {row['T']:5d} {ms(row['time_ours'])} {ms(row['time_naive'])} "
            f"{ms(row['time_torch'])} {ratio:10.2f} {mib(row['mem_ours'])} {mib(row['mem_naive'])} "
            f"{mib(row['mem_torch'])} {mem_ratio}")


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - prints timings
    parser = argparse.ArgumentParser(prog="python -m attncourse.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    fl = sub.add_parser("flash", help="ours vs naive vs PyTorch: time and peak extra memory against T")
    fl.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    fl.add_argument("--mode", choices=["fwd", "fwd+bwd", "both"], default="both")
    fl.add_argument("--repeats", type=int, default=5)
    fl.add_argument("--no-memory", action="store_true", help="skip the memory measurements")
    mem = sub.add_parser("_memory", help=argparse.SUPPRESS)  # the child process of peak_extra_memory
    mem.add_argument("impl")
    mem.add_argument("lengths", type=int, nargs="+")
    mem.add_argument("--backward", action="store_true")
    mem.add_argument("--no-causal", action="store_true")
    for p in (fl, mem):
        p.add_argument("--batch", type=int, default=1)
        p.add_argument("--heads", type=int, default=8)
        p.add_argument("--dim", type=int, default=64)
        p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.command == "_memory":
        print(json.dumps(_measure_in_this_process(args.impl, args.lengths, args.backward, args.batch,
                                                  args.heads, args.dim, not args.no_causal)))
        return 0
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    print(f"flash benchmark: B={args.batch}, H={args.heads}, D={args.dim}, float32, causal; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} CPUs; load average "
          f"{load}; our default blocks (block_q, block_k): forward {default_block_sizes('cpu')}, "
          f"backward {default_block_sizes('cpu', backward=True)}")
    print("times: best of a few calls; memory: peak bytes beyond the inputs, in a fresh process")
    modes = ("fwd", "fwd+bwd") if args.mode == "both" else (args.mode,)
    flash_table(args.lengths, modes=modes, batch=args.batch, heads=args.heads, head_dim=args.dim,
                repeats=args.repeats, memory=not args.no_memory)
    if hasattr(os, "getloadavg"):
        print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
