"""A mixed step of chunked prefill against a paged cache: prompt chunks and a decode token in one varlen batch,
each reading its keys through the block table, equal to one-shot causal attention (PyTorch's SDPA)."""

import pytest
import torch
import torch.nn.functional as F

from attncourse.paged_cache import PagedKVCache, paged_varlen_attention


def test_chunks_and_a_decode_in_one_batch_equal_one_shot_attention():
    gen = torch.Generator().manual_seed(0)
    h, hkv, d, page = 4, 2, 8, 4
    qa, ka, va = (torch.randn(h if i == 0 else hkv, 23, d, generator=gen, dtype=torch.float64) for i in range(3))
    qb, kb, vb = (torch.randn(h if i == 0 else hkv, 10, d, generator=gen, dtype=torch.float64) for i in range(3))
    cache = PagedKVCache(16, page, hkv, d, dtype=torch.float64)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(b, kb[:, :9], vb[:, :9])  # b's prompt is in the cache; it decodes its 10th token below
    outs, start = [], 0
    for stop in (7, 16, 23):  # a's prompt in chunks of 7, 9 and 7 tokens (ragged against the pages of 4)
        cache.append(a, ka[:, start:stop], va[:, start:stop])
        new_b = stop == 16  # b's decode token rides in the middle step
        if new_b:
            cache.append(b, kb[:, 9:], vb[:, 9:])
        q = torch.cat([qa[:, start:stop]] + ([qb[:, 9:]] if new_b else []), 1).transpose(0, 1)  # (N, H, D)
        got = paged_varlen_attention(q, [stop - start] + ([1] if new_b else []), cache, [a, b] if new_b else [a])
        outs.append(got[:stop - start])
        if new_b:
            want_b = F.scaled_dot_product_attention(qb[None, :, 9:], kb.repeat_interleave(2, 0)[None],
                                                    vb.repeat_interleave(2, 0)[None])[0]  # (H, 1, D)
            torch.testing.assert_close(got[stop - start:].transpose(0, 1), want_b)
        start = stop
    want_a = F.scaled_dot_product_attention(qa[None], ka.repeat_interleave(2, 0)[None],
                                            va.repeat_interleave(2, 0)[None], is_causal=True)[0]  # (H, 23, D)
    torch.testing.assert_close(torch.cat(outs, 0).transpose(0, 1), want_a)
    with pytest.raises(ValueError, match="add up"):
        paged_varlen_attention(torch.zeros(3, h, d, dtype=torch.float64), [2], cache, [a])
