"""attncourse.mla_convert: the partial-RoPE + joint-SVD conversion (MHA2MLA-style) is what it claims: nothing changes
when every pair is kept and the rank is full, the latent is shared by K and V and stays factorised when trained, and
the converted attention's scores equal MLA's absorbed form (no key expanded)."""

import math

import pytest
import torch

from attncourse.mha import MultiHeadAttention
from attncourse.mla_convert import (absorbed_scores, pair_scores, partial_rope_factors, partial_rope_latent,
                                     two_norm_pairs)
from attncourse.positions import apply_rope


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


def test_per_head_pairs_absorbed_and_rotation():
    attn, x = _attn(2), torch.randn(2, 9, 64, dtype=torch.float64)
    pairs = torch.tensor([[3], [0], [7], [5]])
    conv = partial_rope_latent(attn, 1, 20, pairs)
    torch.testing.assert_close(absorbed_scores(attn, 1, 20, x, pairs), _scores(conv, x))
    # each head turns only its own pair, at its own frequency: the rotation of head h equals apply_rope with the
    # head's frequencies zeroed outside its pair
    q = torch.randn(1, 4, 9, 16, dtype=torch.float64)
    rq, _ = conv.rotate(q, q, 3)
    for h in range(4):
        freq = torch.zeros(8, dtype=torch.float64)
        freq[pairs[h, 0]] = attn.inv_freq[pairs[h, 0]]
        torch.testing.assert_close(rq[:, h], apply_rope(q[:, h], torch.arange(3, 12), inv_freq=freq))
    # the fastest pairs given explicitly are the default conversion
    fastest = torch.arange(2).expand(4, 2)
    torch.testing.assert_close(partial_rope_latent(attn, 2, 12, fastest)(x, is_causal=True),
                               partial_rope_latent(attn, 2, 12)(x, is_causal=True))


def test_pair_scores_and_two_norm_rule():
    attn, x = _attn(3, bias=False), torch.randn(3, 7, 64, dtype=torch.float64)
    q, k, _ = attn.project_qkv(x)
    s = pair_scores(attn, x)
    for h, i in ((0, 0), (2, 5), (3, 7)):       # mean 2-norm of the pair (dims i, i + 8) of q, times that of k
        qn = q[0:, h][..., [i, i + 8]].norm(dim=-1).mean()
        kn = k[0:, h][..., [i, i + 8]].norm(dim=-1).mean()
        torch.testing.assert_close(s[h, i], qn * kn)
    with torch.no_grad():                         # plant a dominant pair in head 1: the rule keeps it
        attn.q_proj.weight[16 + 6] *= 50
        attn.k_proj.weight[16 + 6 + 8] *= 50
    lm = torch.nn.Module()
    lm.blocks = torch.nn.ModuleList([torch.nn.Module()])
    lm.blocks[0].attn = attn
    lm.forward = lambda tokens: attn(tokens)
    chosen = two_norm_pairs(lm, x, 2)
    assert chosen[0].shape == (4, 2) and 6 in chosen[0][1].tolist()
    assert not attn._forward_pre_hooks                                  # the hooks are removed


def test_rejects_bad_pairs():
    attn = _attn()
    for bad in (torch.tensor([[0, 0]] * 4), torch.tensor([[0, 8]] * 4), torch.tensor([[0, 1]] * 3),
                torch.tensor([[0.0, 1.0]] * 4)):
        with pytest.raises(ValueError, match="pairs"):
            partial_rope_factors(attn, 2, None, bad)
