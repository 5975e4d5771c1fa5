"""GPU benchmark of chapter 10's Triton kernels against PyTorch's fused attention.

    python -m attncourse.bench_triton [--out DIR] [--quick]

- **Forward**, float16, H = 16, D = 64, B * T = 16384 tokens (B = 4 at T = 4096), with and without the causal
  mask: our autotuned kernel against ``F.scaled_dot_product_attention`` forced to PyTorch's FlashAttention-2
  backend (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``) and, where it runs, to cuDNN
  (``SDPBackend.CUDNN_ATTENTION``). Throughput in TFLOP/s (:func:`attncourse.triton_flash.attention_flops`,
  causal halved) from ``triton.testing.do_bench`` (warm-up, L2 flush, median). Forward plus backward in ms.
- **Decode**, float16, B = 1, H = 32, Hkv = 8, D = 128, Tk = 32768: :func:`attncourse.triton_flash_decode`
  for num_splits 1, 2, 4, ... 64 and the default heuristic, in microseconds.

It writes ``results.json`` and ``bench_triton.png`` (the figure chapter 10 describes) to DIR (default
``bench_triton_results``) and prints each target of :data:`TARGETS`, met or not: at T = 4096 the forward at least
1.0x cuDNN's TFLOP/s without a mask and causal, forward + backward within 1.2x cuDNN's time, and split-KV decode
with the heuristic's own number of splits at least 3x faster than the unsplit kernel and within 1.5x of the
memory floor (K and V read once at the GPU's peak bandwidth, :data:`PEAK_BANDWIDTH`). The ratios against
PyTorch's FlashAttention-2 backend are printed too, for reference. Without a CUDA GPU it says so and exits with
status 2: interpreter timings say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

FORWARD = dict(tokens=16384, heads=16, head_dim=64, seq_lens=(512, 1024, 2048, 4096, 8192, 16384))
DECODE = dict(batch=1, heads=32, kv_heads=8, head_dim=128, k_len=32768, splits=(1, 2, 4, 8, 16, 32, 64))
# name -> (goal, "min" when the ratio must reach the goal, "max" when it must stay under it)
TARGETS = {"forward, no mask (ours / cuDNN TFLOP/s)": (1.0, "min"),
           "forward, causal (ours / cuDNN TFLOP/s)": (1.0, "min"),
           "forward + backward, no mask (ours / cuDNN time)": (1.2, "max"),
           "forward + backward, causal (ours / cuDNN time)": (1.2, "max"),
           "decode (unsplit / heuristic split-KV time)": (3.0, "min"),
           "decode (heuristic split-KV time / memory floor)": (1.5, "max")}
# Reported beside the targets: the FlashAttention-2 backend (the second edition's yardstick).
REFERENCE = ("forward, no mask (ours / FA2 backend TFLOP/s)", "forward, causal (ours / FA2 backend TFLOP/s)")
# Peak HBM bandwidth by device name (bytes/s), for the decode's memory floor; unknown devices get no floor.
PEAK_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12,
                  "A100-SXM4-40GB": 1.56e12}


def _tflops(ms: float, flops: int) -> float:
    return flops / (ms * 1e-3) / 1e12


def _sdpa(backend):
    """F.scaled_dot_product_attention forced to one PyTorch backend (`backend` an SDPBackend)."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def run(q, k, v, is_causal):
        with sdpa_kernel([backend]):
            return scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    return run


