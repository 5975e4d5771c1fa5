"""Cascade attention (shared prefix once, per-request suffixes, log-sum-exp merge) against PyTorch's kernel."""

import pytest
import torch
import torch.nn.functional as F

from attncourse.cascade import cascade_attention, merge_attention_outputs


def test_cascade_equals_dense_attention_over_prefix_and_suffix():
    g = torch.Generator().manual_seed(0)
    r, h, p, s, d = 3, 2, 9, 6, 8
    f64 = dict(generator=g, dtype=torch.float64)
    pk, pv = torch.randn(h, p, d, **f64), torch.randn(h, p, 5, **f64)  # the shared prefix, (H, P, D)
    sk, sv = torch.randn(r, h, s, d, **f64), torch.randn(r, h, s, 5, **f64)  # each request's suffix, (R, H, S, D)
    lengths = torch.tensor([6, 2, 4])
    for t_q in (1, 2):
        q = torch.randn(r, h, t_q, d, generator=g, dtype=torch.float64)
        out = cascade_attention(q, pk, pv, sk, sv, lengths, chunk_size=4)
        for i, n in enumerate(lengths.tolist()):  # request i: keys [prefix; its first n suffix tokens]
            k = torch.cat([pk, sk[i, :, :n]], 1)  # (H, P + n, D)
            v = torch.cat([pv, sv[i, :, :n]], 1)
            mask = torch.ones(t_q, p + n, dtype=torch.bool).tril(p + n - t_q)  # bottom-right causal
            torch.testing.assert_close(out[i], F.scaled_dot_product_attention(q[i], k, v, attn_mask=mask))


def test_merge_is_attention_over_the_union_and_rejects_bad_input():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 8, generator=g), torch.randn(2, 10, 8, generator=g), torch.randn(2, 10, 3, generator=g)
    parts = []
    for sl in (slice(0, 3), slice(3, 10)):
        s = q @ k[:, sl].transpose(-2, -1) / 8 ** 0.5
        parts += [torch.softmax(s, -1) @ v[:, sl], torch.logsumexp(s, -1)]
    out, lse = merge_attention_outputs(*parts)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-2, -1) / 8 ** 0.5, -1))
    empty = merge_attention_outputs(parts[0], parts[1], torch.zeros_like(parts[0]),
                                    torch.full_like(parts[1], -torch.inf))
    torch.testing.assert_close(empty[0], parts[0])  # a part with no keys changes nothing
    with pytest.raises(ValueError, match="out_a"):
        merge_attention_outputs(parts[0], parts[1], parts[0][:1], parts[3])
    with pytest.raises(ValueError, match="suffix_lengths"):
        cascade_attention(torch.randn(2, 1, 3, 4), torch.randn(1, 5, 4), torch.randn(1, 5, 4), torch.randn(2, 1, 4, 4),
                          torch.randn(2, 1, 4, 4), torch.tensor([4, 2]))
    with pytest.raises(ValueError, match="shapes do not fit"):
        cascade_attention(torch.randn(2, 1, 1, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 4), torch.randn(2, 1, 4, 4),
                          torch.randn(2, 1, 4, 4))
