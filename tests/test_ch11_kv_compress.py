"""attncourse.kv_compress against references: the int8 layout against PyTorch's own per-channel quantisation, H2O and
SnapKV's selections against brute-force loops, and the compressed evaluation against decoding by hand with only
the kept keys."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from attncourse.heads import planted_induction_model
from attncourse.kv_compress import compressed_eval, dequantize, h2o_keep, quantize_kv, retrieval_batch, snapkv_keep


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_int8_layout_equals_pytorch_quantize_per_channel():
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 10, 8, generator=gen), torch.randn(2, 10, 8, generator=gen)  # (H, T, D)
    k[..., 3] *= 20  # an outlier channel, as KIVI finds in keys
    (kq, ks), (vq, vs) = quantize_kv(k, v)
    assert kq.dtype == vq.dtype == torch.int8 and ks.shape == (2, 1, 8) and vs.shape == (2, 10, 1)
    for h in range(2):  # keys: one scale per channel (axis D); values: one per token (axis T)
        ref_k = torch.quantize_per_channel(k[h], ks[h, 0].double(), torch.zeros(8, dtype=torch.long), 1, torch.qint8)
        assert torch.equal(ref_k.int_repr(), kq[h])
        ref_v = torch.quantize_per_channel(v[h], vs[h, :, 0].double(), torch.zeros(10, dtype=torch.long), 0,
                                           torch.qint8)
        assert torch.equal(ref_v.int_repr(), vq[h])
    err_k = (dequantize(kq, ks) - k).abs()
    assert (err_k <= ks / 2 + 1e-6).all()  # rounding error at most half a step of its own channel


def agrees_with_brute_force(keep, scores, window, budget):
    """Per head: the last `window` keys are kept, and the other kept keys' scores are the `budget - window` largest
    scores among the earlier keys (compared as values: max-pooled votes tie, and a tie may go either way)."""
    t = scores.shape[-1]
    for idx in itertools.product(*(range(n) for n in scores.shape[:-1])):
        kept = [j for j in range(t) if keep[idx][j]]
        assert set(range(t - window, t)) <= set(kept) and len(kept) == budget
        earlier = sorted((float(scores[idx][j]) for j in range(t - window)), reverse=True)
        assert sorted((float(scores[idx][j]) for j in kept if j < t - window), reverse=True) == earlier[:budget - window]


def test_h2o_and_snapkv_equal_brute_force_selections():
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(2, 3, 12, 12, generator=gen).masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(),
                                                              float("-inf"))
    w = s.softmax(-1)
    agrees_with_brute_force(h2o_keep(w, 6, 2), w.sum(-2), 2, 6)  # accumulated attention over all queries
    votes = w[..., -3:, :].sum(-2)  # the observation window's votes
    pooled = torch.stack([votes[..., max(0, j - 2):j + 3].amax(-1) for j in range(12)], -1)  # max-pool, kernel 5
    agrees_with_brute_force(snapkv_keep(w, 7, 3, kernel=5), pooled, 3, 7)
    padded = torch.nn.functional.pad(votes, (2, 2))  # the reference code's avg_pool1d: zero padding counted
    averaged = torch.stack([padded[..., j:j + 5].sum(-1) / 5 for j in range(12)], -1)
    agrees_with_brute_force(snapkv_keep(w, 7, 3, kernel=5, pool="avg"), averaged, 3, 7)
    earlier = torch.nn.functional.pad(votes[..., :9], (2, 2))  # the reference code pools the earlier keys' votes only
    averaged = torch.stack([earlier[..., j:j + 5].sum(-1) / 5 for j in range(9)], -1)  # (2, 3, 9)
    agrees_with_brute_force(snapkv_keep(w, 7, 3, kernel=5, pool="avg", pool_window=False),
                            torch.nn.functional.pad(averaged, (0, 3)), 3, 7)
    assert snapkv_keep(w, 12, 3, pool_window=False).all()
    with pytest.raises(ValueError, match="pool"):
        snapkv_keep(w, 7, 3, pool="sum")
    assert h2o_keep(w, 12, 2).all()
    with pytest.raises(ValueError):
        snapkv_keep(w, 3, 4)
    with pytest.raises(ValueError):
        snapkv_keep(w, 7, 3, kernel=4)
    with pytest.raises(ValueError):
        h2o_keep(w[..., :5], 4, 2)


def test_compressed_eval_equals_decoding_with_only_the_kept_keys():
    model = planted_induction_model(16, 10, generator=torch.Generator().manual_seed(0))
    tokens, p = retrieval_batch(torch.Generator().manual_seed(1), 4, 10, 16, question=3, answer=4)
    full = compressed_eval(model, tokens, p, "full")
    with torch.no_grad():
        logits = model(tokens)
    assert full["accuracy"] == (logits[:, p:-1].argmax(-1) == tokens[:, p + 1:]).double().mean().item() == 1.0
    # By hand: layer by layer, queries of the continuation attend to the kept prompt keys and to the continuation.
    with torch.no_grad():
        _, maps = model(tokens[:, :p], return_weights=True)
        keeps = [snapkv_keep(m, 5, 2, 3) for m in maps]  # (B, H, P) per layer
        x = model.tok(tokens) + model.pos(torch.arange(tokens.shape[1]))
        for attn, keep in zip(model.attns, keeps):
            hd = attn.head_dim
            q = attn.q_proj(x).view(4, -1, attn.n_heads, hd).transpose(1, 2)
            k = attn.k_proj(x).view(4, -1, attn.n_heads, hd).transpose(1, 2)
            v = attn.v_proj(x).view(4, -1, attn.n_heads, hd).transpose(1, 2)
            rows = []
            for i in range(tokens.shape[1]):
                visible = torch.ones(4, attn.n_heads, i + 1, dtype=torch.bool)
                if i >= p:
                    visible[..., :p] = keep
                rows.append(F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1],
                                                           attn_mask=visible[:, :, None, :]))
            x = x + attn.o_proj(torch.cat(rows, 2).transpose(1, 2).reshape(4, -1, attn.n_heads * hd))
        ref = model.head(model.norm(x))
    ref_acc = (ref[:, p:-1].argmax(-1) == tokens[:, p + 1:]).double().mean().item()
    got = compressed_eval(model, tokens, p, "snapkv", budget=5, window=2, kernel=3)
    assert got["accuracy"] == ref_acc
    assert got["bytes"] == 2 * 2 * 5 * 2 * model.attns[0].head_dim * 2  # layers x heads x 5 keys x (K, V) x D x fp16
    assert compressed_eval(model, tokens, p, "int8")["accuracy"] == 1.0


def test_bad_input_is_refused():
    model = planted_induction_model(16, 10, generator=torch.Generator().manual_seed(0))
    tokens, p = retrieval_batch(torch.Generator().manual_seed(1), 2, 10, 16, question=3, answer=4)
    with pytest.raises(ValueError):
        compressed_eval(model, tokens, p, "lru")
    with pytest.raises(ValueError):
        compressed_eval(model, tokens, p, "h2o")
    with pytest.raises(ValueError):
        retrieval_batch(torch.Generator(), 2, 5, 16, question=3, answer=4)


def test_sink_tokens_are_kept_inside_the_budget():
    """With sinks, the first keys are kept whatever their score, and the rest of the selection is the brute force's
    over the keys that are neither sinks nor window; "recent" keeps the sinks and the budget - sinks newest."""
    gen = torch.Generator().manual_seed(2)
    s = torch.randn(2, 3, 12, 12, generator=gen).masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(),
                                                              float("-inf"))
    w = s.softmax(-1)
    scores = w.sum(-2).clone()
    scores[..., :2] = float("inf")  # the brute force sees the two sinks as the best-scored keys
    keep = h2o_keep(w, 6, 2, sinks=2)
    assert keep[..., :2].all()
    agrees_with_brute_force(keep, scores, 2, 6)
    assert snapkv_keep(w, 7, 3, kernel=5, sinks=3)[..., :3].all() and (snapkv_keep(w, 7, 3, sinks=3).sum(-1) == 7).all()
    assert torch.equal(h2o_keep(w, 6, 2, sinks=0), h2o_keep(w, 6, 2))
    with pytest.raises(ValueError, match="sinks"):
        h2o_keep(w, 6, 2, sinks=5)  # 6 keys, 2 for the window: room for 4 sinks at most
    model = planted_induction_model(16, 10, generator=torch.Generator().manual_seed(0))
    tokens, p = retrieval_batch(torch.Generator().manual_seed(1), 4, 10, 16, question=3, answer=4)
    got = compressed_eval(model, tokens, p, "recent", budget=5, sinks=2)
    with torch.no_grad():  # by hand: the continuation's queries see prompt keys 0, 1 and the 3 newest
        _, maps = model(tokens[:, :p], return_weights=True)
        keep = torch.zeros(p, dtype=torch.bool)
        keep[[0, 1, p - 3, p - 2, p - 1]] = True
        allowed = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()
        allowed[p:, :p] &= keep
        x = model.tok(tokens) + model.pos(torch.arange(tokens.shape[1]))  # kept keys keep their original positions
        for norm, attn in zip(model.norms, model.attns):
            x = x + attn(norm(x), attn_mask=allowed)
        ref = model.head(model.norm(x))
    torch.testing.assert_close(got["logits"], ref)
    assert got["bytes"] == compressed_eval(model, tokens, p, "recent", budget=5)["bytes"]  # same budget, same bytes
    with pytest.raises(ValueError, match="sinks"):
        compressed_eval(model, tokens, p, "full", sinks=2)


def test_fp8_cache_is_e4m3_with_one_scale():
    """Every stored value is a float8 e4m3 number times the tensor's one scale, within e4m3's relative step (2^-3,
    so rounding moves a normal number by at most 2^-4 of it); the circuit still copies; one byte per number."""
    from attncourse.kv_compress import _fp8
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 5
    y = _fp8(x)
    scale = x.abs().max() / 448
    assert torch.equal((y / scale).to(torch.float8_e4m3fn).to(torch.float64), y / scale)  # representable
    normal = x.abs() >= scale * 2 ** -6  # e4m3's smallest normal number is 2^-6
    assert ((y - x).abs() <= x.abs() * 2 ** -4 + 1e-12)[normal].all()
    model = planted_induction_model(16, 10, generator=torch.Generator().manual_seed(0))
    tokens, p = retrieval_batch(torch.Generator().manual_seed(1), 4, 10, 16, question=3, answer=4)
    got = compressed_eval(model, tokens, p, "fp8")
    assert got["accuracy"] == 1.0 and got["bytes"] == 2 * (2 * p * 2 * model.attns[0].head_dim + 8)

