"""Parity with the delta rule: a reflection (beta = 2) flips the state; trained, beta in [0, 2] learns parity."""

import pytest
import torch
import torch.nn.functional as F

from attncourse import linear_attention as la
from attncourse.state_tracking import ParityDeltaNet, parity_batch, train_parity


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
