"""flash_attention's signature shared with chapter 10's Triton kernel: grouped KV heads (no copy), causal_align,
window (tiles outside the band skipped), query/key offsets for one key block at a time, the public backward,
and validation. The reference is always the oracle `scaled_dot_product_attention` with the equivalent boolean
mask (written here independently of the package) and K, V repeated over each head group."""

import pytest
import torch
import torch.nn.functional as F

from attncourse import repeat_kv, scaled_dot_product_attention
from attncourse.flash import (Band, TrafficCounter, flash_attention, flash_attention_backward,
                              flash_attention_forward, tile_map)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TOL = dict(rtol=1e-9, atol=1e-10)  # float64 throughout


def allowed_mask(t_q, t_k, is_causal=False, causal_align="top_left", window=None, q_offset=0, k_offset=0):
    """(Tq, Tk) boolean: query i at position i + q_offset (+ Tk - Tq bottom-right) sees key j at j + k_offset."""
    if not is_causal:
        return torch.ones(t_q, t_k, dtype=torch.bool)
    pos = torch.arange(t_q)[:, None] + q_offset + (t_k - t_q if causal_align == "bottom_right" else 0)
    j = torch.arange(t_k)[None, :] + k_offset
    keep = j <= pos
    return keep & (j > pos - window) if window else keep


def qkv(lead, heads, kv_heads, t_q, t_k, d, dv=None, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, heads, t_q, d, generator=gen, dtype=torch.float64)
    k = torch.randn(*lead, kv_heads, t_k, d, generator=gen, dtype=torch.float64)
    v = torch.randn(*lead, kv_heads, t_k, dv or d, generator=gen, dtype=torch.float64)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def expand(x, heads):
    lead, (h_kv, t, d) = x.shape[:-3], x.shape[-3:]
    return repeat_kv(x.reshape(-1, h_kv, t, d), heads // h_kv).reshape(*lead, heads, t, d)


def oracle(q, k, v, **options):
    h = q.shape[-3]
    mask = allowed_mask(q.shape[-2], k.shape[-2], **options)
    return scaled_dot_product_attention(q, expand(k, h), expand(v, h), mask)


def oracle_lse(q, k, **options):
    s = (q @ expand(k, q.shape[-3]).transpose(-2, -1)) / q.shape[-1] ** 0.5
    return torch.logsumexp(s.masked_fill(~allowed_mask(q.shape[-2], k.shape[-2], **options), float("-inf")), -1)


CASES = {  # (lead, H, Hkv, Tq, Tk, D, Dv, options, (block_q, block_k))
    "T1": ((1,), 2, 2, 1, 1, 8, 8, {}, (4, 4)),
    "full-gqa-17x40": ((2,), 4, 2, 17, 40, 8, 5, {}, (8, 16)),
    "causal-mqa-33": ((1,), 3, 1, 33, 33, 8, 8, dict(is_causal=True), (8, 8)),
    "top-left-Tq40-Tk17": ((1,), 2, 1, 40, 17, 8, 8, dict(is_causal=True), (16, 4)),
    "bottom-right-Tq20-Tk37": ((1,), 4, 1, 20, 37, 8, 8, dict(is_causal=True, causal_align="bottom_right"), (7, 5)),
    "bottom-right-empty-rows": ((1,), 2, 2, 37, 20, 8, 8, dict(is_causal=True, causal_align="bottom_right"), (8, 8)),
    "window1": ((1,), 2, 1, 23, 23, 8, 8, dict(is_causal=True, window=1), (4, 4)),
    "window5-gqa": ((2,), 4, 2, 37, 37, 8, 8, dict(is_causal=True, window=5), (8, 8)),
    "window40-bottom-right": ((1,), 2, 2, 23, 70, 8, 8, dict(is_causal=True, causal_align="bottom_right",
                                                             window=40), (8, 16)),
    "window-top-left-empty-rows": ((1,), 2, 1, 40, 17, 8, 8, dict(is_causal=True, window=3), (8, 8)),
    "window-larger-than-Tk": ((1,), 3, 3, 19, 29, 8, 8, dict(is_causal=True, causal_align="bottom_right",
                                                             window=100), (8, 8)),
    "offsets": ((1,), 4, 2, 13, 11, 8, 8, dict(is_causal=True, q_offset=30, k_offset=24, window=9), (4, 4)),
    "rank5-lead-2x1": ((2, 1), 2, 1, 9, 13, 8, 8, dict(is_causal=True, causal_align="bottom_right", window=4),
                       (3, 5)),
    "default-blocks": ((1,), 2, 1, 300, 300, 8, 8, dict(is_causal=True, window=50), (None, None)),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_forward_lse_and_gradients_match_the_oracle_with_the_equivalent_mask(case):
    lead, h, h_kv, t_q, t_k, d, dv, options, (bq, bk) = CASES[case]
    q, k, v = qkv(lead, h, h_kv, t_q, t_k, d, dv, seed=t_q * 100 + t_k, grad=True)
    out, lse = flash_attention_forward(q, k, v, **options, block_q=bq, block_k=bk)
    assert out.shape == (*q.shape[:-1], dv) and lse.shape == q.shape[:-1]
    ref = oracle(q, k, v, **options)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, oracle_lse(q, k, **options), **TOL)
    g = torch.Generator().manual_seed(1)
    d_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    d_lse = torch.randn(lse.shape, generator=g, dtype=lse.dtype).masked_fill(torch.isinf(lse), 0)
    ours = torch.autograd.grad((out * d_out).sum() + (lse.nan_to_num(0, 0, 0) * d_lse).sum(), (q, k, v))
    ref_loss = (ref * d_out).sum() + (oracle_lse(q, k, **options).nan_to_num(0, 0, 0) * d_lse).sum()
    for name, a, b in zip("qkv", ours, torch.autograd.grad(ref_loss, (q, k, v))):
        assert a.shape == b.shape and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"d{n}: {m}")


