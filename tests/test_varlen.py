"""Packed documents through the chunkwise recurrence equal one run per document (float64), states included."""

import pytest
import torch
import torch.nn.functional as F

from attncourse import linear_attention as la
from attncourse.varlen import chunked_varlen


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
@pytest.mark.parametrize("delta", [False, True])
def test_packed_equals_per_document(gate, delta):
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 17, 1, 33, 9]
    total, H, Dk, Dv = sum(lengths), 2, 6, 4
    cu = torch.tensor([0] + lengths).cumsum(0)
    q = torch.randn(1, H, total, Dk, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(1, H, total, Dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(1, H, total, Dv, generator=gen, dtype=torch.float64)
    g = {"none": None, "scalar": F.logsigmoid(torch.randn(1, H, total, generator=gen, dtype=torch.float64) + 2),
         "channel": F.logsigmoid(torch.randn(1, H, total, Dk, generator=gen, dtype=torch.float64) + 2)}[gate]
    beta = torch.rand(1, H, total, generator=gen, dtype=torch.float64) if delta else None
    o, states = chunked_varlen(q, k, v, cu, g, beta, chunk_size=8)
    assert o.shape == (1, H, total, Dv) and states.shape == (len(lengths), H, Dk, Dv)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        cut = lambda x: None if x is None else x[:, :, a:b]  # noqa: E731
        o_ref, s_ref = la.recurrent(cut(q), cut(k), cut(v), cut(g), cut(beta))
        torch.testing.assert_close(o[:, :, a:b], o_ref)
        torch.testing.assert_close(states[i:i + 1], s_ref)
    # packing without the reset would leak: one long run differs after the first document
    o_leak, _ = la.chunked(q, k, v, g, beta, chunk_size=8)
    assert not torch.allclose(o_leak[:, :, lengths[0]:], o[:, :, lengths[0]:])


def test_gradients_match_per_document():
    gen = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 7, 19])
    q, k, v = (torch.randn(1, 1, 19, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    beta = torch.rand(1, 1, 19, generator=gen, dtype=torch.float64, requires_grad=True)
    grads = torch.autograd.grad(chunked_varlen(q, F.normalize(k, dim=-1), v, cu, beta=beta, chunk_size=4)[0]
                                .square().sum(), (q, k, beta))
    kn = F.normalize(k, dim=-1)
    ref = sum(la.recurrent(q[:, :, a:b], kn[:, :, a:b], v[:, :, a:b], beta=beta[:, :, a:b])[0].square().sum()
              for a, b in ((0, 7), (7, 19)))
    for x, y in zip(grads, torch.autograd.grad(ref, (q, k, beta))):
        torch.testing.assert_close(x, y)


def test_rejects_bad_cu_seqlens():
    x = torch.randn(1, 1, 10, 4)
    for bad in (torch.tensor([0, 4, 9]), torch.tensor([1, 10]), torch.tensor([0, 5, 5, 10]), torch.tensor([0.0, 10.0])):
        with pytest.raises(ValueError, match="cu_seqlens"):
            chunked_varlen(x, x, x, bad)
    with pytest.raises(ValueError, match="batch size 1"):
        chunked_varlen(torch.randn(2, 1, 10, 4), torch.randn(2, 1, 10, 4), torch.randn(2, 1, 10, 4), torch.tensor([0, 10]))
