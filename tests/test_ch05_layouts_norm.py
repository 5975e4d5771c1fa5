"""Chapter 05's MLA-64 with a latent RMSNorm (attncourse.kv_layouts_norm): the same start as the stored MLA-64 but
the norm, the latent normalised, and the absorbed form still equal to the expanded one."""

from __future__ import annotations

import pytest
import torch

from attncourse.kv_layouts import layout_lm
from attncourse.kv_layouts_norm import normed_mla64, train_normed


def test_same_start_as_mla64_and_absorbed_still_exact():
    plain, normed = layout_lm("MLA-64", 20, seed=0), normed_mla64(20, seed=0)
    p, n = plain.state_dict(), normed.state_dict()
    extra = {k for k in n if k not in p}
    assert len(extra) == 4 and all(k.endswith(("kv_down.0.weight", "kv_down.1.weight")) for k in extra)
    for k, v in p.items():
        torch.testing.assert_close(n[k.replace("kv_down.weight", "kv_down.0.weight")], v)
    mla = normed.blocks[0].attn.mla
    x = torch.randn(2, 7, 64, dtype=torch.float64)
    mla.double()
    c = mla.kv_down(x)
    torch.testing.assert_close(c.pow(2).mean(-1), torch.ones(2, 7, dtype=torch.float64), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mla(x, is_causal=True, absorbed=True), mla(x, is_causal=True, absorbed=False))


def test_bad_steps_rejected():
    with pytest.raises(ValueError, match="steps"):
        train_normed(0, "notebooks/data", 0)
