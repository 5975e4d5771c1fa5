"""Chapter 10 on a GPU, in one command: the notebooks as scripts, the GPU tests, and the full benchmark.

    python -m attncourse.gpu_check [--out DIR] [--quick] [--skip-bench]

For a machine with a CUDA GPU and no Jupyter (a lent GPU box): it runs every code cell of chapter 10's lesson,
solutions and exercises notebooks in order, in one namespace per notebook, as a kernel would (matplotlib draws to
files, ``IPython.display`` is stubbed when IPython is missing); then ``pytest`` on the Triton tests (when pytest is
installed), then ``python -m attncourse.bench_triton`` (``--quick`` for its short version). It writes
``DIR/report.json`` (default ``gpu_check_results``) with each notebook's cells (ok, or the error), the tests'
summary line and the benchmark's verdicts, copies the benchmark's ``results.json`` and figure there, and prints a
summary. The lesson and the solutions must run clean; in the exercises notebook only the "not attempted yet"
errors of unwritten answers are expected.

Without a GPU it runs the same under Triton's interpreter (how it is tested on a CPU) and skips the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = "10_flash_attention_triton.ipynb"
NOTEBOOKS = {"lesson": ROOT / "notebooks" / CHAPTER, "solutions": ROOT / "solutions" / CHAPTER,
             "exercises": ROOT / "exercises" / CHAPTER}
TESTS = ["tests/test_triton_flash.py", "tests/test_triton_decode.py", "tests/test_triton_tolerance.py",
         "tests/test_bench_triton.py"]


def _stub_ipython() -> None:
    """`from IPython.display import Image, display` works without IPython: display writes nothing."""
    try:
        import IPython.display  # noqa: F401
    except ImportError:
        display = types.ModuleType("IPython.display")
        display.display = lambda *args, **kwargs: None
        display.Image = lambda *args, **kwargs: None
        display.Markdown = display.HTML = display.Image
        package = types.ModuleType("IPython")
        package.display = display
        sys.modules["IPython"], sys.modules["IPython.display"] = package, display


def code_cells(path: Path) -> list[str]:
    """The source of every code cell, in order (nbformat when installed, else the JSON itself)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in cells if c["cell_type"] == "code"]


def run_notebook(path: Path, figures: Path) -> list[dict]:
    """Run `path`'s code cells in order in a fresh namespace, from the notebook's folder; one record per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures.mkdir(parents=True, exist_ok=True)
    shown = []

    def show(*args, **kwargs):  # plt.show() saves the figure instead
        fig = plt.gcf()
        fig.savefig(figures / f"{path.parent.name}-{len(shown):02d}.png", dpi=80)
        shown.append(fig)
        plt.close(fig)

    plt.show = show
    namespace = {"__name__": "__main__"}
    records, here = [], os.getcwd()
    os.chdir(path.parent)
    try:
        for number, source in enumerate(code_cells(path), 1):
            start = time.perf_counter()
            try:
                exec(compile(source, f"<{path.parent.name} cell {number}>", "exec"), namespace)
                records.append({"cell": number, "status": "ok", "seconds": round(time.perf_counter() - start, 2)})
            except BaseException as err:  # noqa: BLE001 - a cell's failure is the report's content
                if isinstance(err, KeyboardInterrupt):
                    raise
                records.append({"cell": number, "status": type(err).__name__, "message": str(err)[:500],
                                "traceback": traceback.format_exc(limit=4)[-1500:],
                                "seconds": round(time.perf_counter() - start, 2)})
    finally:
        os.chdir(here)
    return records


def expected_failure(record: dict) -> bool:
    """In the exercises notebook, an unwritten answer's errors are expected (the stub, its check cell)."""
    return record["status"] in ("ExerciseNotDone", "NotImplementedError") or \
        (record["status"] == "NameError" and "is not defined" in record.get("message", ""))


def run_tests(out: Path) -> dict:
    if not isinstance(out, Path):
        raise TypeError(f"out must be a pathlib.Path, got {type(out).__name__}")
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"status": "skipped", "summary": "pytest is not installed here"}
    env = dict(os.environ, ATTNCOURSE_AUTOTUNE="quick")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           *TESTS], cwd=ROOT, env=env, capture_output=True, text=True)
    (out / "tests.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {"status": "passed" if done.returncode == 0 else "failed", "summary": lines[-1] if lines else "",
            "seconds": round(time.perf_counter() - start, 1)}


def run_bench(out: Path, quick: bool) -> dict:
    if not isinstance(out, Path):
        raise TypeError(f"out must be a pathlib.Path, got {type(out).__name__}")
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "summary": "no CUDA GPU: the benchmark measures nothing in the interpreter"}
    from . import bench_triton

    start = time.perf_counter()
    code = bench_triton.main(["--out", str(out / "bench")] + (["--quick"] if quick else []))
    if code != 0:
        return {"status": "failed", "summary": f"bench_triton exited with {code}"}
    results = json.loads((out / "bench" / "results.json").read_text())
    return {"status": "ok", "seconds": round(time.perf_counter() - start, 1),
            "verdicts": [list(v) for v in bench_triton.verdicts(results["ratios"])]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attncourse.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check_results"), help="folder for the report")
    parser.add_argument("--quick", action="store_true", help="the benchmark's short version")
    parser.add_argument("--skip-bench", action="store_true", help="no benchmark")
    parser.add_argument("--skip-tests", action="store_true", help="no pytest run")
    parser.add_argument("--only", choices=sorted(NOTEBOOKS), action="append", help="run only these notebooks")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # what the notebooks themselves do without a GPU
    _stub_ipython()
    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (interpreter)",
              "torch": torch.__version__, "notebooks": {}}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    clean = True
    for name in args.only or list(NOTEBOOKS):
        start = time.perf_counter()
        records = run_notebook(NOTEBOOKS[name], out / "figures")
        bad = [r for r in records if r["status"] != "ok" and not (name == "exercises" and expected_failure(r))]
        clean &= not bad
        report["notebooks"][name] = {"cells": records, "unexpected": [r["cell"] for r in bad],
                                     "seconds": round(time.perf_counter() - start, 1)}
        print(f"{name:9s}: {len(records)} cells, {len(bad)} unexpected error(s)"
              + (f" (cells {[r['cell'] for r in bad]}: {bad[0]['status']}: {bad[0].get('message', '')[:200]})"
                 if bad else "") + f", {report['notebooks'][name]['seconds']} s")
    if not args.skip_tests:
        report["tests"] = run_tests(out)
        clean &= report["tests"]["status"] != "failed"
        print(f"tests    : {report['tests']['status']}: {report['tests']['summary']}")
    if not args.skip_bench:
        report["bench"] = run_bench(out, args.quick)
        clean &= report["bench"]["status"] != "failed"
        for name, ratio, verdict in report["bench"].get("verdicts", []):
            print(f"bench    : {name:50s} {ratio:5.2f}x  {verdict}")
        if "verdicts" not in report["bench"]:
            print(f"bench    : {report['bench']['status']}: {report['bench']['summary']}")
    (out / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    print(f"wrote {out / 'report.json'}")
    return 0 if clean else 1


if __name__ == "__main__":  # pragma: no cover - a command
    raise SystemExit(main())
