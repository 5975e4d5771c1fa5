"""attncourse.chunked_ce: cross-entropy over vocabulary chunks against F.cross_entropy and autograd."""
import pytest
import torch
import torch.nn.functional as F

from attncourse.chunked_ce import chunked_cross_entropy, fwd_bwd_peak_bytes


def _data(n=37, d=16, v=101, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype) * 3
    w = torch.randn(v, d, generator=g, dtype=dtype)
    y = torch.randint(0, v, (n,), generator=g)
    return h, w, y


@pytest.mark.parametrize("chunk", [1, 7, 32, 101, 500])
def test_value_and_gradients_match_cross_entropy(chunk):
    h, w, y = _data()
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ours = chunked_cross_entropy(h1, w1, y, chunk_size=chunk)
    ref = F.cross_entropy(h2 @ w2.T, y)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)   # logits in float32 by design
    for a, b in zip(torch.autograd.grad(ours, (h1, w1)), torch.autograd.grad(ref, (h2, w2))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_peak_memory_is_a_chunk_not_the_vocabulary():
    h, w, y = _data(n=64, d=8, v=2048, dtype=torch.float32)
    full = fwd_bwd_peak_bytes(lambda a, b, t: F.cross_entropy(a @ b.T, t), h, w, y)
    chunked = fwd_bwd_peak_bytes(lambda a, b, t: chunked_cross_entropy(a, b, t, chunk_size=128), h, w, y)
    assert full >= 2 * 64 * 2048 * 4            # the logits and their gradient, at least
    assert chunked < full / 3


def test_rejects_bad_input():
    h, w, y = _data()
    with pytest.raises(ValueError, match="hidden"):
        chunked_cross_entropy(h, w[:, :3], y)
    with pytest.raises(ValueError, match="targets"):
        chunked_cross_entropy(h, w, y[:-1])
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy(h, w, y, chunk_size=0)
    with pytest.raises(TypeError, match="weight"):
        chunked_cross_entropy(h, w.tolist(), y)
