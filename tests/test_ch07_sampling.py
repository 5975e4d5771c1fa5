"""Sampling filters (temperature, top-k, top-p, min-p) and sampled decoding with a KV cache (chapter 07)."""

from __future__ import annotations

import pytest
import torch

from attncourse.gpt import GPT, GPTConfig, filter_logits


def _kept_by_definition(row: torch.Tensor, top_k=None, top_p=None, min_p=None) -> set[int]:
    """The tokens each filter keeps, from its definition, one row in float64 with Python loops."""
    row = row.double()
    kept = set(range(len(row)))
    if top_k is not None:
        kth = sorted(row.tolist(), reverse=True)[top_k - 1]
        kept = {i for i in kept if row[i] >= kth}
    if top_p is not None:
        z = torch.tensor([row[i] if i in kept else float("-inf") for i in range(len(row))]).softmax(0)
        order = sorted(kept, key=lambda i: -float(z[i]))
        total, nucleus = 0.0, set()
        for i in order:  # the smallest prefix of the most likely tokens whose mass reaches p
            nucleus.add(i)
            total += float(z[i])
            if total >= top_p:
                break
        kept = nucleus
    if min_p is not None:
        z = torch.tensor([row[i] if i in kept else float("-inf") for i in range(len(row))]).softmax(0)
        kept = {i for i in kept if z[i] >= min_p * z.max()}
    return kept


@pytest.mark.parametrize("options", [dict(top_k=5), dict(top_p=0.9), dict(top_p=0.5), dict(min_p=0.1),
                                     dict(top_k=10, top_p=0.8), dict(top_k=1), dict(top_p=1.0),
                                     dict(top_k=8, top_p=0.7, min_p=0.05)])
def test_filters_keep_what_their_definition_keeps(options):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=g, dtype=torch.float64) * 2  # (B, V)
    out = filter_logits(logits, **options)
    for row_in, row_out in zip(logits, out):
        kept = {i for i in range(40) if row_out[i] > float("-inf")}
        assert kept == _kept_by_definition(row_in, **options)
        assert torch.equal(row_out[sorted(kept)], row_in[sorted(kept)])  # the kept logits are untouched


def test_filters_reject_bad_arguments():
    x = torch.randn(2, 5)
    for bad in (dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=-0.1)):
        with pytest.raises(ValueError):
            filter_logits(x, **bad)
    with pytest.raises(TypeError):
        filter_logits([1.0, 2.0])
    with pytest.raises(ValueError, match="temperature"):
        GPT(GPTConfig(vocab_size=7, block_size=8, d_model=16, n_heads=2, n_layers=1)).generate(
            torch.zeros(1, 2, dtype=torch.long), 2, temperature=-1.0)


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_sampled_decode_with_cache_equals_without_at_every_step(position):
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=13, block_size=40, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                      position=position)).eval()
    prompt = torch.randint(0, 13, (3, 5))
    for opts in (dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, min_p=0.2)):
        a, la = m.generate(prompt, 20, generator=torch.Generator().manual_seed(1), return_logits=True, **opts)
        b, lb = m.generate(prompt, 20, generator=torch.Generator().manual_seed(1), return_logits=True,
                           use_cache=False, **opts)
        assert torch.equal(a, b)
        assert torch.equal(la.isinf(), lb.isinf())  # the same tokens filtered out, every step
        torch.testing.assert_close(la.masked_fill(la.isinf(), 0), lb.masked_fill(lb.isinf(), 0))
        kept = (~la.isinf()).sum(-1)
        assert bool((kept >= 1).all())
        if "top_k" in opts:
            assert bool((kept <= opts["top_k"]).all())
