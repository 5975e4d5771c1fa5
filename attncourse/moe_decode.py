r"""Weights a mixture-of-experts decode step reads, and how many bytes per weight it reads them at.

A decode step of a dense model reads every weight once, whatever the batch: per token the weight bytes
fall as ``1 / B``. In a mixture-of-experts (MoE) layer each token is routed to ``k`` of ``E`` experts and a
step reads only the experts some token of the batch chose. If the ``B`` tokens route independently and
uniformly (``k`` distinct experts each), an expert is missed by one token with probability ``1 - k/E``,
so the expected number of distinct experts a layer reads is

.. math:: \mathbb{E}[\text{touched}] = E\,\bigl(1 - (1 - k/E)^B\bigr),

``k`` at ``B = 1``, about ``Bk`` while ``Bk \ll E``, and ``E`` for large ``B``. For independent tokens
with any other routing probabilities ``p_e`` (summing to ``k``), ``\sum_e 1 - (1 - p_e)^B`` is concave
in ``p`` and largest at ``p_e = k/E``: uniform routing touches the most experts, a skewed router fewer.

Configurations are the published ones (config.json of the released checkpoints; totals from the
papers and model cards). Parameters outside the routed experts (attention, shared experts, dense
layers, router, output head) are read in full at every step; the input embedding table is read one row
per token and left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _validate


@dataclass(frozen=True)
class MoEConfig:
    """A published MoE model: routed-expert layout plus its published total and active parameters."""

    name: str
    n_params: float  # total, as published
    n_active: float  # active per token, as published
    n_moe_layers: int  # layers with routed experts
    n_experts: int  # routed experts per MoE layer (E)
    top_k: int  # experts per token (k)
    expert_params: int  # parameters of one routed expert
    embedding_params: int  # input embedding table (vocab x d_model): one row read per token
    source: str

    @property
    def routed_params(self) -> int:
        return self.n_moe_layers * self.n_experts * self.expert_params

    @property
    def always_read_params(self) -> float:
        """Weights every decode step reads in full: everything but the routed experts and the embedding."""
        return self.n_params - self.routed_params - self.embedding_params

    @property
    def active_params(self) -> float:
        """Active per token from the layout (compare with the published ``n_active``)."""
        return self.always_read_params + self.n_moe_layers * self.top_k * self.expert_params


DEEPSEEK_V3 = MoEConfig(
    "DeepSeek-V3", 671e9, 37e9, n_moe_layers=58, n_experts=256, top_k=8,
    expert_params=3 * 7168 * 2048, embedding_params=129280 * 7168,
    source="DeepSeek-AI 2024, arXiv 2412.19437, sec. 2 and 4.2 (61 layers, first 3 dense; 1 shared + 256 "
           "routed experts, 8 per token; expert width 2048, d_model 7168); config.json of deepseek-ai/DeepSeek-V3; "
           "671B total excludes the multi-token-prediction module")
GPT_OSS_120B = MoEConfig(
    "gpt-oss-120b", 116.83e9, 5.13e9, n_moe_layers=36, n_experts=128, top_k=4,
    expert_params=3 * 2880 * 2880 + 3 * 2880, embedding_params=201088 * 2880,
    source="OpenAI 2025, gpt-oss-120b & gpt-oss-20b model card, Table 1 (36 layers, 128 experts, top-4, "
           "116.83B total, 5.13B active); config.json of openai/gpt-oss-120b (d_model and expert width 2880, "
           "gated expert with biases)")
MOE_CONFIGS = (DEEPSEEK_V3, GPT_OSS_120B)

# Bits per weight streamed from memory: 16-bit, 8-bit, and 4-bit with one 16-bit scale per group of 128
# (GPTQ/AWQ style); MXFP4 (gpt-oss's released experts) is 4 bits + one 8-bit scale per 32 = 4.25.
BITS = {"bf16": 16.0, "int8": 8.0, "int4 (g128)": 4.0 + 16 / 128}


def expected_experts_touched(n_experts: int, top_k: int, batch_size: int) -> float:
    """Expected distinct experts one MoE layer reads for `batch_size` tokens routed uniformly, top-k each."""
    for name, v in (("n_experts", n_experts), ("top_k", top_k), ("batch_size", batch_size)):
        _validate.positive_int(name, v)
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} must be at most n_experts={n_experts}")
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** batch_size)


def simulate_experts_touched(n_experts: int, top_k: int, batch_size: int, trials: int,
                             generator: torch.Generator | None = None,
                             popularity: torch.Tensor | None = None) -> torch.Tensor:
    """Distinct experts touched in each of `trials` simulated steps, as a (trials,) float tensor.

    Each token picks `top_k` distinct experts: uniformly (`popularity` None, the top-k of i.i.d. uniform
    scores) or without replacement with weights `popularity` (E,), a skewed router.
    """
    expected_experts_touched(n_experts, top_k, batch_size)  # validates the three sizes
    _validate.positive_int("trials", trials)
    if popularity is not None:
        _validate.tensor("popularity", popularity, floating=True)
        if popularity.shape != (n_experts,) or bool((popularity <= 0).any()):
            raise ValueError(f"popularity must be ({n_experts},) and positive, got shape {tuple(popularity.shape)}")
    rows = trials * batch_size
    if popularity is None:
        chosen = torch.rand(rows, n_experts, generator=generator).topk(top_k, dim=-1).indices   # (rows, k)
    else:
        chosen = torch.multinomial(popularity.expand(rows, n_experts), top_k, generator=generator)  # (rows, k)
    hit = torch.zeros(rows, n_experts, dtype=torch.bool).scatter_(1, chosen, True)           # (rows, E)
    return hit.view(trials, batch_size, n_experts).any(1).sum(-1).float()                     # (trials,)


def weight_bytes_per_step(cfg: MoEConfig, batch_size: int, bits: float = 16.0) -> dict[str, float]:
    """Expected weight bytes one decode step of `batch_size` tokens reads (uniform routing)."""
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
    if not isinstance(bits, (int, float)) or isinstance(bits, bool) or bits <= 0:
        raise ValueError(f"bits must be a positive number, got {bits!r}")
    touched = expected_experts_touched(cfg.n_experts, cfg.top_k, batch_size)
    experts = cfg.n_moe_layers * touched * cfg.expert_params * bits / 8
    shared = cfg.always_read_params * bits / 8
    return {"experts_touched": touched, "experts": experts, "always_read": shared, "total": experts + shared}


def expert_intensity(cfg: MoEConfig, batch_size: int, bits: float = 16.0) -> float:
    """FLOPs per byte of the routed experts in a decode step: 2 B k P FLOPs over touched P bits/8 bytes."""
    touched = weight_bytes_per_step(cfg, batch_size, bits)["experts_touched"]
    return 2 * batch_size * cfg.top_k / (touched * bits / 8)
