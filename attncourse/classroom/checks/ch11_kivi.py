"""Chapter 11's exercise 7 (solutions/11_long_context.ipynb): KIVI's key cache as it streams, keys quantised per
channel in groups of `group` tokens, the newest tokens that do not fill a group yet kept exact. Expected values come
from the package's asymmetric quantiser (:func:`attncourse.kv_quant.fake_quantize`) applied group by group."""

from __future__ import annotations

import torch

from attncourse.kv_quant import fake_quantize
from . import Case, exercise


def kivi_keys_reference(k: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """k (..., T, D) -> the keys as KIVI's cache returns them: every full group of `group` tokens (from the start)
    quantised to `bits` bits with one (minimum, step) per channel over the group's tokens, the last T mod group
    tokens exact."""
    full = (k.shape[-2] // group) * group  # tokens in complete groups
    parts = [fake_quantize(k[..., s:s + group, :], bits, -2) for s in range(0, full, group)]
    return torch.cat(parts + [k[..., full:, :]], dim=-2)


def _shortcut_package(k, bits, group):
    from attncourse.kv_quant import fake_quantize as fq
    full = (k.shape[-2] // group) * group  # tokens in complete groups
    return torch.cat([fq(k[..., s:s + group, :], bits, -2) for s in range(0, full, group)] + [k[..., full:, :]], -2)


@exercise("11-kivi-keys", "kivi_keys", points=2, category="implement",
          forbid=("attncourse.kv_quant.fake_quantize", "attncourse.kv_quant.quantized_eval",
                  "attncourse.kv_compress.quantize_kv", "torch.fake_quantize_per_channel_affine",
                  "torch.fake_quantize_per_tensor_affine", "torch.quantize_per_channel", "torch.quantize_per_tensor"),
          allow=(), ops=("aten::fake_quantize_per_channel_affine", "aten::fake_quantize_per_tensor_affine",
                         "aten::fake_quantize_per_channel_affine_cachemask",
                         "aten::fake_quantize_per_tensor_affine_cachemask", "aten::quantize_per_channel",
                         "aten::quantize_per_tensor", "aten::fake_quantize_learnable_per_channel_affine",
                         "aten::fake_quantize_learnable_per_tensor_affine"),
          prop_doc="the layout is the output: the cases plant outlier channels (a per-token scale fails them), change a "
                   "channel's range from one group to the next (one scale per channel over the whole sequence fails "
                   "them), leave tokens after the last full group (quantising them fails), hold a constant channel "
                   "(a step of zero must give it back exactly) and a sequence shorter than a group, once the package's "
                   "quantiser and PyTorch's are refused",
          shortcuts=(_shortcut_package,),
          hint="work group by group from the first token; inside a group every channel gets its own minimum and its "
               "own step, from that channel's range over the group's tokens alone; what should a channel with no "
               "range give back, and which tokens are not in any full group yet?")
def _kivi_keys():
    """KIVI's key cache: per-channel quantisation in groups of tokens, the newest partial group exact."""
    gen = torch.Generator().manual_seed(47)
    cases = []
    for name, shape, bits, group, plant in (
            ("random keys, T = 10 in groups of 4 (2 tokens left over)", (2, 3, 10, 8), 2, 4, None),
            ("two outlier channels of +20 in every token", (1, 2, 12, 8), 2, 4, "outliers"),
            ("a channel's range 100 times larger in the second group", (1, 1, 8, 4), 3, 4, "drift"),
            ("a constant channel", (2, 1, 9, 4), 2, 3, "constant"),
            ("T = 5 shorter than one group of 8: nothing quantised yet", (1, 2, 5, 4), 2, 8, None),
            ("T = 16 in groups of 4, 4 bits", (2, 1, 16, 4), 4, 4, None),
            ("float32 keys, outliers, groups of 32 (KIVI's size)", (1, 2, 70, 16), 2, 32, "outliers")):
        dtype = torch.float32 if name.startswith("float32") else torch.float64
        k = torch.randn(*shape, generator=gen, dtype=torch.float64)
        if plant == "outliers":
            k[..., [1, 5]] += 20.0
        elif plant == "drift":
            k[..., 4:, :] *= 100.0
        elif plant == "constant":
            k[..., 2] = 0.7
        k = k.to(dtype)
        tol = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
        cases.append(Case(f"{name}, k {tuple(k.shape)}, {bits} bits, groups of {group}", (k, bits, group),
                          expected=kivi_keys_reference(k, bits, group), **tol))
    return cases
