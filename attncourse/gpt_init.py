"""GPT-2's initialisation and weight tying for :class:`attncourse.gpt.GPT` (chapter 04, section 10).

GPT-2 (Radford et al. 2019, section 2.3) initialises every weight from N(0, 0.02^2) and, "to account for the
accumulation on the residual path with model depth", scales "the weights of residual layers at initialization by a
factor of 1/sqrt(N) where N is the number of residual layers". A pre-norm block adds to the residual stream twice
(attention, then the FFN), so N = 2L for L blocks; the layers that write into the stream are attention's output
projection and the FFN's second linear (nanoGPT's ``c_proj``: std 0.02 / sqrt(2 n_layer)). Biases start at zero and
LayerNorms at gain 1, bias 0. Weight tying (Press & Wolf 2017; GPT-2 does it) makes the output head's matrix the
token embedding's: one (vocab, d_model) matrix used at both ends.
"""

from __future__ import annotations

import math

from torch import nn

from .gpt import GPT


def residual_projections(model: GPT) -> list[nn.Linear]:
    """The layers of `model` that write into the residual stream: per block, attention's output projection and the
    FFN's second linear (2 per block, 2L in all)."""
    if not isinstance(model, GPT):
        raise TypeError(f"model must be an attncourse.gpt.GPT, got {type(model).__name__}")
    return [layer for block in model.blocks for layer in (block.attn.o_proj, block.ff.linear2)]


def gpt2_init(model: GPT, std: float = 0.02, scale_residual: bool = True) -> GPT:
    """Re-initialise `model` in place as GPT-2 does: every Linear and Embedding weight from N(0, std^2), biases 0,
    LayerNorm gain 1 and bias 0; with `scale_residual`, the 2L residual projections from N(0, (std / sqrt(2L))^2).
    Returns `model`."""
    if not (isinstance(std, (int, float)) and std > 0):
        raise ValueError(f"std must be a positive number, got {std!r}")
    projections = residual_projections(model)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    if scale_residual:
        for layer in projections:
            nn.init.normal_(layer.weight, 0.0, std / math.sqrt(len(projections)))
    return model


def tie_weights(model: GPT) -> GPT:
    """Make the output head use the token embedding's matrix (one Parameter, shape (vocab, d_model)). Returns
    `model`."""
    if not isinstance(model, GPT):
        raise TypeError(f"model must be an attncourse.gpt.GPT, got {type(model).__name__}")
    if model.head.weight.shape != model.tok.weight.shape:
        raise ValueError(f"head {tuple(model.head.weight.shape)} and embedding {tuple(model.tok.weight.shape)} "
                         "must have the same shape to be tied")
    model.head.weight = model.tok.weight
    return model