def test_matches_pytorch_enable_gqa_and_causal_lower_right():
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = qkv((1,), 4, 2, 13, 30, 16, seed=3)
    ours = flash_attention(q, k, v, is_causal=True, causal_align="bottom_right", block_q=4, block_k=8)
    theirs = F.scaled_dot_product_attention(q, expand(k, 4), expand(v, 4), attn_mask=causal_lower_right(13, 30))
    torch.testing.assert_close(ours, theirs, **TOL)
    torch.testing.assert_close(flash_attention(q, k, v, block_q=4, block_k=8),
                               F.scaled_dot_product_attention(q, k, v, enable_gqa=True), **TOL)


def test_causal_align_is_ignored_without_is_causal():
    q, k, v = qkv((1,), 2, 2, 7, 12, 8)
    torch.testing.assert_close(flash_attention(q, k, v, causal_align="bottom_right"), flash_attention(q, k, v))


def test_grouped_heads_are_not_copied(monkeypatch):
    # the loop sees K and V at Hkv heads: every matmul's second operand has Hkv * B batch entries
    import attncourse.flash as flash

    q, k, v = qkv((2,), 8, 2, 16, 16, 8)
    seen = []
    real = torch.bmm
    monkeypatch.setattr(flash.torch, "bmm", lambda a, b: seen.append((a.shape[0], b.shape)) or real(a, b))
    flash_attention(q, k, v, is_causal=True, block_q=8, block_k=8)
    assert seen and all(n == 2 * 2 for n, _ in seen)
    assert all(shape[1] == 8 * 4 or shape[-1] == 8 for _, shape in seen)  # rows of 4 heads share one K tile


@pytest.mark.parametrize("options", [
    dict(is_causal=True), dict(is_causal=True, window=20), dict(is_causal=True, causal_align="bottom_right"),
    dict(is_causal=True, causal_align="bottom_right", window=33), {}])
@pytest.mark.parametrize("t_q,t_k", [(100, 100), (48, 100), (100, 40)])
def test_tile_map_matches_the_mask_and_the_loop_visits_exactly_its_tiles(t_q, t_k, options):
    bq, bk = 16, 8
    mask = allowed_mask(t_q, t_k, **options)
    n_q, n_k = -(-t_q // bq), -(-t_k // bk)
    expected = torch.zeros(n_q, n_k, dtype=torch.long)
    for a in range(n_q):
        for b in range(n_k):
            block = mask[a * bq:(a + 1) * bq, b * bk:(b + 1) * bk]
            expected[a, b] = 2 if block.all() else int(block.any())
    shift = t_k - t_q if options.get("causal_align") == "bottom_right" else 0
    band = Band(causal=bool(options), offset=shift, window=options.get("window"))
    assert torch.equal(tile_map(t_q, t_k, bq, bk, band), expected)
    q, k, v = qkv((1,), 1, 1, t_q, t_k, 8)
    counter = TrafficCounter()
    flash_attention_forward(q, k, v, **options, block_q=bq, block_k=bk, traffic=counter)
    assert counter.tiles == int((expected > 0).sum())  # skipped tiles are never loaded
    assert counter.masked_tiles <= int((expected == 1).sum())  # a tile cut at the band's end may need no mask


def test_window_work_grows_with_the_band_not_with_t_squared():
    q, k, v = qkv((1,), 1, 1, 512, 512, 8)
    counter = TrafficCounter()
    flash_attention_forward(q, k, v, is_causal=True, window=32, block_q=32, block_k=32, traffic=counter)
    assert counter.tiles == 2 * 16 - 1  # each query block: its own tile and the one before it


@pytest.mark.parametrize("options", [dict(is_causal=True), dict(is_causal=True, window=11), {},
                                     dict(is_causal=True, causal_align="bottom_right")])
def test_one_key_block_at_a_time_merged_by_lse(options):
    # what a ring or block-sparse loop does: forward per key block with offsets, merge by lse, then the
    # backward per block with the merged out and lse; dQ sums over blocks
    q, k, v = qkv((1,), 4, 2, 24, 40, 8, seed=5, grad=True)
    blocks = [(0, 13), (13, 21), (21, 40)]
    shift = 40 - 24 if options.get("causal_align") == "bottom_right" else 0
    opts = {key: val for key, val in options.items() if key != "causal_align"}  # positions given as offsets
    with torch.no_grad():
        parts = [flash_attention_forward(q, k[..., a:b, :], v[..., a:b, :], **opts, q_offset=shift, k_offset=a,
                                         block_q=5, block_k=4) for a, b in blocks]
        lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)  # (B, H, Tq)
        weights = [torch.exp(p[1] - lse).nan_to_num(0.0).unsqueeze(-1) for p in parts]
        out = sum(w * p[0] for w, p in zip(weights, parts))  # (B, H, Tq, D)
    ref = oracle(q, k, v, **options)
    torch.testing.assert_close(out, ref, **TOL)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for a, b in blocks:
        dq_b, dk_b, dv_b = flash_attention_backward(q, k[..., a:b, :], v[..., a:b, :], out, lse, grad, **opts,
                                                    q_offset=shift, k_offset=a, block_q=5, block_k=4)
        dq += dq_b
        dks.append(dk_b)
        dvs.append(dv_b)
    want = torch.autograd.grad((ref * grad).sum(), (q, k, v))
    for name, a, b in zip("qkv", (dq, torch.cat(dks, -2), torch.cat(dvs, -2)), want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"d{n}: {m}")


