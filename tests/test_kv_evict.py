"""attncourse.kv_evict against a token-by-token decode: per sequence and head, a Python set of cached positions, scores
accumulated by hand, one eviction per step (H2O's lowest score outside the recent window, or the oldest key)."""

from __future__ import annotations

import math

import pytest
import torch

from attncourse.heads import planted_induction_model
from attncourse.kv_compress import compressed_eval, retrieval_batch
from attncourse.kv_evict import decode_eval


def decode_by_hand(model, tokens, p, budget, recent, policy, sinks=0):
    """Logits (B, T, V) of a decode that keeps, per layer, sequence and head, a set of at most `budget` positions;
    the first `sinks` positions are never evicted. Every key keeps the position it was computed at."""
    b, t = tokens.shape
    with torch.no_grad():
        x = model.tok(tokens) + model.pos(torch.arange(t))
        for norm, attn in zip(model.norms, model.attns):
            h, hd, nh = norm(x), attn.head_dim, attn.n_heads
            q, k, v = (proj(h).view(b, t, nh, hd).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
            out = torch.zeros(b, nh, t, hd)
            for bi in range(b):
                for hi in range(nh):
                    weights = lambda i, keys: torch.softmax(  # noqa: E731
                        torch.stack([q[bi, hi, i] @ k[bi, hi, j] / math.sqrt(hd) for j in keys]), 0)
                    score = [0.0] * t
                    for i in range(p):  # the prefill: full causal attention, scores summed over its queries
                        w = weights(i, range(i + 1))
                        out[bi, hi, i] = w @ v[bi, hi, :i + 1]
                        for j in range(i + 1):
                            score[j] += float(w[j])
                    newest = list(range(max(0, p - min(recent, budget)), p))
                    older = sorted(range(sinks, p - len(newest)), key=lambda j: -score[j])
                    room = max(0, budget - len(newest) - sinks)
                    cache = set(range(sinks)) | set(newest) | set(older[:room]) if policy == "h2o" else \
                        set(range(sinks)) | set(range(max(0, p - budget + sinks), p))
                    for i in range(p, t):
                        if i == t - 1:  # the last position predicts nothing scored: full causal
                            keys = list(range(i + 1))
                            out[bi, hi, i] = weights(i, keys) @ v[bi, hi, keys]
                            break
                        cache.add(i)
                        keys = sorted(cache)
                        w = weights(i, keys)
                        out[bi, hi, i] = w @ v[bi, hi, keys]
                        for j, wj in zip(keys, w.tolist()):
                            score[j] += wj
                        if len(cache) > budget:
                            victim = min((j for j in cache if sinks <= j <= i - recent), key=lambda j: score[j]) \
                                if policy == "h2o" else min(j for j in cache if j >= sinks)
                            cache.remove(victim)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, nh * hd))
        return model.head(model.norm(x))


@pytest.mark.parametrize("policy, budget, recent, sinks", [("h2o", 6, 2, 0), ("h2o", 9, 4, 0), ("window", 6, 1, 0),
                                                           ("h2o", 9, 3, 2), ("window", 6, 1, 2)])
def test_decode_eval_equals_a_token_by_token_decode(policy, budget, recent, sinks):
    model = planted_induction_model(16, 12, generator=torch.Generator().manual_seed(3), noise=0.5)
    tokens, p = retrieval_batch(torch.Generator().manual_seed(4), 3, 12, 16, question=3, answer=6)
    ref = decode_by_hand(model, tokens, p, budget, recent, policy, sinks)
    hits = (ref[:, p:-1].argmax(-1) == tokens[:, p + 1:]).double()
    got = decode_eval(model, tokens, p, policy, budget=budget, recent=recent, sinks=sinks)
    torch.testing.assert_close(got["logits"], ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got["logits"][:, p:-1], model(tokens)[:, p:-1], atol=1e-2)  # the eviction mattered
    assert got["per_step"] == hits.mean(0).tolist() and got["accuracy"] == hits.mean().item()
    assert got["max_keys"] == budget
    assert all(k.shape == (3, model.attns[0].n_heads, tokens.shape[1]) and (k.sum(-1) == budget).all()
               and k[..., :sinks].all() for k in got["kept"])  # the final caches: full, sinks in


