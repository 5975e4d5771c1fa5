"""flash_attention against PyTorch and the oracle: outputs, lse, gradients, tiling edge cases, bad input,
and the HBM-traffic model and causal block counts."""

import math

import pytest
import torch
import torch.nn.functional as F

from attncourse import flash_attention, flash_attention_forward, scaled_dot_product_attention
from attncourse.flash import (FlashAttentionFunction, causal_block_counts, causal_tile_map,
                              default_block_sizes, flash_block_sizes, hbm_traffic_flash,
                              hbm_traffic_standard, theorem2_bound)

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # small tensors: one thread is faster and immune to a busy machine's thread contention
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=2e-5, atol=2e-5)}


def make(lead, tq, tk, d=16, dv=None, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(*lead, tq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(*lead, tk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(*lead, tk, dv, generator=g, dtype=torch.float64).to(dtype)
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v))


def reference_lse(q, k, is_causal, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale  # (..., Tq, D) @ (..., D, Tk) -> (..., Tq, Tk)
    if is_causal:
        s = s.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
    return torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("t", [1, 7, 63, 64, 65, 200, 1000])
def test_forward_and_lse_match_pytorch(t, is_causal, dtype):
    q, k, v = make((2, 2) if t < 1000 else (1, 2), t, t, 16, dtype=dtype, seed=t)
    blocks = dict(block_q=16, block_k=32) if t < 1000 else dict(block_q=96, block_k=160)
    out, lse = flash_attention_forward(q, k, v, is_causal=is_causal, **blocks)
    assert out.shape == (*q.shape[:-1], 16) and lse.shape == q.shape[:-1] and out.dtype == dtype
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal), **TOL[dtype])
    torch.testing.assert_close(lse, reference_lse(q, k, is_causal), **TOL[dtype])


@pytest.mark.parametrize("tq,tk", [(5, 37), (37, 5), (64, 1), (1, 64), (100, 33), (33, 100)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_tq_differs_from_tk(tq, tk, is_causal):
    q, k, v = make((3,), tq, tk, 8, dv=5)
    out, lse = flash_attention_forward(q, k, v, is_causal=is_causal, block_q=8, block_k=16)
    # the oracle shares PyTorch's top-left causal alignment (query i sees keys 0..i)
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, is_causal=is_causal), **TOL[q.dtype])
    if not (is_causal and tq > tk):
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal),
                                   **TOL[q.dtype])
    torch.testing.assert_close(lse, reference_lse(q, k, is_causal), **TOL[q.dtype])


@pytest.mark.parametrize("block_q,block_k", [(1, 1), (3, 5), (16, 16), (64, 8), (512, 512), (None, None)])
def test_block_sizes_do_not_change_the_result(block_q, block_k):
    q, k, v = make((2, 1), 29, 31, 8)
    for is_causal in (False, True):
        torch.testing.assert_close(flash_attention(q, k, v, is_causal=is_causal, block_q=block_q, block_k=block_k),
                                   scaled_dot_product_attention(q, k, v, is_causal=is_causal), **TOL[q.dtype])


def test_scale_leading_dims_and_broadcast():
    q, k, v = make((2, 3, 2), 9, 11, 4)
    torch.testing.assert_close(flash_attention(q, k, v, scale=0.3, block_q=4, block_k=4),
                               F.scaled_dot_product_attention(q, k, v, scale=0.3), **TOL[q.dtype])
    q2, k2, v2 = make((), 9, 11, 4)  # 2-D inputs
    torch.testing.assert_close(flash_attention(q2, k2, v2, is_causal=True, block_q=2),
                               F.scaled_dot_product_attention(q2, k2, v2, is_causal=True), **TOL[q.dtype])
    k1, v1 = k[:1], v[:1]  # keys shared across the batch (leading dim 1 broadcasts)
    torch.testing.assert_close(flash_attention(q, k1, v1, block_k=3),
                               scaled_dot_product_attention(q, k1, v1), **TOL[q.dtype])


