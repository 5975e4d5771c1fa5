"""Block sparsity: tile states from mask functions, the tiled loop over non-empty tiles, and its work."""

import pytest
import torch
import torch.nn.functional as F

from attncourse import bigbird, longformer, masks, scaled_dot_product_attention
from attncourse.block_sparse import EMPTY, FULL, PARTIAL, block_sparse_attention, block_sparse_work, tile_states
from attncourse.flash import causal_tile_map


def by_definition(mask, bq, bk):
    """Tile states from a dense mask, one tile at a time."""
    t_q, t_k = mask.shape
    out = torch.empty(-(-t_q // bq), -(-t_k // bk), dtype=torch.long)
    for a in range(out.shape[0]):
        for b in range(out.shape[1]):
            tile = mask[a * bq:(a + 1) * bq, b * bk:(b + 1) * bk]
            out[a, b] = EMPTY if not tile.any() else FULL if tile.all() else PARTIAL
    return out


PATTERNS = {
    "causal": (masks.causal, 37, 37),
    "window": (masks.sliding_window(9), 50, 50),
    "longformer": (longformer(8, 3), 41, 41),
    "bigbird": (bigbird(45, 6, 2, 2, block_size=5, seed=3), 45, 45),
    "causal Tq < Tk": (masks.causal, 13, 29),
}


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("bq,bk", [(8, 8), (16, 4), (7, 11), (64, 64)])
def test_tile_states_match_the_definition(name, bq, bk):
    mod, t_q, t_k = PATTERNS[name]
    assert torch.equal(tile_states(mod, t_q, t_k, bq, bk), by_definition(masks.materialize(mod, t_q, t_k), bq, bk))


def test_tile_states_agree_with_the_causal_tile_map():
    assert torch.equal(tile_states(masks.causal, 100, 100, 16, 32), causal_tile_map(100, 100, 16, 32))


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_block_sparse_attention_equals_dense_attention_under_the_mask(name, dtype):
    mod, t_q, t_k = PATTERNS[name]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, t_q, 8, generator=g, dtype=dtype)
    k, v = (torch.randn(2, 3, t_k, 8, generator=g, dtype=dtype) for _ in range(2))
    mask = masks.materialize(mod, t_q, t_k)
    got = block_sparse_attention(q, k, v, mod, block_q=8, block_k=16)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.out, scaled_dot_product_attention(q, k, v, mask), **tol)
    torch.testing.assert_close(got.out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), **tol)
    scores = (q.double() @ k.double().transpose(-2, -1)) * 8 ** -0.5
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    torch.testing.assert_close(got.lse.double(), lse, **tol)
    states = tile_states(mod, t_q, t_k, 8, 16)
    assert got.tiles_visited == int((states != EMPTY).sum()) and got.tiles_masked == int((states == PARTIAL).sum())


def test_half_precision_and_rows_with_no_key():
    mod = masks.and_masks(masks.causal, lambda b, h, i, j: i >= 5)  # rows 0..4 see nothing
    q, k, v = torch.randn(3, 1, 2, 20, 16).unbind(0)
    got = block_sparse_attention(q.half(), k.half(), v.half(), mod, block_q=4, block_k=8)
    assert got.out.dtype == torch.float16 and got.lse.dtype == torch.float32
    assert torch.equal(got.out[..., :5, :], torch.zeros_like(got.out[..., :5, :]))
    assert torch.isneginf(got.lse[..., :5]).all()
    ref = scaled_dot_product_attention(q, k, v, masks.materialize(mod, 20, 20))
    torch.testing.assert_close(got.out.float(), ref, rtol=2e-3, atol=2e-3)


def test_work_grows_with_the_pairs_not_with_t_squared():
    visited = [block_sparse_work(tile_states(longformer(128, 8), t, t, 64, 64), t, t, 64, 64, 64)["tiles_visited"]
               for t in (512, 1024, 2048)]
    dense = [(t // 64) ** 2 for t in (512, 1024, 2048)]
    assert visited[2] / visited[1] < 2.3 and dense[2] / dense[1] == 4
    work = block_sparse_work(tile_states(masks.causal, 10, 10, 4, 4), 10, 10, 4, 4, 3)
    assert work == {"tiles_visited": 6, "tiles_masked": 3, "tiles_total": 9,
                    "flops": 4 * 3 * (16 + 16 + 8 + 16 + 8 + 4), "dense_flops": 4 * 100 * 3}


def test_bad_input():
    q = torch.randn(1, 4, 8)
    with pytest.raises(TypeError, match="mask_mod"):
        tile_states("causal", 4, 4, 2, 2)
    with pytest.raises(ValueError, match="block_q"):
        tile_states(masks.causal, 4, 4, 0, 2)
    with pytest.raises(ValueError, match=r"states must be .*\(2, 2\).*\(3, 3\)"):
        block_sparse_attention(q, q, q, masks.causal, block_q=2, block_k=2, states=torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="states must be"):
        block_sparse_work(torch.zeros(1, 1), 4, 4, 2, 2, 8)
