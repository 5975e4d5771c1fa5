"""Parity with the delta rule: a reflection (beta = 2) flips the state; trained, beta in [0, 2] learns parity."""

import pytest
import torch
import torch.nn.functional as F

from attncourse import linear_attention as la
from attncourse.state_tracking import (CountingDeltaProduct, ParityDeltaNet, delta_product, parity_batch, train_counting,
                                       train_parity)


def test_parity_batch():
    tokens, target = parity_batch(torch.Generator().manual_seed(0), 5, 7)
    assert tokens.shape == (5, 8) and target.shape == (5, 7) and torch.all(tokens[:, 0] == 2)
    bits = tokens[:, 1:]
    for t in range(7):
        assert torch.equal(target[:, t], bits[:, : t + 1].sum(1) % 2)


def test_beta_two_reflects_the_state():
    # a begin token writes +1 along e1 (beta 1); each 1-bit reflects it (beta 2, value 0); each 0-bit writes nothing
    bits = torch.tensor([1, 0, 1, 1, 0, 1, 1])
    T = 1 + len(bits)
    k = torch.zeros(1, 1, T, 2, dtype=torch.float64)
    k[..., 0] = 1.0
    v = torch.zeros(1, 1, T, 1, dtype=torch.float64)
    v[0, 0, 0] = 1.0
    beta = torch.cat([torch.ones(1), 2.0 * bits.double()])[None, None]
    o, _ = la.recurrent(k, k, v, beta=beta, scale=1.0)
    want = 1.0 - 2.0 * (bits.cumsum(0) % 2).double()  # +1 for even parity, -1 for odd
    torch.testing.assert_close(o[0, 0, 1:, 0], want)
    o_c, _ = la.chunked(k, k, v, beta=beta, scale=1.0, chunk_size=3)
    torch.testing.assert_close(o_c, o)


def test_model_rejects_bad_beta_max():
    for bad in (0, 2.5, True, "2"):
        with pytest.raises(ValueError, match="beta_max"):
            ParityDeltaNet(bad)


def test_negative_eigenvalues_learn_parity_and_positive_ones_do_not():
    train2, test2 = train_parity(2.0, 0)
    train1, test1 = train_parity(1.0, 0)
    assert train2 > 0.99 and test2 > 0.95  # beta in [0, 2]: parity at 4x the trained length
    assert train1 < 0.7 and test1 < 0.6  # beta in [0, 1]: near chance even at the trained length


# ----------------------------------------------------------------------------- DeltaProduct


def _product_recurrence(q, k, v, beta):
    """n_h delta steps per token with la.recurrent_step, the query read after the last: the reference."""
    b, h, t, n_h, dk = k.shape
    S = q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for i in range(t):
        for j in range(n_h):
            o, S = la.recurrent_step(S, q[:, :, i], k[:, :, i, j], v[:, :, i, j], beta=beta[:, :, i, j], scale=1.0)
        outs.append(o)  # the read after the token's last step
    return torch.stack(outs, 2), S


@pytest.mark.parametrize("n_h,t,chunk", [(1, 13, 4), (2, 13, 5), (3, 7, 16)])
def test_delta_product_equals_its_recurrence(n_h, t, chunk):
    gen = torch.Generator().manual_seed(n_h)
    q = torch.randn(2, 2, t, 4, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(2, 2, t, n_h, 4, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(2, 2, t, n_h, 3, generator=gen, dtype=torch.float64)
    beta = 2 * torch.rand(2, 2, t, n_h, generator=gen, dtype=torch.float64)
    o, S = delta_product(q, k, v, beta, chunk_size=chunk, scale=1.0)
    o_ref, S_ref = _product_recurrence(q, k, v, beta)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(S, S_ref)
    if n_h == 1:  # one step per token is DeltaNet
        torch.testing.assert_close(o, la.chunked(q, k[:, :, :, 0], v[:, :, :, 0], beta=beta[..., 0], scale=1.0)[0])


def test_delta_product_rejects_bad_shapes():
    q, k, v, beta = torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 2, 4), torch.randn(1, 1, 5, 2, 3), torch.rand(1, 1, 5, 2)
    with pytest.raises(ValueError, match="beta"):
        delta_product(q, k, v, beta[..., :1])
    with pytest.raises(ValueError, match="k"):
        delta_product(q, k[..., 0, :], v, beta)
    with pytest.raises(ValueError, match="n_h"):
        CountingDeltaProduct(0)


def test_two_reflections_count_modulo_three_and_one_does_not():
    """The lesson's claim on one seed at half its schedule: DeltaNet (n_h = 1, beta in [0, 2]) stays near chance
    (1/3) on the running sum mod 3; DeltaProduct with n_h = 2 learns it at the trained length."""
    one, _ = train_counting(1, 0, steps=150)
    two, _ = train_counting(2, 0, steps=150)
    assert one < 0.5 and two > 0.99