@pytest.mark.parametrize("lead,tq,tk,d,dv,bq,bk", [
    ((2, 3), 13, 13, 8, 8, 4, 4),      # square, length not a block multiple
    ((1, 2), 37, 23, 16, 4, 8, 16),    # Tq > Tk, Dv != D
    ((2,), 23, 41, 8, 8, 16, 8),       # Tq < Tk
    ((1, 1), 1, 17, 8, 8, 4, 4),       # one query
    ((2, 2), 70, 70, 4, 4, 64, 32),    # blocks bigger than some tiles, prime-ish tail
])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gradients_match_autograd_of_naive(lead, tq, tk, d, dv, bq, bk, is_causal):
    q, k, v = make(lead, tq, tk, d, dv, requires_grad=True)
    out, lse = flash_attention_forward(q, k, v, is_causal=is_causal, block_q=bq, block_k=bk)
    g = torch.Generator().manual_seed(1)
    d_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    d_lse = torch.randn(lse.shape, generator=g, dtype=lse.dtype)
    ours = torch.autograd.grad((out * d_out).sum(), (q, k, v), retain_graph=True)
    ref_out = scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    ref = torch.autograd.grad((ref_out * d_out).sum(), (q, k, v))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    # a gradient flowing into lse as well (dS gains P * dlse)
    ours = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), (q, k, v))
    ref_out = scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    ref_loss = (ref_out * d_out).sum() + (reference_lse(q, k, is_causal) * d_lse).sum()
    for a, b in zip(ours, torch.autograd.grad(ref_loss, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_gradcheck_small():
    q, k, v = make((1, 2), 5, 6, 3, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: flash_attention_forward(a, b, c, is_causal=True, block_q=2,
                                                                            block_k=4), (q, k, v))


def test_broadcast_gradients_are_summed():
    q = make((2, 3), 6, 6, 4, requires_grad=True)[0]
    _, k, v = make((1, 3), 6, 6, 4, requires_grad=True)
    ours = torch.autograd.grad(flash_attention(q, k, v, block_q=4, block_k=4).sum(), (q, k, v))
    ref = torch.autograd.grad(scaled_dot_product_attention(q, k, v).sum(), (q, k, v))
    assert ours[1].shape == k.shape
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, **TOL[q.dtype])


def test_float32_gradients_and_autograd_node():
    q, k, v = make((1, 4), 100, 100, 32, dtype=torch.float32, requires_grad=True)
    out = flash_attention(q, k, v, is_causal=True, block_q=32, block_k=48)
    assert isinstance(out.grad_fn, FlashAttentionFunction._backward_cls)
    assert type(out.grad_fn).__name__ == "FlashAttentionFunctionBackward"
    ours = torch.autograd.grad(out.sum(), (q, k, v))
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(), (q, k, v))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_no_autograd_through_the_tiles():
    q, k, v = make((1, 1), 40, 40, 8, requires_grad=True)
    out = flash_attention(q, k, v, block_q=8, block_k=8)
    # the node's only inputs are q, k and v themselves: no graph of per-tile operations behind it
    assert [type(f).__name__ for f, _ in out.grad_fn.next_functions if f is not None] == ["AccumulateGrad"] * 3


def test_no_keys_gives_zeros_and_minus_inf_lse():
    q, k, v = make((2,), 5, 0, 4, requires_grad=True)  # every query row is fully masked
    out, lse = flash_attention_forward(q, k, v, block_q=2)
    assert torch.equal(out, torch.zeros(2, 5, 4, dtype=q.dtype)) and torch.isinf(lse).all() and (lse < 0).all()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.isfinite(q.grad).all()