def test_greedy_h2o_is_not_the_one_shot_variant_and_a_large_budget_loses_nothing():
    model = planted_induction_model(16, 12, generator=torch.Generator().manual_seed(0))
    tokens, p = retrieval_batch(torch.Generator().manual_seed(1), 8, 12, 16, question=3, answer=6)
    assert decode_eval(model, tokens, p, "h2o", budget=p + 8, recent=2)["accuracy"] == 1.0
    assert decode_eval(model, tokens, p, "window", budget=p + 8)["accuracy"] == 1.0
    # With the cache bounded, greedy H2O must end holding `budget` keys where the one-shot variant holds more.
    greedy = decode_eval(model, tokens, p, "h2o", budget=6, recent=2)
    assert greedy["max_keys"] == 6
    assert compressed_eval(model, tokens, p, "h2o", budget=6, window=2)["bytes"] > 0
    with pytest.raises(ValueError):
        decode_eval(model, tokens, p, "lru", budget=6)
    with pytest.raises(ValueError):
        decode_eval(model, tokens, p, "h2o", budget=3, recent=4)
    with pytest.raises(ValueError):
        decode_eval(model, tokens, tokens.shape[1] - 1, "h2o", budget=6)
    with pytest.raises(ValueError, match="sinks"):
        decode_eval(model, tokens, p, "h2o", budget=6, recent=2, sinks=5)  # 6 keys, 2 recent: 4 sinks at most
    assert not torch.equal(decode_eval(model, tokens, p, "window", budget=6, sinks=2)["logits"],
                           decode_eval(model, tokens, p, "window", budget=6)["logits"])  # the sinks change the cache


def test_free_running_feeds_back_the_models_own_greedy_tokens():
    """free_running against a greedy decode by hand: at every step, the token-by-token decode above on the tokens
    decoded so far, its argmax appended; and it must differ from the teacher-forced score where a step goes wrong."""
    from attncourse.kv_evict import free_running
    model = planted_induction_model(16, 12, generator=torch.Generator().manual_seed(3), noise=0.5)
    tokens, p = retrieval_batch(torch.Generator().manual_seed(4), 3, 12, 16, question=3, answer=6)
    seq = tokens.clone()
    for s in range(p, tokens.shape[1] - 1):
        seq[:, s + 1] = decode_by_hand(model, seq, p, 10, 4, "h2o")[:, s].argmax(-1)
    got = free_running(lambda x: decode_eval(model, x, p, "h2o", budget=10, recent=4), tokens, p)
    assert torch.equal(got["tokens"], seq) and torch.equal(got["tokens"][:, :p + 1], tokens[:, :p + 1])
    hits = (seq[:, p + 1:] == tokens[:, p + 1:]).double()
    assert got["accuracy"] == hits.mean().item() and got["per_step"] == hits.mean(0).tolist()
    forced = decode_eval(model, tokens, p, "h2o", budget=10, recent=4)
    assert not torch.equal(forced["logits"][:, p:-1].argmax(-1), seq[:, p + 1:])  # a wrong token fed back matters
    assert got["accuracy"] < forced["accuracy"]  # here it costs the copy a step teacher forcing scored right
    plain = tokens.clone()  # with nothing evicted: plain greedy generation from the model's own forward
    for s in range(p, tokens.shape[1] - 1):
        plain[:, s + 1] = model(plain)[:, s].argmax(-1)
    assert torch.equal(free_running(lambda x: compressed_eval(model, x, p, "full"), tokens, p)["tokens"], plain)
    with pytest.raises(ValueError):
        free_running(lambda x: compressed_eval(model, x, p, "full"), tokens, tokens.shape[1] - 1)
