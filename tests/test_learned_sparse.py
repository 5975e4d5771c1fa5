"""Chapter 14's package: learned block and token selection, checked against dense attention under the equivalent
mask (PyTorch's kernel and the course's oracle), against a port of MoBA's reference algorithm, and by autograd."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attncourse.flash import flash_attention
from attncourse.learned_sparse import (blocks_to_mask, compressed_attention, indexer_cost, indexer_kl_loss,
                                       indexer_scores, mean_pool_blocks, moba_gate, n_blocks, nsa_attention,
                                       nsa_select, selected_attention, selected_work, token_select_attention,
                                       top_k_tokens)
from attncourse.sdpa import scaled_dot_product_attention
from attncourse.sparse_recall import METHODS, RecallConfig, recall_batch, train_recall


def qkv(b=2, h=4, hkv=2, t=37, d=8, dv=5, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, t, d, generator=gen, dtype=dtype), torch.randn(b, hkv, t, d, generator=gen, dtype=dtype),
            torch.randn(b, hkv, t, dv, generator=gen, dtype=dtype))


def dense(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask)


def moba_naive_reference(q, k, v, chunk, topk):
    """A PyTorch port of MoonshotAI/MoBA's ``moba/moba_naive.py`` (``moba_attn_varlen_naive``, one sequence; here
    (H, S, D) per batch row): gate = q . mean(K_block), the query's own block +inf, later blocks -inf, top-k blocks
    with the index mask for ties, then a causal mask and a softmax over the gated scores."""
    h, s, d = q.shape
    nb = math.ceil(s / chunk)
    gate_keys = torch.stack([k[:, i * chunk:min((i + 1) * chunk, s)].mean(1) for i in range(nb)], dim=1)  # (H,N,D)
    gate = torch.einsum("hsd,hnd->hsn", q, gate_keys)
    for i in range(nb):
        s_mask = torch.arange(s)[None, :, None] < (i + 1) * chunk
        n_mask = torch.arange(nb)[None, None, :] == i
        gate = gate.masked_fill(s_mask & n_mask, -float("inf"))
        block = ((torch.arange(s) >= i * chunk) & (torch.arange(s) < (i + 1) * chunk))[None, :, None]
        gate = gate.masked_fill(block & n_mask, float("inf"))
    val, idx = torch.topk(gate, k=min(topk, nb), dim=-1, largest=True, sorted=False)
    need = gate >= val.min(dim=-1, keepdim=True).values
    idx_mask = torch.zeros_like(need).scatter_(-1, idx, True)
    need &= idx_mask
    add = torch.where(need, 0.0, -float("inf")).to(q.dtype).repeat_interleave(chunk, dim=-1)[:, :, :s]
    add = add.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), -float("inf"))
    scores = (q @ k.transpose(-2, -1) + add) * d ** -0.5
    return torch.softmax(scores, dim=-1) @ v


# ----------------------------------------------------------------------------- the tile loop


@pytest.mark.parametrize("block, block_q", [(6, 1), (6, 4), (8, 8), (5, 3), (37, 4), (1, 5)])
def test_every_block_selected_is_dense_causal(block, block_q):
    q, k, v = qkv()
    sel = torch.ones(2, 4, 37, n_blocks(37, block), dtype=torch.bool)
    r = selected_attention(q, k, v, sel, block, block_q=block_q)
    torch.testing.assert_close(r.out, dense(q, k, v, torch.ones(37, 37, dtype=torch.bool).tril()))
    ref = scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(r.out, ref)


@pytest.mark.parametrize("shared", [False, True])
def test_selected_attention_equals_dense_under_the_token_mask(shared):
    q, k, v = qkv(t=41)
    gen = torch.Generator().manual_seed(3)
    sel = torch.rand(2, 2 if shared else 4, 41, n_blocks(41, 6), generator=gen) < 0.4
    for bq in (1, 5):
        r = selected_attention(q, k, v, sel, 6, block_q=bq)
        mask = blocks_to_mask(sel, 6, 41)
        if shared:
            mask = mask.repeat_interleave(2, 1)
        expected = dense(q, k, v, mask)
        empty = ~mask.any(-1)  # rows that selected nothing before them: zeros (SDPA gives NaN)
        torch.testing.assert_close(r.out[~empty], expected[~empty])
        assert torch.all(r.out[empty] == 0) and torch.all(r.lse[empty] == -math.inf)


def test_moba_equals_the_reference_algorithm_and_work_is_proportional():
    q, k, v = qkv(h=2, hkv=2, t=40, d=16, dv=16, seed=5)
    for chunk, topk in ((8, 2), (8, 3), (5, 4), (7, 1), (8, 9)):
        sel = moba_gate(q, k, chunk, topk)
        r = selected_attention(q, k, v, sel, chunk)
        ref = torch.stack([moba_naive_reference(q[i], k[i], v[i], chunk, topk) for i in range(2)])
        torch.testing.assert_close(r.out, ref)
        # one query per tile: the blocks visited are exactly the blocks selected, at most top_k per query
        assert r.tiles == int(sel.sum()) == selected_work(sel, chunk, 40)["blocks"]
        assert int(sel.sum(-1).max()) <= topk
        assert torch.all(sel[..., torch.arange(40), torch.arange(40) // chunk])  # the own block, always
        later = torch.arange(n_blocks(40, chunk))[None, :] > (torch.arange(40) // chunk)[:, None]
        assert not torch.any(sel & later)


def test_moba_gate_is_mean_key_score_and_gqa():
    q, k, _ = qkv(h=4, hkv=1, t=32, seed=2)
    sel = moba_gate(q, k, 8, 2)
    pooled = k.view(2, 1, 4, 8, 8).mean(3)  # (B, 1, nB, D)
    score = q @ pooled.transpose(-2, -1)  # (B, H, T, nB)
    for t in (8, 20, 31):
        own = t // 8
        best = int(score[0, 3, t, :own].argmax())
        assert sel[0, 3, t].nonzero().flatten().tolist() == sorted({best, own})
    torch.testing.assert_close(mean_pool_blocks(torch.arange(10.0)[:, None], 4).flatten(), torch.tensor([1.5, 5.5, 8.5]))


def test_selected_attention_work_grows_with_selection_not_length():
    tiles = []
    for t in (128, 256):
        q, k, v = qkv(b=1, h=2, hkv=1, t=t, d=8, dv=8, dtype=torch.float32)
        sel = moba_gate(q, k, 16, 3)
        shared = sel.any(1, keepdim=True)  # (1, 1, T, nB): the group's union, at most 1 + 2 x 2 blocks per query
        r = selected_attention(q, k, v, shared, 16)
        tiles.append(r.tiles)
        assert r.tiles == int(shared.sum()) <= 5 * t
    assert tiles[1] < 2.5 * tiles[0]  # about linear in T (early queries have fewer earlier blocks); dense: x4


def test_half_precision_computes_in_float32_and_backward_flows_through_selected_values():
    q, k, v = qkv(dtype=torch.float32)
    sel = moba_gate(q, k, 6, 2)
    r16 = selected_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), sel, 6)
    assert r16.out.dtype == torch.bfloat16
    ref = dense(q, k, v, blocks_to_mask(sel, 6, 37))
    torch.testing.assert_close(r16.out.float(), ref, atol=3e-2, rtol=3e-2)
    q, k, v = (x.double().requires_grad_() for x in qkv())
    sel = moba_gate(q.detach(), k.detach(), 6, 2)
    g = torch.randn(2, 4, 37, 5, dtype=torch.float64)
    ga = torch.autograd.grad((selected_attention(q, k, v, sel, 6).out * g).sum(), (q, k, v))
    gb = torch.autograd.grad((dense(q, k, v, blocks_to_mask(sel, 6, 37)) * g).sum(), (q, k, v))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b)
    # one query's output: the keys outside its selected blocks get no gradient (the choice is not differentiated)
    dk = torch.autograd.grad(selected_attention(q, k, v, sel, 6).out[0, 0, -1].sum(), k)[0]  # (B, Hkv, T, D)
    unread = ~blocks_to_mask(sel, 6, 37)[0, 0, -1]  # (T,) keys query 36 of head 0 did not read
    assert unread.sum() > 0 and torch.all(dk[0, 0, unread] == 0) and torch.all(dk[0, 0, ~unread].abs().sum(-1) > 0)


# ----------------------------------------------------------------------------- NSA


def test_nsa_branches_against_dense_with_their_masks():
    q, k, v = qkv(t=40, seed=7)
    gates = torch.rand(2, 4, 40, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    r = nsa_attention(q, k, v, gates, 8, 2, 10)
    # compressed: attention over the pooled blocks finished before each query, as a dense masked attention
    kc, vc = mean_pool_blocks(k, 8), mean_pool_blocks(v, 8)
    done = (torch.arange(5)[None, :] + 1) * 8 - 1 <= torch.arange(40)[:, None]
    cmp = dense(q, kc, vc, done)
    torch.testing.assert_close(r.compressed[:, :, 7:], cmp[:, :, 7:])
    assert torch.all(r.compressed[:, :, :7] == 0)
    # selection: shared by the group, from the group's summed probabilities
    probs = compressed_attention(q, k, v, 8)[1]
    torch.testing.assert_close(probs[:, :, 7:], torch.softmax((q @ kc.repeat_interleave(2, 1).transpose(-2, -1) / 8 ** 0.5)
                                                             .masked_fill(~done, -math.inf), -1)[:, :, 7:])
    assert r.selection.shape == (2, 2, 40, 5)
    imp = probs.view(2, 2, 2, 40, 5).sum(2)
    t = 39
    best = imp[1, 1, t, :4].topk(2).indices.tolist()
    assert sorted(r.selection[1, 1, t].nonzero().flatten().tolist()) == sorted(best + [4])
    # selected: dense attention under the group's token mask; window: flash = SDPA with a band
    torch.testing.assert_close(r.selected, dense(q, k, v, blocks_to_mask(r.selection, 8, 40).repeat_interleave(2, 1)))
    i, j = torch.arange(40)[:, None], torch.arange(40)[None, :]
    torch.testing.assert_close(r.window, dense(q, k, v, (j <= i) & (j > i - 10)))
    torch.testing.assert_close(r.out, gates[..., :1] * r.compressed + gates[..., 1:2] * r.selected
                               + gates[..., 2:] * r.window)
    assert r.tiles == int(r.selection.sum())


def test_nsa_gradients_reach_the_gates_and_the_compressed_keys():
    q, k, v = (x.requires_grad_() for x in qkv(t=24, seed=9))
    gates = torch.rand(2, 4, 24, 3, dtype=torch.float64).requires_grad_()
    out = nsa_attention(q, k, v, gates, 6, 1, 6).out
    dg, dk = torch.autograd.grad(out.square().sum(), (gates, k))
    assert dg.abs().sum() > 0 and torch.all(torch.isfinite(dk))


def test_nsa_select_validates():
    with pytest.raises(ValueError, match="n_kv_heads"):
        nsa_select(torch.rand(1, 3, 8, 2), 2, 1, 4)
    with pytest.raises(ValueError, match="top_n"):
        nsa_select(torch.rand(1, 2, 8, 2), 2, -1, 4)


# ----------------------------------------------------------------------------- the indexer


def test_indexer_scores_match_the_formula_and_the_reference_layout():
    gen = torch.Generator().manual_seed(0)
    qi, w, ki = torch.randn(2, 3, 9, 4, generator=gen), torch.randn(2, 3, 9, generator=gen), torch.randn(2, 9, 4, generator=gen)
    s = indexer_scores(qi, w, ki)
    # DeepSeek-V3.2-Exp inference/model.py (Indexer, fp8_index): einsum over heads of weights * relu(q . k), per (b, t, s)
    ref = torch.einsum("bht,bhts->bts", w, torch.relu(torch.einsum("bhtd,bsd->bhts", qi, ki)))
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(s[:, causal], ref[:, causal])
    assert torch.all(s[:, ~causal] == -math.inf)
    idx = top_k_tokens(s, 4)
    assert idx.shape == (2, 9, 4) and idx[0, 0].tolist()[1:] == [-1, -1, -1]
    assert all(set(idx[1, 8].tolist()) == set(ref[1, 8].topk(4).indices.tolist()) for _ in [0])


def test_token_select_attention_equals_dense_under_the_selected_tokens():
    q, k, v = qkv(t=20, seed=4)
    gen = torch.Generator().manual_seed(1)
    s = indexer_scores(torch.randn(2, 2, 20, 4, generator=gen, dtype=torch.float64),
                       torch.rand(2, 2, 20, generator=gen, dtype=torch.float64),
                       torch.randn(2, 20, 4, generator=gen, dtype=torch.float64))
    idx = top_k_tokens(s, 6)
    mask = torch.zeros(2, 20, 21, dtype=torch.bool)
    mask.scatter_(-1, torch.where(idx >= 0, idx, 20), True)  # unused slots land in a spare last column
    mask = mask[..., :20]
    torch.testing.assert_close(token_select_attention(q, k, v, idx), dense(q, k, v, mask[:, None]))
    full = top_k_tokens(s, 20)  # every allowed key: dense causal attention
    torch.testing.assert_close(token_select_attention(q, k, v, full), dense(q, k, v, torch.ones(20, 20).tril().bool()))


def test_indexer_kl_loss_is_the_kl_divergence_and_zero_at_the_target():
    gen = torch.Generator().manual_seed(2)
    w = torch.softmax(torch.randn(1, 3, 5, 5, generator=gen).masked_fill(~torch.ones(5, 5).tril().bool(), -math.inf), -1)
    target = w.sum(1) / 3
    logits = torch.log(target).masked_fill(target == 0, -math.inf)
    assert abs(float(indexer_kl_loss(logits, w))) < 1e-6
    s = torch.randn(1, 5, 5, generator=gen).masked_fill(~torch.ones(5, 5).tril().bool(), -math.inf)
    kl = torch.stack([F.kl_div(torch.log_softmax(s[0, t, :t + 1], -1), target[0, t, :t + 1], reduction="sum")
                      for t in range(5)]).mean()
    torch.testing.assert_close(indexer_kl_loss(s, w), kl)


def test_indexer_kl_loss_sparse_stage_is_the_kl_over_the_selected_tokens():
    """DSA's sparse training stage: both distributions restricted to each query's selected tokens and renormalised
    there (torch's kl_div on the restricted rows); a selection of every causal token is the dense stage; the
    gradient reaches only the selected tokens' scores; bad selections are refused."""
    gen = torch.Generator().manual_seed(4)
    causal = torch.ones(9, 9).tril().bool()
    w = torch.softmax(torch.randn(2, 3, 9, 9, generator=gen).masked_fill(~causal, -math.inf), -1)  # (B, H, T, S)
    s = torch.randn(2, 9, 9, generator=gen).masked_fill(~causal, -math.inf).requires_grad_()  # (B, T, S)
    chosen = top_k_tokens(s.detach(), 3)  # (B, T, 3), -1 where fewer than 3 exist
    target = w.sum(1)
    kl = []
    for b in range(2):
        for t in range(9):
            idx = chosen[b, t][chosen[b, t] >= 0]
            p = target[b, t, idx] / target[b, t, idx].sum()
            kl.append(F.kl_div(torch.log_softmax(s[b, t, idx], -1), p, reduction="sum"))
    loss = indexer_kl_loss(s, w, selected=chosen)
    torch.testing.assert_close(loss, torch.stack(kl).mean())
    every = top_k_tokens(s.detach(), 9)
    torch.testing.assert_close(indexer_kl_loss(s, w, selected=every), indexer_kl_loss(s, w))
    grad = torch.autograd.grad(loss, s)[0]
    picked = torch.zeros(2, 9, 10, dtype=torch.bool).scatter_(-1, torch.where(chosen >= 0, chosen, 9), True)[..., :9]
    assert torch.all(grad[~picked] == 0) and grad[picked].abs().sum() > 0
    with pytest.raises(ValueError, match="selected"):
        indexer_kl_loss(s, w, selected=chosen.float().long()[:, :4])
    with pytest.raises(ValueError, match="selected"):
        indexer_kl_loss(s, w, selected=chosen.int())


def test_indexer_cost_counts():
    c = indexer_cost(4096)
    assert c["dense"] == 128 * (576 + 512) * 4096 and c["sparse"] == 128 * 1088 * 2048
    assert c["indexer"] == (64 * 128 + 64) * 4096 and c["dsa"] == c["indexer"] + c["sparse"]
    small = indexer_cost(1000)
    assert small["sparse"] == small["dense"] and small["dsa"] > small["dense"]  # below top_k the indexer only adds
    with pytest.raises(ValueError, match="context"):
        indexer_cost(0)


# ----------------------------------------------------------------------------- validation and the trained task


def test_inputs_are_validated():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="selected"):
        selected_attention(q, k, v, torch.ones(2, 3, 37, 7, dtype=torch.bool), 6)
    with pytest.raises(ValueError, match="multiple"):
        moba_gate(q[:, :3], k, 6, 2)
    with pytest.raises(TypeError, match="top_k"):
        moba_gate(q, k, 6, 2.0)
    with pytest.raises(ValueError, match="blocks"):
        blocks_to_mask(torch.ones(37, 3, dtype=torch.bool), 6, 37)
    with pytest.raises(ValueError, match="indices"):
        token_select_attention(q, k, v, torch.zeros(2, 37, 3))


