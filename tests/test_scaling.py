"""attncourse.scaling: gradients checked against autograd on the oracle and the closed-form softmax Jacobian."""

import math

import pytest
import torch

from attncourse import scaled_dot_product_attention
from attncourse.scaling import LookupConfig, lookup_batch, score_gradients, train_lookup


@pytest.mark.parametrize("scale", ["sqrt", "none", "d", 0.3])
def test_score_gradients_match_autograd_on_the_oracle(scale):
    d_k, n, n_keys = 8, 5, 7
    got = score_gradients(d_k, scale, seed=3, n=n, n_keys=n_keys)
    gen = torch.Generator().manual_seed(3)               # the same draws, through the course's oracle
    q = torch.randn(n, 1, d_k, generator=gen).requires_grad_()
    k = torch.randn(n, n_keys, d_k, generator=gen).requires_grad_()
    v = torch.randn(n, n_keys, d_k, generator=gen)
    u = torch.randn(n, 1, d_k, generator=gen)
    c = {"sqrt": 1 / math.sqrt(d_k), "none": 1.0, "d": 1 / d_k}.get(scale, scale)
    (scaled_dot_product_attention(q, k, v, scale=c) * u).sum().backward()
    torch.testing.assert_close(got["query"], q.grad.flatten(1).norm(dim=-1))
    torch.testing.assert_close(got["key"], k.grad.flatten(1).norm(dim=-1))
    # dL/ds by the closed form: p * (g - <p, g>) with g = dL/dp = V u
    with torch.no_grad():
        p = torch.softmax(q @ k.transpose(-2, -1) * c, dim=-1)           # (n, 1, n_keys)
        g = u @ v.transpose(-2, -1)                                      # (n, 1, n_keys)
        ds = p * (g - (p * g).sum(-1, keepdim=True))
    torch.testing.assert_close(got["logits"], ds.flatten(1).norm(dim=-1))
    torch.testing.assert_close(got["max_weight"], p.flatten(1).amax(-1))


def test_unscaled_saturation_kills_the_bulk_not_the_tail():
    s = [score_gradients(1024, "sqrt", seed) for seed in range(2)]
    u = [score_gradients(1024, "none", seed) for seed in range(2)]
    for a, b in zip(s, u):
        assert b["logits"].median() < a["logits"].median() / 100
        assert 0.5 < b["logits"].quantile(0.99) / a["logits"].quantile(0.99) < 2
        assert (b["max_weight"] > 0.99).float().mean() > 0.5


def test_train_lookup_is_deterministic_and_learns():
    config = LookupConfig(steps=60)
    a, b = train_lookup(64, "sqrt", 1, config), train_lookup(64, "sqrt", 1, config)
    torch.testing.assert_close(a["loss"], b["loss"])
    assert a["loss"][-10:].mean() < 0.5 * a["loss"][:10].mean()
    assert set(a) == {"loss", "saturated", "logit_grad", "max_logit", "saturated_grad_share", "saturated_wrong",
                      "saturated_wrong_loss", "entropy"} and a["loss"].shape == (60,)
    assert ((a["entropy"] >= 0) & (a["entropy"] <= math.log(config.n_keys) + 1e-5)).all()


def test_saturated_rows_traces():
    """Unscaled at d_k = 256 most rows start saturated on a wrong key (most of the loss) and pass almost no
    gradient; scaled, none is saturated at the start. Shares lie in [0, 1], wrong rows are a part of saturated ones."""
    config = LookupConfig(steps=5)
    plain, scaled = train_lookup(256, "none", 0, config), train_lookup(256, "sqrt", 0, config)
    for t in (plain, scaled):
        for name in ("saturated_grad_share", "saturated_wrong", "saturated_wrong_loss"):
            assert ((t[name] >= 0) & (t[name] <= 1)).all(), name
        assert (t["saturated_wrong"] <= t["saturated"]).all()
    assert plain["saturated_wrong"][0] > 0.4 and plain["saturated_wrong_loss"][0] > 0.5
    assert plain["saturated_grad_share"][0] < 0.01
    assert scaled["saturated"][0] == 0 and scaled["saturated_grad_share"][0] == 0


def test_lookup_batch_targets_are_the_picked_values():
    config = LookupConfig(batch=4, noise=0.0)
    tokens, values, queries, target = lookup_batch(config, torch.Generator().manual_seed(0))
    assert tokens.shape == (4, 16, 32) and values.shape == (4, 16, 8) and queries.shape == (4, 32)
    for b in range(4):
        j = int((tokens[b] == queries[b]).all(-1).nonzero())
        torch.testing.assert_close(target[b], values[b, j])


@pytest.mark.parametrize("bad", ["half", 0, -1.0, True, None])
def test_bad_scale_is_refused(bad):
    with pytest.raises(ValueError, match="scale"):
        score_gradients(8, bad, 0)


def test_bad_sizes_are_refused():
    with pytest.raises((ValueError, TypeError), match="d_k"):
        train_lookup(0, "sqrt", 0)
    with pytest.raises((ValueError, TypeError), match="n_keys"):
        score_gradients(8, "sqrt", 0, n_keys=0)


def test_train_lookup_qk_norm_and_cap():
    """QK-norm at step 0 (gains 1): every logit is at most sqrt(d_k) in size (Cauchy-Schwarz on two vectors of norm
    sqrt(d_k), times 1/sqrt(d_k)); a cap holds every logit below it at every step; a bad cap is refused."""
    import math

    config = LookupConfig(steps=20, lr=3e-2)
    normed = train_lookup(16, "sqrt", 0, config, qk_norm=True)
    assert normed["max_logit"][0] <= math.sqrt(16) + 1e-4
    capped = train_lookup(16, "none", 0, config, cap=5.0)
    assert (capped["max_logit"] <= 5.0).all() and capped["max_logit"].max() > 4.0  # unscaled logits hit the cap
    plain = train_lookup(16, "none", 0, config)
    assert plain["max_logit"].max() > 5.0
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(ValueError, match="cap"):
            train_lookup(16, "sqrt", 0, config, cap=bad)


def test_zero_query_starts_uniform_and_learns():
    """muP's initialisation: with W_q at zero every logit is 0 at step 1 (uniform weights); W_q still learns."""
    config = LookupConfig(steps=30, lr=3e-2)
    t = train_lookup(64, "d", 0, config, zero_q=True)
    assert t["max_logit"][0] == 0 and t["saturated"][0] == 0
    assert t["max_logit"][-1] > 0 and t["loss"][-5:].mean() < t["loss"][:5].mean()
