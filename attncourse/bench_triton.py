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
``bench_triton_results``) and prints the targets of issue 19: forward at T = 4096 at least 0.9x the
FlashAttention-2 backend's TFLOP/s without a mask and 0.85x causal; split-KV decode at least 3x faster than
the unsplit kernel. Without a CUDA GPU it says so and exits with status 2: interpreter timings say nothing
about a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

FORWARD = dict(tokens=16384, heads=16, head_dim=64, seq_lens=(512, 1024, 2048, 4096, 8192, 16384))
DECODE = dict(batch=1, heads=32, kv_heads=8, head_dim=128, k_len=32768, splits=(1, 2, 4, 8, 16, 32, 64))
TARGETS = {"forward, no mask (ours / FA2 backend)": 0.9, "forward, causal (ours / FA2 backend)": 0.85,
           "decode (unsplit / split-KV time)": 3.0}


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


def target_ratios(results: dict) -> dict:
    """The three numbers issue 19 sets targets for, from :func:`forward_benchmark` and :func:`decode_benchmark`."""
    fwd, lens = results["forward"], list(results["seq_lens"])
    i = lens.index(4096)
    ours, fa2 = fwd["Triton (ours)"], fwd["F.sdpa FLASH_ATTENTION"]
    dec = results["decode"]
    return {"forward, no mask (ours / FA2 backend)": ours["full"]["tflops"][i] / fa2["full"]["tflops"][i],
            "forward, causal (ours / FA2 backend)": ours["causal"]["tflops"][i] / fa2["causal"]["tflops"][i],
            "decode (unsplit / split-KV time)": dec["us"][dec["splits"].index(1)] / dec["default_us"]}


def plot_results(results: dict, path: Path) -> None:
    """Two panels: forward TFLOP/s against T (ours and PyTorch's backends), decode time against num_splits."""
    from matplotlib.figure import Figure  # no pyplot: works under any backend, inline or not

    from .plot import line_plot

    fig = Figure(figsize=(12, 4.2))
    left, right = fig.subplots(1, 2)
    curves = {f"{name}, {mode}": row["tflops"] for name, modes in results["forward"].items()
              for mode, row in modes.items() if "tflops" in row}
    line_plot(results["seq_lens"], curves, ax=left, logx=True, xlabel="sequence length T (B * T = 16384)",
              ylabel="forward TFLOP/s (causal counted as half)",
              title=f"Forward, float16, H = 16, D = 64 ({results['device']})")
    dec = results["decode"]
    line_plot(dec["splits"], {"split-KV decode": dec["us"]}, ax=right, logx=True, xlabel="num_splits",
              ylabel="time per decode step (us)", vline=dec["default_splits"],
              vline_label=f"heuristic: {dec['default_splits']} splits",
              title="Decode, B = 1, H = 32, Hkv = 8, D = 128, Tk = 32768")
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
    for name, ratio in results["ratios"].items():
        goal = TARGETS[name]
        print(f"{name:42s} {ratio:6.2f}x  (target >= {goal}x: {'met' if ratio >= goal else 'NOT met'})")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'bench_triton.png'}")
    return 0


if __name__ == "__main__":  # pragma: no cover - needs a GPU
    raise SystemExit(main())
