"""attncourse.mla_convert: the partial-RoPE + joint-SVD conversion (MHA2MLA-style) is what it claims: nothing changes
when every pair is kept and the rank is full, the latent is shared by K and V and stays factorised when trained, and
the converted attention's scores equal MLA's absorbed form (no key expanded)."""

import math

import pytest
import torch

from attncourse.mha import MultiHeadAttention
from attncourse.mla_convert import absorbed_scores, partial_rope_factors, partial_rope_latent


def _attn(seed=0, bias=True):
    torch.manual_seed(seed)
    return MultiHeadAttention(64, 4, rope_base=10000.0, bias=bias).double()


def _scores(attn, x):
    q, k, _ = attn.project_qkv(x)
    q, k = attn.rotate(q, k, 0)
    return q @ k.transpose(-2, -1) / math.sqrt(attn.head_dim)


def test_identity_cases():
    attn, x = _attn(), torch.randn(2, 12, 64, dtype=torch.float64)
    torch.testing.assert_close(partial_rope_latent(attn, 8, None)(x, is_causal=True), attn(x, is_causal=True))
    partial = partial_rope_latent(attn, 1, None)
    full_rank = partial_rope_latent(attn, 1, 64)  # rank = d: the SVD is exact
    torch.testing.assert_close(full_rank(x, is_causal=True), partial(x, is_causal=True))
    assert not torch.allclose(partial(x, is_causal=True), attn(x, is_causal=True))  # the partial-RoPE step changes it


def test_absorbed_equals_expanded_and_latent_is_shared():
    attn, x = _attn(1), torch.randn(2, 10, 64, dtype=torch.float64)
    for keep, rank, bias in ((1, 24, True), (4, 32, True), (2, 5, False)):
        attn = _attn(1, bias)
        conv = partial_rope_latent(attn, keep, rank)
        torch.testing.assert_close(absorbed_scores(attn, keep, rank, x), _scores(conv, x))
        assert conv.k_proj.down is conv.v_proj[0]                       # one latent for K and V
        assert conv.k_proj.down.weight.shape == (rank, 64)
        f = partial_rope_factors(attn, keep, rank)
        assert len(f["rope"]) == 2 * keep * 4 and len(f["rope"]) + rank == 8 * keep + rank


def test_rejects():
    attn = _attn()
    with pytest.raises(ValueError, match="keep"):
        partial_rope_factors(attn, 9, None)
    with pytest.raises(ValueError, match="rank"):
        partial_rope_factors(attn, 1, 500)
    with pytest.raises(ValueError, match="RoPE"):
        partial_rope_factors(MultiHeadAttention(64, 4), 1, 8)
