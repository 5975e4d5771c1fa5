"""Zoology-format MQAR: the batch layout, a causal short convolution, and the models it builds."""

import pytest
import torch

from attncourse.mqar_tokens import ShortConv, ZoologyModel, zoology_batch


def test_batch_layout():
    tokens, targets = zoology_batch(torch.Generator().manual_seed(0), 6, 5, vocab=16)
    assert tokens.shape == (6, 15) and targets.shape == (6, 5)
    keys, values, queries = tokens[:, 0:10:2], tokens[:, 1:10:2] - 16, tokens[:, 10:]
    assert torch.all(keys < 16) and torch.all((values >= 0) & (values < 16))
    for b in range(6):
        assert len(set(keys[b].tolist())) == 5 and sorted(queries[b].tolist()) == sorted(keys[b].tolist())
        table = dict(zip(keys[b].tolist(), values[b].tolist()))
        assert targets[b].tolist() == [table[q] for q in queries[b].tolist()]
    with pytest.raises(ValueError, match="n_pairs"):
        zoology_batch(torch.Generator(), 2, 17, vocab=16)


def test_short_conv_is_causal_and_local():
    conv = ShortConv(3, kernel=4).double()
    x = torch.randn(2, 10, 3, dtype=torch.float64)
    y = conv(x)
    x2 = x.clone()
    x2[:, 6] += 1.0  # change token 6
    d = (conv(x2) - y).abs().sum((0, 2))
    assert torch.all(d[:6] == 0) and torch.all(d[6:10] > 0)  # tokens 6..9 see it (kernel 4), earlier ones do not
    w, b = conv.conv.weight[:, 0], conv.conv.bias  # (C, K), (C,)
    ref = torch.nn.functional.silu(b + sum(w[:, 3 - j] * x[:, 5 - j] for j in range(4)))  # token 5 from tokens 2..5
    torch.testing.assert_close(y[:, 5], ref)


def test_model_has_the_convolution_only_when_asked():
    with_c, without = ZoologyModel("deltanet", True), ZoologyModel("deltanet", False)
    assert any(isinstance(m, ShortConv) for m in with_c.modules())
    assert not any(isinstance(m, ShortConv) for m in without.modules())
    tokens, _ = zoology_batch(torch.Generator().manual_seed(0), 2, 4)
    assert with_c(tokens).shape == (2, 12, 64)


def test_lr_sweep_rejects_bad_rates_and_best_lr_needs_runs():
    import pytest

    from attncourse.mqar_tokens import best_lr, zoology_lr_sweep

    for bad in ((0.0,), (-1e-2,), (1,)):
        with pytest.raises(ValueError, match="lrs"):
            zoology_lr_sweep(("linear",), 4, (0,), bad, steps=1)
    with pytest.raises(ValueError, match="sweep"):
        best_lr({})
