"""attncourse.kv_quant: KIVI's asymmetric quantiser against PyTorch's fake_quantize_per_channel_affine (float zero
points), and the layout claim it is there for: with outlier key channels, per-channel keys keep the copy and per-token
keys lose it, at 2 bits; without outliers both keep it."""

from __future__ import annotations

import pytest
import torch

from attncourse.heads import planted_induction_model
from attncourse.kv_compress import retrieval_batch
from attncourse.kv_quant import fake_quantize, quantized_eval


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_fake_quantize_equals_pytorch_per_channel_affine(bits):
    x = torch.randn(2, 9, 6, generator=torch.Generator().manual_seed(bits), dtype=torch.float64)  # (H, T, D)
    x[..., 2] += 30.0  # an outlier channel
    levels = 2 ** bits - 1
    for dim, axis in ((-2, 1), (-1, 0)):  # per channel (over tokens), per token (over channels); axis: PyTorch's
        for h in range(2):
            lo, hi = x[h].amin(dim), x[h].amax(dim)
            step = (hi - lo) / levels
            ref = torch.fake_quantize_per_channel_affine(x[h].float(), step.float(), (-lo / step).float(), axis,
                                                         0, levels)
            torch.testing.assert_close(fake_quantize(x[h].float(), bits, dim), ref, rtol=0, atol=1e-5 * 30)
    assert torch.equal(fake_quantize(torch.full((3, 4), 2.5), 2, -2), torch.full((3, 4), 2.5))  # constant: exact
    with pytest.raises(ValueError):
        fake_quantize(x, 0, -1)
    with pytest.raises(TypeError):
        fake_quantize(torch.ones(3, dtype=torch.long), 2, -1)


def test_outlier_key_channels_need_per_channel_keys():
    model = planted_induction_model(16, 12, generator=torch.Generator().manual_seed(0))
    tokens, p = retrieval_batch(torch.Generator().manual_seed(1), 16, 12, 16, question=3, answer=6)
    h, d = model.attns[0].n_kv_heads, model.attns[0].head_dim
    offset = torch.zeros(1, 1, h, d)
    offset[..., [1, d - 2]] = 25.0  # two outlier channels in every head, the same in every token
    acc = {(ax, o is not None): quantized_eval(model, tokens, p, bits=2, key_axis=ax, key_offset=o)["accuracy"]
           for ax in ("channel", "token") for o in (None, offset)}
    assert acc["channel", False] == acc["token", False] == 1.0  # no outliers: either layout keeps the copy
    assert acc["channel", True] == 1.0 and acc["token", True] < 0.2  # outliers: only per-channel keys keep it
    assert quantized_eval(model, tokens, p, bits=16, key_axis="token", key_offset=offset)["accuracy"] == 1.0
    with pytest.raises(ValueError):
        quantized_eval(model, tokens, p, bits=2, key_axis="head")
    with pytest.raises(ValueError):
        quantized_eval(model, tokens, tokens.shape[1] - 1, bits=2)