def test_no_nan_when_a_tile_row_sees_nothing():
    # Bq > Bk under a causal mask: rows at the top of a query block see nothing in the block's last
    # key tile, and large scores make any exp overflow show up as inf or NaN
    q, k, v = make((1, 2), 50, 50, 8, dtype=torch.float32)
    out, lse = flash_attention_forward(q * 30, k * 30, v, is_causal=True, block_q=32, block_k=4)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q * 30, k * 30, v, is_causal=True),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    q, k, v = make((1, 2), 33, 33, 16, dtype=dtype)
    out, lse = flash_attention_forward(q, k, v, is_causal=True, block_q=8, block_k=8)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def test_default_blocks_are_large_on_cpu():
    bq, bk = default_block_sizes("cpu")
    assert bq >= 128 and bk >= 128
    assert min(default_block_sizes("cpu", backward=True)) >= 128


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(block_q=0), ValueError, "block_q"),
    (dict(block_k=-3), ValueError, "block_k"),
    (dict(block_q=2.5), TypeError, "block_q"),
    (dict(block_k=True), TypeError, "block_k"),
    (dict(is_causal=1), TypeError, "is_causal"),
    (dict(scale="0.1"), TypeError, "scale"),
    (dict(scale=float("nan")), ValueError, "scale"),
])
def test_bad_arguments(kwargs, error, words):
    q, k, v = make((1,), 4, 4, 8)
    with pytest.raises(error, match=words):
        flash_attention(q, k, v, **kwargs)


def test_bad_tensors():
    q, k, v = make((2,), 4, 5, 8)
    with pytest.raises(ValueError, match=r"head.*\(2, 4, 8\)"):
        flash_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="same length"):
        flash_attention(q, k, v[:, :3])
    with pytest.raises(ValueError, match="rank"):
        flash_attention(q, k[0], v)
    with pytest.raises(TypeError, match="dtype"):
        flash_attention(q, k.float(), v)
    with pytest.raises(TypeError, match="query"):
        flash_attention(q.numpy(), k, v)
    with pytest.raises(TypeError, match="floating"):
        flash_attention(q.long(), k.long(), v.long())


# ----------------------------------------------------------------------------- block counts and HBM model


def test_causal_tile_map():
    tiles = causal_tile_map(10, 10, 4, 4)
    assert tiles.tolist() == [[1, 0, 0], [2, 1, 0], [2, 2, 1]]
    counts = causal_block_counts(1024, 1024, 128, 128)
    assert counts == {"total": 64, "skipped": 28, "diagonal": 8, "full": 28}
    # uneven blocks, more queries than keys: every tile whose first key is after its last query
    assert causal_tile_map(10, 7, 3, 2).tolist() == [[1, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 2], [2, 2, 2, 2]]
    assert causal_block_counts(10, 7, 3, 2)["skipped"] == 3
    with pytest.raises(ValueError, match="block_k"):
        causal_tile_map(8, 8, 4, 0)


def test_skipped_tiles_agree_with_the_mask():
    t, b = 50, 8
    keep = torch.ones(t, t, dtype=torch.bool).tril()
    tiles = causal_tile_map(t, t, b, b)
    for i in range(tiles.shape[0]):
        for j in range(tiles.shape[1]):
            block = keep[i * b:(i + 1) * b, j * b:(j + 1) * b]
            assert (tiles[i, j] == 0) == (not block.any()) and (tiles[i, j] == 2) == bool(block.all())


def test_hbm_model():
    n, d = 1024, 64
    std = hbm_traffic_standard(n, d)
    assert std.reads == 3 * n * d + 2 * n * n and std.writes == 2 * n * n + n * d
    assert flash_block_sizes(64, 100_000) == (64, 391)
    assert flash_block_sizes(64, 1024) == (4, 4)
    fa = hbm_traffic_flash(n, d, 100_000)
    t_c = math.ceil(n / 391)
    assert fa.reads == 2 * n * d + t_c * (2 * n * d + 2 * n) and fa.writes == n * d + 2 * n + t_c * (n * d + 2 * n)
    assert fa.total < std.total
    # Theta(N^2 d^2 / M): the ratio to the bound settles to a constant (12) as N grows with M fixed
    ratios = [hbm_traffic_flash(n, d, 2**16).total / theorem2_bound(n, d, 2**16) for n in (2**14, 2**16)]
    assert all(11 < r < 14 for r in ratios) and abs(ratios[1] - 12) < abs(ratios[0] - 12) + 1e-9
    # halving M roughly doubles the traffic
    assert 1.8 < hbm_traffic_flash(4096, d, 2**15).total / hbm_traffic_flash(4096, d, 2**16).total < 2.2
    with pytest.raises(ValueError, match="sram"):
        hbm_traffic_flash(n, d, 32)
    with pytest.raises(TypeError, match="seq_len"):
        hbm_traffic_standard(1024.0, 64)
