"""Chapter 05's MLA-64 with an RMSNorm on the latent, DeepSeek's ``kv_a_layernorm`` (``kv_norm`` in DeepSeek-V3's
``model.py``): the cheapest untested reason for MLA ending behind GQA-2 at equal cache in
:mod:`attncourse.kv_layouts`. The layout is that module's MLA-64 (the same initial weights on each seed: the norm's
scale starts at ones and draws nothing) with ``c_kv = RMSNorm(x W_DKV)``; the cache still holds ``c_kv``, so the
absorbed form is unchanged. Same recipe, batches, seeds and steps as the stored run.

``python -m attncourse.kv_layouts_norm`` trains the 3 seeds (one process, one thread) and writes
``notebooks/results/ch05_layouts_norm.json``, which lesson 05 reads next to ``ch05_layouts.json``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .char_lm import CONTEXT, shakespeare_chars, windows
from .gpt import train_lm
from .kv_layouts import held_out_loss, held_out_windows, layout_lm


def normed_mla64(vocab_size: int, seed: int) -> nn.Module:
    """The untrained MLA-64 character GPT of `seed`, its latent RMS-normalised in both blocks."""
    model = layout_lm("MLA-64", vocab_size, seed)
    for block in model.blocks:
        mla = block.attn.mla
        mla.kv_down = nn.Sequential(mla.kv_down, nn.RMSNorm(mla.kv_rank, eps=1e-6))  # (B, T, r), then normalised
    return model


def train_normed(seed: int, data_dir: str | Path, steps: int, lr: float = 3e-3) -> list[float]:
    """Held-out curve (every 50 steps and at the end) of the normed MLA-64 on `seed`, as kv_layouts trains."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    train, held_text, vocab = shakespeare_chars(Path(data_dir) / "shakespeare" / "coriolanus.txt")
    held = held_out_windows(held_text)
    model = normed_mla64(len(vocab), seed)
    gen = torch.Generator().manual_seed(1000 + seed)  # kv_layouts.train_layout's batches
    curve: list[float] = []

    def batch(step: int) -> torch.Tensor:
        if step % 50 == 0:
            curve.append(held_out_loss(model, held))
            model.train()
        return windows(train, 32, CONTEXT, gen)

    train_lm(model, batch, steps, lr=lr)
    curve.append(held_out_loss(model, held))
    return curve


def main(out_dir: str | Path = "notebooks/results") -> dict:
    torch.set_num_threads(1)
    out_dir = Path(out_dir)
    stored = json.loads((out_dir / "ch05_layouts.json").read_text())
    result = {"layout": "MLA-64 + latent RMSNorm", "seeds": stored["seeds"], "steps": stored["steps"], "curves": []}
    for seed in stored["seeds"]:
        result["curves"].append(train_normed(seed, out_dir.parent / "data", stored["steps"]))
        print(seed, round(result["curves"][-1][-1], 4), flush=True)
    result["held_out"] = [c[-1] for c in result["curves"]]
    (out_dir / "ch05_layouts_norm.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