def forward_benchmark(seq_lens=FORWARD["seq_lens"]) -> dict:
    """{implementation: {"causal" | "full": {"tflops": [...], "fwd_bwd_ms": [...]}}} over `seq_lens`."""
    import triton

    from torch.nn.attention import SDPBackend

    from .triton_flash import attention_flops, triton_flash_attention

    impls = {"Triton (ours)": lambda q, k, v, c: triton_flash_attention(q, k, v, is_causal=c),
             "F.sdpa FLASH_ATTENTION": _sdpa(SDPBackend.FLASH_ATTENTION),
             "F.sdpa CUDNN_ATTENTION": _sdpa(SDPBackend.CUDNN_ATTENTION)}
    h, d = FORWARD["heads"], FORWARD["head_dim"]
    results: dict = {}
    for name, fn in impls.items():
        for causal in (False, True):
            row = {"tflops": [], "fwd_bwd_ms": []}
            try:
                for t in seq_lens:
                    b = max(1, FORWARD["tokens"] // t)
                    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.float16, requires_grad=True)
                               for _ in range(3))  # (B, H, T, D)
                    with torch.no_grad():
                        ms = triton.testing.do_bench(lambda: fn(q, k, v, causal), return_mode="median")
                    grad = torch.randn_like(q)
                    ms_both = triton.testing.do_bench(lambda: fn(q, k, v, causal).backward(grad),
                                                      grad_to_none=[q, k, v], return_mode="median")
                    row["tflops"].append(_tflops(ms, attention_flops(b * h, t, t, d, is_causal=causal)))
                    row["fwd_bwd_ms"].append(ms_both)
            except RuntimeError as err:  # e.g. cuDNN attention not built into this PyTorch
                row = {"error": str(err).splitlines()[0][:200]}
            results.setdefault(name, {})["causal" if causal else "full"] = row
    return results


def decode_benchmark(splits=DECODE["splits"]) -> dict:
    """{"splits": [...], "us": [...], "default_splits": int, "default_us": float} for one decode step."""
    import triton

    from .triton_decode import default_num_splits, triton_flash_decode

    b, h, h_kv, d, t = (DECODE[k] for k in ("batch", "heads", "kv_heads", "head_dim", "k_len"))
    q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.float16)  # (B, H, 1, D)
    k, v = (torch.randn(b, h_kv, t, d, device="cuda", dtype=torch.float16) for _ in range(2))  # (B, Hkv, T, D)
    times = [1e3 * triton.testing.do_bench(lambda: triton_flash_decode(q, k, v, num_splits=s), return_mode="median")
             for s in splits]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chosen = default_num_splits(b * h_kv, t, sm_count=sms)
    default_us = 1e3 * triton.testing.do_bench(lambda: triton_flash_decode(q, k, v), return_mode="median")
    return {"splits": list(splits), "us": times, "default_splits": chosen, "default_us": default_us, "sms": sms}


def memory_floor_us(results: dict) -> float | None:
    """Microseconds to read the decode step's K and V once at the device's peak bandwidth (None: unknown GPU)."""
    peak = next((bw for name, bw in PEAK_BANDWIDTH.items() if name in results.get("device", "")), None)
    if peak is None:
        return None
    kv_bytes = 2 * DECODE["batch"] * DECODE["kv_heads"] * DECODE["k_len"] * DECODE["head_dim"] * 2  # K, V in fp16
    return kv_bytes / peak * 1e6


def target_ratios(results: dict) -> dict:
    """The ratios :data:`TARGETS` and :data:`REFERENCE` name, from :func:`forward_benchmark` and
    :func:`decode_benchmark` (a ratio whose backend did not run, or whose floor is unknown, is left out)."""
    fwd, lens = results["forward"], list(results["seq_lens"])
    i = lens.index(4096)
    ours = fwd["Triton (ours)"]
    ratios = {}
    for label, key in (("cuDNN", "F.sdpa CUDNN_ATTENTION"), ("FA2 backend", "F.sdpa FLASH_ATTENTION")):
        other = fwd.get(key, {})
        for mode, word in (("full", "no mask"), ("causal", "causal")):
            if "tflops" not in other.get(mode, {}):
                continue
            ratios[f"forward, {word} (ours / {label} TFLOP/s)"] = ours[mode]["tflops"][i] / other[mode]["tflops"][i]
            if label == "cuDNN":
                ratios[f"forward + backward, {word} (ours / cuDNN time)"] = (ours[mode]["fwd_bwd_ms"][i]
                                                                             / other[mode]["fwd_bwd_ms"][i])
    dec = results["decode"]
    ratios["decode (unsplit / heuristic split-KV time)"] = dec["us"][dec["splits"].index(1)] / dec["default_us"]
    floor = memory_floor_us(results)
    if floor is not None:
        ratios["decode (heuristic split-KV time / memory floor)"] = dec["default_us"] / floor
    return ratios


