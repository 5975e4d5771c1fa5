"""The chunkwise backward of decayed linear attention (attncourse.chunked_backward) against autograd, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attncourse import linear_attention as la
from attncourse.chunked_backward import chunked_backward, chunked_forward


def _inputs(T, seed=0, strong=False):
    gen = torch.Generator().manual_seed(seed)
    q, v = torch.randn(2, 3, T, 5, generator=gen, dtype=torch.float64), torch.randn(2, 3, T, 4, generator=gen,
                                                                                   dtype=torch.float64)
    k = F.normalize(torch.randn(2, 3, T, 5, generator=gen, dtype=torch.float64), dim=-1)
    g = F.logsigmoid(torch.randn(2, 3, T, generator=gen, dtype=torch.float64) + (0.0 if strong else 2.0))
    s0 = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64)
    return q, k, v, g, s0


@pytest.mark.parametrize("T, chunk", [(37, 8), (16, 16), (5, 8), (40, 1)])
def test_forward_equals_recurrence(T, chunk):
    q, k, v, g, s0 = _inputs(T)
    o, states = chunked_forward(q, k, v, g, s0, chunk)
    ref, final = la.recurrent(q, k, v, g, scale=1.0, initial_state=s0)
    torch.testing.assert_close(o, ref)
    torch.testing.assert_close(states[:, :, -1], final)
    torch.testing.assert_close(states[:, :, 0], s0)


@pytest.mark.parametrize("T, chunk, strong", [(37, 8, False), (16, 16, False), (5, 8, False), (40, 1, False),
                                              (33, 4, True)])
def test_backward_equals_autograd(T, chunk, strong):
    q, k, v, g, s0 = _inputs(T, seed=T, strong=strong)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, s0)]
    o = la.recurrent(*leaves[:4], scale=1.0, initial_state=leaves[4])[0]
    d_o = torch.randn_like(o)
    expected = torch.autograd.grad(o, leaves, d_o)
    _, states = chunked_forward(q, k, v, g, s0, chunk)
    got = chunked_backward(q, k, v, g, states, d_o, chunk)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "d_initial_state"), got, expected):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


def test_bad_input():
    q, k, v, g, s0 = _inputs(8)
    with pytest.raises(ValueError, match="g must be"):
        chunked_forward(q, k, v, g[..., None].expand_as(q), s0, 4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_forward(q, k, v, g, s0, 0)
    _, states = chunked_forward(q, k, v, g, s0, 4)
    with pytest.raises(ValueError, match="states must be"):
        chunked_backward(q, k, v, g, states[:, :, :-1], torch.zeros_like(v), 4)
