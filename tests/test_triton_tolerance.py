"""Chapter 10 runs on either device, and every comparison in it takes its tolerance from one helper.

The second edition's lesson stopped on an H100 at a gradient comparison written for the interpreter's float32
(a GPU's ``tl.dot`` multiplies float32 in TF32), and its exercises forced the interpreter on a GPU machine. CI has no
GPU, so these tests read the notebooks and the GPU tests instead: a tolerance typed into a chapter 10 comparison,
an unconditional ``TRITON_INTERPRET=1`` or a device chosen outside ``triton_common.device()`` fails here."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import torch

from attncourse import triton_common

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = [ROOT / "notebooks" / "10_flash_attention_triton.ipynb", ROOT / "solutions" / "10_flash_attention_triton.ipynb"]
GPU_TESTS = [ROOT / "tests" / "test_triton_flash.py", ROOT / "tests" / "test_triton_decode.py"]
EXACT = re.compile(r"rtol=0(\.0)?,\s*atol=0(\.0)?")


def calls(source: str, name: str) -> list[str]:
    """The full text of every call `name(...)` in `source` (parentheses balanced)."""
    found = []
    for match in re.finditer(re.escape(name) + r"\(", source):
        depth, end = 1, match.end()
        while depth and end < len(source):
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        found.append(source[match.start():end])
    return found


def code_of(path: Path) -> str:
    nb = nbformat.read(path, as_version=4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("path", NOTEBOOKS + GPU_TESTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_comparison_takes_its_tolerance_from_the_helper(path):
    source = code_of(path) if path.suffix == ".ipynb" else path.read_text(encoding="utf-8")
    comparisons = calls(source, "assert_close")
    assert comparisons, f"{path.name} compares nothing?"
    typed = [c for c in comparisons if ("rtol" in c or "atol" in c) and not EXACT.search(c)
             and "tolerance(" not in c]
    untold = [c for c in comparisons if not any(k in c for k in ("TOL", "F32", "GRAD", "tolerance(", "tol)"))
              and not EXACT.search(c)]
    assert not typed, f"{path.name}: tolerances typed in, not from triton_common.tolerance: {typed}"
    assert not untold, f"{path.name}: comparisons with assert_close's own default tolerance: {untold}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.parent.name)
def test_the_notebooks_leave_the_device_to_one_place(path):
    source = code_of(path)
    assert "DEVICE = triton_common.device()" in source
    assert re.search(r"if not (GPU|torch\.cuda\.is_available\(\)):\s*\n\s*os\.environ\[\"TRITON_INTERPRET\"\] = \"1\"",
                     source), "TRITON_INTERPRET must be set only where there is no GPU"
    assert source.count('os.environ["TRITON_INTERPRET"]') == 1
    assert 'device="cuda"' not in source and "device='cuda'" not in source and ".cuda()" not in source


def test_the_gpu_tests_use_the_helpers_values():
    for path in GPU_TESTS:
        text = path.read_text(encoding="utf-8")
        assert "common.tolerance(torch.float32, DEVICE)" in text
    # the values themselves: tight on the interpreter, TF32-sized on a GPU, looser in half precision
    cpu, gpu = triton_common.tolerance(torch.float32, "cpu"), triton_common.tolerance(torch.float32, "cuda")
    assert cpu["rtol"] <= 1e-5 < 1e-3 <= gpu["rtol"]
    assert triton_common.tolerance(torch.float16, "cuda")["atol"] >= 3.8e-3  # the largest error one H100 run met
    assert triton_common.tolerance(torch.bfloat16, "cuda")["atol"] >= 2.1e-2
    assert triton_common.tolerance(torch.float32, "cuda", grad=True)["atol"] >= 4.0e-3
    with pytest.raises(TypeError, match="bfloat16"):
        triton_common.tolerance(torch.bfloat16, "cpu")


def test_device_follows_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_common.device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert triton_common.device() == torch.device("cpu")  # kernels built for the interpreter stay on the CPU
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(triton_common, "interpreted", lambda: False)
    assert triton_common.device() == torch.device("cuda")
