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
    row = lambda values: {"tflops": values, "fwd_bwd_ms": [1.0, 2.0]}  # noqa: E731
    return {"device": "test", "seq_lens": lens,
            "forward": {"Triton (ours)": {"full": row([90.0, 180.0]), "causal": row([40.0, 80.0])},
                        "F.sdpa FLASH_ATTENTION": {"full": row([100.0, 200.0]), "causal": row([50.0, 100.0])},
                        "F.sdpa CUDNN_ATTENTION": {"full": {"error": "not built"}, "causal": {"error": "not built"}}},
            "decode": {"splits": [1, 8, 32], "us": [300.0, 60.0, 80.0], "default_splits": 14, "default_us": 50.0}}


def test_target_ratios_and_figure(tmp_path):
    results = synthetic_results()
    ratios = bench_triton.target_ratios(results)
    assert ratios == pytest.approx({"forward, no mask (ours / FA2 backend)": 0.9,
                                    "forward, causal (ours / FA2 backend)": 0.8,
                                    "decode (unsplit / split-KV time)": 6.0})
    assert set(ratios) == set(bench_triton.TARGETS)
    path = tmp_path / "fig.png"
    bench_triton.plot_results(results, path)
    assert path.stat().st_size > 10_000