def test_recall_task_and_a_short_training_run():
    cfg = RecallConfig(steps=5, batch=8)
    keys, values, pos, answer = recall_batch(cfg, 16, torch.Generator().manual_seed(0))
    assert torch.all(keys[:, -1][:, None].eq(keys).sum(-1) == 2)  # the needle and the query only
    assert torch.all(pos < cfg.seq_len - cfg.block_size) and torch.all(values[torch.arange(16), pos] == answer)
    for m in METHODS:
        r = train_recall(m, 0, cfg, eval_batch=32)
        assert r["keys_read"] == (64 if m == "dense" else 16)
    assert train_recall("window", 0, cfg, eval_batch=64)["recall"] == pytest.approx(
        float((recall_batch(cfg, 64, torch.Generator().manual_seed(10_000))[2] >= 48).float().mean()))


def test_dsa_cache_bytes_counts_the_inference_buffers():
    from attncourse.dsa_cache import dsa_cache_bytes

    n = 7
    latent = (torch.zeros(n, 512, dtype=torch.bfloat16), torch.zeros(n, 64, dtype=torch.bfloat16))
    index = (torch.zeros(n, 128, dtype=torch.float8_e4m3fn), torch.zeros(n, 1, dtype=torch.float32))
    got = dsa_cache_bytes(n, n_layers=3)
    assert got["latent"] == 3 * sum(t.numel() * t.element_size() for t in latent)
    assert got["indexer"] == 3 * sum(t.numel() * t.element_size() for t in index)
    assert got["total"] == got["latent"] + got["indexer"]
    assert dsa_cache_bytes(n, indexer=False)["indexer"] == 0
    assert dsa_cache_bytes(9, n_layers=1, compress=4)["latent"] == 3 * 576 * 2  # ceil(9 / 4) entries
    with pytest.raises(ValueError, match="context"):
        dsa_cache_bytes(0)
    with pytest.raises(TypeError, match="indexer"):
        dsa_cache_bytes(8, indexer=1)
