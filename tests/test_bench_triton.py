"""Tests of the GPU benchmark's plumbing (attncourse.bench_triton). The measurements themselves need a GPU;
here: it refuses to run without one, computes the target ratios from its results, and draws its figure."""

from __future__ import annotations

import pytest
import torch

from attncourse import bench_triton


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_refuses_to_measure_without_a_gpu(tmp_path, capsys):
    assert bench_triton.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU: nothing was measured" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def synthetic_results():
    # Made-up numbers with a known answer, only to test the arithmetic and the drawing (never shown as data).
    lens = [1024, 4096]
    row = lambda values, ms: {"tflops": values, "fwd_bwd_ms": ms}  # noqa: E731
    return {"device": "NVIDIA H100 80GB HBM3", "seq_lens": lens,
            "forward": {"Triton (ours)": {"full": row([90.0, 180.0], [1.0, 3.0]), "causal": row([40.0, 80.0], [1.0, 2.0])},
                        "F.sdpa FLASH_ATTENTION": {"full": row([100.0, 200.0], [1.0, 4.0]),
                                                   "causal": row([50.0, 100.0], [1.0, 2.0])},
                        "F.sdpa CUDNN_ATTENTION": {"full": row([100.0, 150.0], [1.0, 2.0]),
                                                   "causal": row([50.0, 100.0], [1.0, 1.0])}},
            "decode": {"splits": [1, 8, 32], "us": [300.0, 60.0, 80.0], "default_splits": 14, "default_us": 50.0}}


def test_target_ratios_verdicts_and_figure(tmp_path):
    results = synthetic_results()
    ratios = bench_triton.target_ratios(results)
    floor = 2 * 8 * 32768 * 128 * 2 / 3.35e12 * 1e6  # K and V of 8 heads, fp16, at 3.35 TB/s: about 40 us
    assert ratios == pytest.approx({"forward, no mask (ours / cuDNN TFLOP/s)": 1.2,
                                    "forward, causal (ours / cuDNN TFLOP/s)": 0.8,
                                    "forward + backward, no mask (ours / cuDNN time)": 1.5,
                                    "forward + backward, causal (ours / cuDNN time)": 2.0,
                                    "forward, no mask (ours / FA2 backend TFLOP/s)": 0.9,
                                    "forward, causal (ours / FA2 backend TFLOP/s)": 0.8,
                                    "decode (unsplit / heuristic split-KV time)": 6.0,
                                    "decode (heuristic split-KV time / memory floor)": 50.0 / floor})
    verdicts = {name: verdict for name, _, verdict in bench_triton.verdicts(ratios)}
    assert verdicts["forward, no mask (ours / cuDNN TFLOP/s)"].endswith(": met")
    assert verdicts["forward, causal (ours / cuDNN TFLOP/s)"].endswith("NOT met")
    assert verdicts["forward + backward, no mask (ours / cuDNN time)"].endswith("NOT met")  # 1.5x > 1.2x
    assert verdicts["decode (heuristic split-KV time / memory floor)"].endswith(": met")  # 50 us < 1.5 * 40 us
    assert verdicts["forward, no mask (ours / FA2 backend TFLOP/s)"] == "reference"
    path = tmp_path / "fig.png"
    bench_triton.plot_results(results, path)
    assert path.stat().st_size > 10_000


def test_a_missing_backend_is_reported_not_measured():
    results = synthetic_results()
    results["forward"]["F.sdpa CUDNN_ATTENTION"] = {"full": {"error": "not built"}, "causal": {"error": "not built"}}
    results["device"] = "some other GPU"
    rows = {name: verdict for name, _, verdict in bench_triton.verdicts(bench_triton.target_ratios(results))}
    assert rows["forward, no mask (ours / cuDNN TFLOP/s)"].startswith("not measured")
    assert rows["decode (heuristic split-KV time / memory floor)"].startswith("not measured")
