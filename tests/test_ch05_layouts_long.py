"""Chapter 05's longer MLA-64 / GQA-2 runs (attncourse.kv_layouts_long): bad arguments are refused, the part files
written by parallel runs merge into one JSON in the order of the rates, and the stored run has every curve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attncourse import kv_layouts_long as kl


def test_bad_arguments_refused(tmp_path):
    with pytest.raises(ValueError, match="lr"):
        kl.run("3e-4", "MLA-64", tmp_path)
    with pytest.raises(ValueError, match="layout"):
        kl.run("3e-3", "MHA", tmp_path)


def test_parts_merge(tmp_path):
    for lr in reversed(kl.LONG_LRS):
        for layout in kl.LONG_LAYOUTS:
            part = {"lr": lr, "layout": layout, "curves": [[3.0, float(len(layout))]] * 3}
            (tmp_path / f"{kl.RESULT[:-5]}.{lr}.{layout}.part.json").write_text(json.dumps(part))
    stored = kl.merge(tmp_path)
    assert list(stored["curves"]) == list(kl.LONG_LRS) and not list(tmp_path.glob("*.part.json"))
    assert stored["curves"]["1e-2"]["MLA-64"] == [[3.0, 6.0]] * 3
    assert json.loads((tmp_path / kl.RESULT).read_text()) == stored


def test_stored_run_complete():
    stored = json.loads((Path(__file__).parent.parent / "notebooks" / "results" / kl.RESULT).read_text())
    assert stored["steps"] == kl.LONG_STEPS and stored["seeds"] == list(kl.LONG_SEEDS)
    for lr in kl.LONG_LRS:
        for layout in kl.LONG_LAYOUTS:
            curves = stored["curves"][lr][layout]
            assert len(curves) == 3 and all(len(c) == kl.LONG_STEPS // kl.LONG_EVAL_EVERY + 1 for c in curves)