def test_public_backward_equals_autograd_and_accepts_grad_lse():
    q, k, v = qkv((2,), 4, 1, 19, 23, 8, seed=4, grad=True)
    options = dict(is_causal=True, causal_align="bottom_right", window=6, block_q=4, block_k=8)
    out, lse = flash_attention_forward(q, k, v, **options)
    g = torch.Generator().manual_seed(3)
    d_out, d_lse = torch.randn(out.shape, generator=g, dtype=out.dtype), torch.randn(lse.shape, generator=g,
                                                                                     dtype=lse.dtype)
    want = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), (q, k, v))
    got = flash_attention_backward(q, k, v, out.detach(), lse.detach(), d_out, grad_lse=d_lse, **options)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def test_half_precision_grouped_window():
    q, k, v = (x.to(torch.bfloat16) for x in qkv((1,), 4, 2, 33, 33, 16))
    out, lse = flash_attention_forward(q, k, v, is_causal=True, window=7, block_q=8, block_k=8)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), oracle(q.double(), k.double(), v.double(), is_causal=True, window=7),
                               rtol=2e-2, atol=2e-2)


def test_bad_inputs_raise_with_argument_and_shapes():
    q, k, v = qkv((1,), 4, 2, 8, 8, 16)
    fn = flash_attention
    with pytest.raises(ValueError, match=r"head dim.*\(1, 4, 8, 16\).*\(1, 2, 8, 8\)"):
        fn(q, k[..., :8], v)
    with pytest.raises(ValueError, match=r"KV heads.*divide.*query \(1, 4, 8, 16\), key \(1, 3, 8, 16\)"):
        fn(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1))
    with pytest.raises(ValueError, match="same number of heads"):
        fn(q, k, v[:, :1])
    with pytest.raises(ValueError, match="batch dims"):
        fn(q.expand(2, -1, -1, -1), k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1))
    with pytest.raises(ValueError, match="causal_align must be one of"):
        fn(q, k, v, is_causal=True, causal_align="bottom-right")
    with pytest.raises(ValueError, match="causal_align must be one of"):
        fn(q, k, v, causal_align="lower")  # checked even when not causal, as chapter 10 does
    with pytest.raises(ValueError, match="window must be positive"):
        fn(q, k, v, is_causal=True, window=0)
    with pytest.raises(TypeError, match="window must be an int"):
        fn(q, k, v, is_causal=True, window=True)
    with pytest.raises(ValueError, match="window=4 needs is_causal=True"):
        fn(q, k, v, window=4)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        fn(q, k, v, is_causal=1)
    with pytest.raises(TypeError, match="q_offset must be an int"):
        flash_attention_forward(q, k, v, is_causal=True, q_offset=1.0)
    with pytest.raises(TypeError, match="traffic"):
        flash_attention_forward(q, k, v, traffic={})
    out, lse = flash_attention_forward(q, k, v)
    with pytest.raises(ValueError, match=r"grad_out must have shape \(1, 4, 8, 16\)"):
        flash_attention_backward(q, k, v, out, lse, out[..., :4, :])
    with pytest.raises(ValueError, match=r"lse must have shape"):
        flash_attention_backward(q, k, v, out, lse[..., :3], out)