def verdicts(ratios: dict) -> list[tuple[str, float, str]]:
    """(name, ratio, "met" / "NOT met" / "reference") for every ratio, targets first."""
    rows = []
    for name, (goal, way) in TARGETS.items():
        if name in ratios:
            ok = ratios[name] >= goal if way == "min" else ratios[name] <= goal
            rows.append((name, ratios[name], f"target {'>=' if way == 'min' else '<='} {goal}x: "
                                             f"{'met' if ok else 'NOT met'}"))
        else:
            rows.append((name, float("nan"), "not measured (backend missing or bandwidth unknown)"))
    rows += [(name, ratios[name], "reference") for name in REFERENCE if name in ratios]
    return rows


def plot_results(results: dict, path: Path) -> None:
    """Two panels: forward TFLOP/s against T (ours and PyTorch's backends: colour, marker and line style tell
    them apart, full solid and causal dashed), decode time against num_splits with the heuristic's own point."""
    from matplotlib.figure import Figure  # no pyplot: works under any backend, inline or not
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    from .plot import MARKERS, OKABE_ITO

    fig = Figure(figsize=(12.5, 5.6))
    left, right = fig.subplots(1, 2)
    for n, (name, modes) in enumerate(results["forward"].items()):
        for mode, row in modes.items():
            if "tflops" in row:
                left.plot(results["seq_lens"], row["tflops"], color=OKABE_ITO[n], marker=MARKERS[n],
                          ls="-" if mode == "full" else "--", label=f"{name}, {'no mask' if mode == 'full' else mode}")
    dec = results["decode"]
    right.plot(dec["splits"], dec["us"], color=OKABE_ITO[0], marker="o", label="split-KV decode, measured")
    right.plot([dec["default_splits"]], [dec["default_us"]], color=OKABE_ITO[5], marker="*", ms=14, ls="none",
               label=f"the heuristic's choice: {dec['default_splits']} splits")
    floor = memory_floor_us(results)
    if floor is not None:
        right.axhline(floor, color="grey", ls=":", label=f"memory floor ({floor:.0f} us)")
    for ax, xs in ((left, results["seq_lens"]), (right, sorted(set(dec["splits"]) | {dec["default_splits"]}))):
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(xs))  # plain numbers at the measured points, no 2 x 10^3
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(alpha=0.3)
    left.set(xlabel="sequence length T (B * T = 16384)", ylabel="forward TFLOP/s (causal counted as half)",
             title=f"Forward, float16, H = 16, D = 64 ({results['device']})")
    right.set(xlabel="num_splits", ylabel="time per decode step (us)",
              title="Decode, B = 1, H = 32, Hkv = 8, D = 128, Tk = 32768")
    for ax in (left, right):  # legends under the panels, off the data
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attncourse.bench_triton", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_triton_results"),
                        help="folder for results.json and the figure")
    parser.add_argument("--quick", action="store_true", help="only T = 1024 and 4096, splits 1, 8 and 32")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_triton needs a CUDA GPU: nothing was measured (Triton's CPU interpreter runs the kernels "
              "for tests, but its timings say nothing about a GPU).", file=sys.stderr)
        return 2
    import triton

    seq_lens = (1024, 4096) if args.quick else FORWARD["seq_lens"]
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
               "seq_lens": list(seq_lens), "forward": forward_benchmark(seq_lens),
               "decode": decode_benchmark((1, 8, 32) if args.quick else DECODE["splits"])}
    results["ratios"] = target_ratios(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    plot_results(results, args.out / "bench_triton.png")
    print(f"{results['device']}, torch {results['torch']}, triton {results['triton']}")
    for name, ratio, verdict in verdicts(results["ratios"]):
        print(f"{name:50s} {ratio:6.2f}x  ({verdict})")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'bench_triton.png'}")
    return 0


if __name__ == "__main__":  # pragma: no cover - needs a GPU
    raise SystemExit(main())
