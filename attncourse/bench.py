"""Benchmarks of the attention implementations: time and peak extra memory against sequence length.

    python -m attncourse.bench flash                      # T = 1024..8192, B=1, H=8, D=64, float32, causal
    python -m attncourse.bench flash --lengths 512 1024 --mode fwd --threads 1

For each T it compares our tiled `flash_attention` ("ours") with PyTorch's fused CPU kernel ("torch",
``F.scaled_dot_product_attention``), forward and forward+backward, as the **median ratio of paired,
alternating runs in one process** (each pair times ours and torch back to back, the order alternating from pair
to pair, so a load spike on a shared machine hits both sides of a pair); it times the course's plain attention
that builds the T x T weights ("naive", :func:`attncourse.scaled_dot_product_attention`) once where it fits.

Memory is measured two ways. :func:`tensor_bytes_peak` counts the bytes of the tensors a call creates that are
alive at the same time (a dispatch mode sees every op, the backward's included): exact and machine-independent,
so chapter 09's lesson prints it and nbval compares it. Buffers a C++ kernel allocates without making tensors
(PyTorch's fused kernel keeps per-thread tiles that way) are not seen, which is why the process-level
measurement stays as a cross-check. Chapter 09 calls :func:`time_attention`, :func:`tensor_bytes_peak` and
:func:`peak_extra_memory`.

Process-level memory:
the process's peak resident set size during one call minus its size just before (Linux:
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
import statistics
from typing import Callable

import torch
import torch.nn.functional as F

from . import _validate
from .chunked import _StorageTracker
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


def paired_ratio(impl: str, other: str, seq_len: int, *, backward: bool = False, batch: int = 1, heads: int = 8,
                 head_dim: int = 64, causal: bool = True, pairs: int = 7) -> dict:
    """Median over `pairs` of time(impl) / time(other), each pair run back to back in this process, the order
    alternating from pair to pair, after one warm-up call of each. Returns {"ratio", "ratios", "time_<impl>",
    "time_<other>"} (median seconds)."""
    for name, value in (("seq_len", seq_len), ("pairs", pairs)):
        _validate.positive_int(name, value)
    fns = {impl: _impl(impl), other: _impl(other)}
    q, k, v = _inputs(seq_len, batch, heads, head_dim, backward)
    for fn in fns.values():
        _run_once(fn, q, k, v, causal, backward)  # warm-up
    times: dict[str, list[float]] = {impl: [], other: []}
    for i in range(pairs):
        for name in ((impl, other) if i % 2 == 0 else (other, impl)):
            start = time.perf_counter()
            _run_once(fns[name], q, k, v, causal, backward)
            times[name].append(time.perf_counter() - start)
    ratios = [a / b for a, b in zip(times[impl], times[other])]
    return {"ratio": statistics.median(ratios), "ratios": ratios, f"time_{impl}": statistics.median(times[impl]),
            f"time_{other}": statistics.median(times[other])}


# ----------------------------------------------------------------------------- memory: tensor bytes, exact


def tensor_bytes_peak(impl: str, seq_len: int, *, backward: bool = False, batch: int = 1, heads: int = 8,
                      head_dim: int = 64, causal: bool = True) -> int:
    """Peak bytes of the tensors one call creates (forward, or forward + backward with the gradients of q, k, v)
    that are alive at the same time; inputs not counted. Exact and machine-independent."""
    _validate.positive_int("seq_len", seq_len)
    fn = _impl(impl)
    q, k, v = _inputs(seq_len, batch, heads, head_dim, backward)
    gc.collect()
    tracker = _StorageTracker()  # chapter 11's exact tensor-bytes counter
    with tracker:
        _run_once(fn, q, k, v, causal, backward)
    return tracker.peak


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
                head_dim: int = 64, pairs: int = 7, process_memory: bool = True, print_rows: bool = True) -> list[dict]:
    """Rows {mode, T, ratio, ratios, time_ours, time_torch, time_naive, bytes_<impl>, rss_<impl>} (see the module
    docstring): the paired median ratio ours / torch, exact tensor-byte peaks and process-level peaks."""
    available = _available_bytes()
    rows = []
    if print_rows:
        print(f"{'mode':8} {'T':>5} {'ours/torch':>10} {'(min-max)':>11} {'ours ms':>8} {'torch ms':>8} {'naive ms':>9} "
              f"{'tensor MiB ours/naive/torch':>28} {'naive/ours':>10} {'RSS MiB ours/naive/torch':>25}", flush=True)
    for mode in modes:
        backward = mode == "fwd+bwd"
        fits = {t: available is None or _naive_bytes_estimate(t, batch, heads, backward) < 0.6 * available
                for t in lengths}
        rss = {}
        if process_memory:
            for impl in IMPLS:
                todo = [t for t in lengths if impl != "naive" or fits[t]]
                rss[impl] = dict(zip(todo, peak_extra_memory(impl, todo, backward=backward, batch=batch, heads=heads,
                                                             head_dim=head_dim)))
        for t in lengths:
            row = {"mode": mode, "T": t, **paired_ratio("ours", "torch", t, backward=backward, batch=batch,
                                                        heads=heads, head_dim=head_dim, pairs=pairs)}
            row["time_naive"] = (time_attention("naive", t, backward=backward, batch=batch, heads=heads,
                                                head_dim=head_dim, repeats=1) if fits[t] else None)
            for impl in IMPLS:
                row[f"bytes_{impl}"] = (tensor_bytes_peak(impl, t, backward=backward, batch=batch, heads=heads,
                                                          head_dim=head_dim) if impl != "naive" or fits[t] else None)
                row[f"rss_{impl}"] = rss.get(impl, {}).get(t)
            rows.append(row)
            if print_rows:
                print(_format_row(row), flush=True)
    return rows


def _format_row(row: dict) -> str:
    def ms(x):
        return f"{x * 1e3:8.0f}" if x is not None else f"{'-':>8}"

    def mib(*xs):
        return "/".join(f"{x / 2**20:.1f}" if x is not None else "-" for x in xs)

    spread = f"({min(row['ratios']):.2f}-{max(row['ratios']):.2f})"
    mem_ratio = (f"{row['bytes_naive'] / row['bytes_ours']:10.1f}" if row["bytes_naive"] and row["bytes_ours"]
                 else f"{'-':>10}")
    return (f"{row['mode']:8} {row['T']:5d} {row['ratio']:10.2f} {spread:>11} {ms(row['time_ours'])} "
            f"{ms(row['time_torch'])} {ms(row['time_naive']):>9} "
            f"{mib(row['bytes_ours'], row['bytes_naive'], row['bytes_torch']):>28} {mem_ratio} "
            f"{mib(row['rss_ours'], row['rss_naive'], row['rss_torch']):>25}")


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - prints timings
    parser = argparse.ArgumentParser(prog="python -m attncourse.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    fl = sub.add_parser("flash", help="ours vs naive vs PyTorch: time and peak extra memory against T")
    fl.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    fl.add_argument("--mode", choices=["fwd", "fwd+bwd", "both"], default="both")
    fl.add_argument("--pairs", type=int, default=7, help="paired, alternating runs of ours and torch per row")
    fl.add_argument("--no-process-memory", action="store_true", help="skip the process-level (RSS) cross-check")
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
    fl.add_argument("--omp-wait-policy", choices=["passive", "active", "inherit"], default="passive",
                    help="OpenMP's wait policy for this run (default passive: on a machine shared with other busy "
                         "processes, threads that spin while waiting steal the core the working thread needs, which "
                         "slows code made of many small parallel ops far more than one fused kernel)")
    args = parser.parse_args(argv)
    if args.command == "flash" and args.omp_wait_policy != "inherit":
        wanted = args.omp_wait_policy.upper()
        if os.environ.get("OMP_WAIT_POLICY") != wanted:  # OpenMP reads it once, at start-up: run again with it set
            os.environ["OMP_WAIT_POLICY"] = wanted
            os.execv(sys.executable, [sys.executable, "-m", "attncourse.bench", *(sys.argv[1:] if argv is None
                                                                                  else argv)])
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.command == "_memory":
        print(json.dumps(_measure_in_this_process(args.impl, args.lengths, args.backward, args.batch,
                                                  args.heads, args.dim, not args.no_causal)))
        return 0
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    print(f"flash benchmark: B={args.batch}, H={args.heads}, D={args.dim}, float32, causal; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} CPUs; load average "
          f"{load}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; "
          f"our default blocks (block_q, block_k): forward {default_block_sizes('cpu')}, "
          f"backward {default_block_sizes('cpu', backward=True)}")
    print(f"ours/torch: median of {args.pairs} paired, alternating runs in this process (min-max of the pairs); "
          "times: medians; tensor MiB: exact peak of live tensors created by the call (inputs excluded, gradients "
          "included); RSS MiB: process-level peak beyond the inputs, in a fresh process (cross-check)")
    modes = ("fwd", "fwd+bwd") if args.mode == "both" else (args.mode,)
    flash_table(args.lengths, modes=modes, batch=args.batch, heads=args.heads, head_dim=args.dim,
                pairs=args.pairs, process_memory=not args.no_process_memory)
    if hasattr(os, "getloadavg"):
        print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
