r"""Chapter 05: uptraining the character-level RoPE model's GQA-2 and MQA conversions (Ainslie et al. 2023, sec. 3.3).

Ainslie et al. convert a trained MHA checkpoint (mean-pooled K/V heads) and continue pre-training it with the same
recipe for a proportion :math:`\alpha` of the original steps (0.05 in their main runs, section 3.1; their Figure 5,
section 3.3, varies it for T5-XXL with MQA and GQA-8).
Here the checkpoints are the three stored :mod:`attncourse.char_lm` models (600 steps on Tatoeba), so 5% is
30 steps and 10% is 60. Each conversion is uptrained with the models' own recipe
(:func:`~attncourse.gpt.train_lm`: AdamW, one-cycle, peak 3e-3, batch 32 windows of 64 characters) on batches drawn
from ``2000 + seed``, the same for every conversion of a seed, and so is the unconverted MHA model, as a control:
how much of the gain is just 30 more steps.

``python -m attncourse.uptrain_lm`` writes ``notebooks/results/ch05_uptrain.json`` (a few minutes of CPU).
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
from torch import nn

from . import _validate
from .char_lm import CONTEXT, char_lm, tatoeba_chars, windows
from .gpt import lm_loss, train_lm
from .gqa import mha_to_gqa

CONVERSIONS = {"MHA (control)": None, "GQA-2 mean": (2, "mean"), "GQA-2 first": (2, "first"),
               "MQA mean": (1, "mean"), "MQA first": (1, "first")}
UPTRAIN_STEPS = (30, 60)  # 5% and 10% of the 600 pre-training steps


def convert(lm: nn.Module, n_kv_heads: int, method: str) -> nn.Module:
    """A copy of the char GPT `lm` with every block's attention converted by :func:`~attncourse.gqa.mha_to_gqa`."""
    out = copy.deepcopy(lm)
    for block in out.blocks:
        block.attn = mha_to_gqa(block.attn, n_kv_heads, method)
    return out


def uptrain(model: nn.Module, train: torch.Tensor, seed: int, steps: int) -> nn.Module:
    """Continue training `model` in place for `steps` steps of the char-LM recipe, batches from ``2000 + seed``."""
    _validate.positive_int("steps", steps)
    gen = torch.Generator().manual_seed(2000 + seed)
    train_lm(model, lambda step: windows(train, 32, CONTEXT, gen), steps, lr=3e-3)
    return model


def held_out(text_held: torch.Tensor) -> torch.Tensor:
    """The 128 held-out windows lesson 05 evaluates the char GPT on (generator seed 5): (128, CONTEXT + 1)."""
    return windows(text_held, 128, CONTEXT, torch.Generator().manual_seed(5))


def main(out_dir: str | Path = "notebooks/results") -> dict:
    torch.set_num_threads(1)
    out_dir = Path(out_dir)
    text_train, text_held, vocab = tatoeba_chars(out_dir.parent / "data" / "tatoeba" / "eng-fra-5000.txt")
    stored = torch.load(out_dir / "char_lm_rope.pt", weights_only=True)
    held = held_out(text_held)
    result = {"seeds": stored["seeds"], "steps": [0, *UPTRAIN_STEPS], "pretrain_steps": 600,
              "loss": {name: [] for name in CONVERSIONS}}
    for seed, state in zip(stored["seeds"], stored["state"]):
        lm = char_lm(len(vocab), seed)
        lm.load_state_dict(state)
        for name, spec in CONVERSIONS.items():
            row = []
            for steps in result["steps"]:
                model = copy.deepcopy(lm) if spec is None else convert(lm, *spec)
                if steps:
                    uptrain(model, text_train, seed, steps)
                with torch.no_grad():
                    row.append(float(lm_loss(model.eval(), held)))
            result["loss"][name].append(row)
            print(seed, name, [round(v, 3) for v in row], flush=True)
    (out_dir / "ch05_uptrain.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(*sys.argv[1:2])
