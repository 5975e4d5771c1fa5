"""Seeds and the environment report every lesson starts with."""

from __future__ import annotations

import os
import platform
import random
import sys

import numpy as np
import torch


def set_seed(seed: int = 0) -> None:
    """Seed Python, NumPy and PyTorch (all devices) in one call."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)



def device(prefer_gpu: bool = True) -> torch.device:
    """CUDA if present (and wanted), else CPU. Lessons are written to run on CPU."""
    return torch.device("cuda" if prefer_gpu and torch.cuda.is_available() else "cpu")


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "not installed"


def env_report() -> dict[str, str]:
    """Versions, threads and devices: what to paste into a bug report."""
    report = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "matplotlib": _version("matplotlib"),
        "seaborn": _version("seaborn"),
        "triton": _version("triton"),
        "attncourse": _version("attncourse"),
        "cpu threads (torch)": str(torch.get_num_threads()),
        "cpu cores (os)": str(os.cpu_count()),
        "cuda available": str(torch.cuda.is_available()),
    }
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name(0)
    return report


def print_env_report() -> None:
    """Print :func:`env_report` as an aligned table."""
    report = env_report()
    width = max(map(len, report))
    for key, value in report.items():
        print(f"{key:<{width}}  {value}")
