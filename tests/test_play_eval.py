"""play_lm / play_eval: the text model's cache policies against the model itself and a real rolling decode."""
import math

import pytest
import torch

from attncourse import play_eval, play_lm
from attncourse.gpt import GPT, GPTConfig
from attncourse.mha import merge_heads
from attncourse.positions import apply_rope


def _model(seed=0, layers=2):
    torch.manual_seed(seed)
    m = GPT(GPTConfig(vocab_size=11, block_size=64, d_model=16, n_heads=2, n_layers=layers, position="rope"))
    return m.double().eval()


def _tokens(b=2, t=23, seed=1):
    return torch.randint(0, 11, (b, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _rolling_decode(model, tokens, n_sink, window):
    """Token by token: each layer caches pre-RoPE keys, keeps the first n_sink and the newest window, and rotates
    keys and query at their cache slots (StreamingLLM)."""
    caches = [[] for _ in model.blocks]
    out = []
    for t in range(tokens.shape[1]):
        x = model.tok(tokens[:, t:t + 1])
        for cache, block in zip(caches, model.blocks):
            q, k, v = block.attn.project_qkv(block.norm1(x))
            cache.append((k, v))
            if len(cache) > n_sink + window:
                del cache[n_sink]
            ks, vs = torch.cat([c[0] for c in cache], -2), torch.cat([c[1] for c in cache], -2)
            slots = torch.arange(len(cache))
            kr = apply_rope(ks, slots, inv_freq=block.attn.inv_freq)
            qr = apply_rope(q, slots[-1:], inv_freq=block.attn.inv_freq)
            w = torch.softmax(qr @ kr.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
            x = x + block.attn.o_proj(merge_heads(w @ vs))
            x = x + block.ff(block.norm2(x))
        out.append(model.head(model.norm(x)))
    return torch.cat(out, 1)


def test_dense_equals_model():
    m, tok = _model(), _tokens()
    torch.testing.assert_close(play_eval.streaming_forward(m, tok), m(tok))


@pytest.mark.parametrize("n_sink,window", [(2, 5), (0, 7), (1, 1), (3, 30)])
def test_streaming_equals_rolling_decode(n_sink, window):
    m, tok = _model(), _tokens()
    torch.testing.assert_close(play_eval.streaming_forward(m, tok, n_sink, window), _rolling_decode(m, tok, n_sink, window))


def test_true_positions_equal_the_gpt_sink_mask():
    m, tok = _model(), _tokens()
    ours = play_eval.streaming_forward(m, tok, 2, 5, reindex=False)
    m.config.window, m.config.n_sink = 5, 2
    torch.testing.assert_close(ours, m(tok))


def test_heads_split():
    m, tok = _model(), _tokens()
    none = torch.zeros(2, 2, dtype=torch.bool)
    torch.testing.assert_close(play_eval.streaming_forward(m, tok, 2, 5, heads=none), m(tok))
    one = none.clone()
    one[1, 0] = True
    mixed = play_eval.streaming_forward(m, tok, 2, 5, heads=one)
    assert not torch.allclose(mixed, m(tok))
    torch.testing.assert_close(mixed[:, :7], m(tok)[:, :7])  # the cache is not full before position 7


def test_compressed_full_budget_and_high_bits():
    m, tok = _model(), _tokens(t=30)
    ref = m(tok)
    torch.testing.assert_close(play_eval.compressed_forward(m, tok, 20), ref)
    for method in ("window", "h2o", "snapkv"):
        torch.testing.assert_close(play_eval.compressed_forward(m, tok, 20, method, budget=20, recent=4), ref)
    torch.testing.assert_close(play_eval.compressed_forward(m, tok, 20, "kivi", bits=16, group=8), ref,
                               atol=1e-3, rtol=1e-3)
    low = play_eval.compressed_forward(m, tok, 20, "kivi", bits=2, group=8)
    torch.testing.assert_close(low[:, :20], ref[:, :20])  # the prefill is in full precision
    assert not torch.allclose(low[:, 20:], ref[:, 20:])


def test_compressed_window_drops_old_prompt_keys():
    m, tok = _model(), _tokens(t=30)
    a = play_eval.compressed_forward(m, tok, 20, "window", budget=6)
    tok2 = tok.clone()
    tok2[:, 3] = (tok2[:, 3] + 1) % 11  # a prompt token outside the kept window, in layer 0's keys
    b = play_eval.compressed_forward(m, tok2, 20, "window", budget=6)
    assert not torch.allclose(a[:, 20:], b[:, 20:])  # it still reaches the continuation through the window's states
    full = m(tok)
    assert not torch.allclose(a[:, 20:], full[:, 20:])


def test_recompute_losses():
    m = _model()
    stream = _tokens(1, 40)[0]
    got = play_eval.recompute_losses(m, stream, 9, batch_size=7)
    some = play_eval.recompute_losses(m, stream, 9, batch_size=7, every=4)
    assert torch.equal(some.isnan(), torch.tensor([False] * 8 + [i % 4 != 0 for i in range(31)]))
    torch.testing.assert_close(some[~some.isnan()], got[~some.isnan()])
    assert got.shape == (39,)
    torch.testing.assert_close(got[:8], play_eval.losses(m(stream[None, :9]), stream[None, :9])[0])
    t = 25  # predict stream[t + 1] from stream[t - 8 .. t]
    torch.testing.assert_close(got[t], play_eval.losses(m(stream[None, t - 8:t + 2]), stream[None, t - 8:t + 2])[0, -1])


def test_sink_mass_and_bad_input():
    m, tok = _model(), _tokens()
    mass = play_eval.sink_mass(m, tok, start=4)
    assert mass.shape == (2, 2) and bool(((mass > 0) & (mass < 1)).all())
    with pytest.raises(ValueError, match="method"):
        play_eval.compressed_forward(m, tok, 10, "lru")
    with pytest.raises(ValueError, match="budget"):
        play_eval.compressed_forward(m, tok, 10, "h2o", budget=11)
    with pytest.raises(ValueError, match="heads"):
        play_eval.streaming_forward(m, tok, 1, 4, heads=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="tokens"):
        play_eval.streaming_forward(m, tok.double())


def test_play_lm_untrained_and_missing(tmp_path):
    m = play_lm.play_lm(61, 0)
    assert sum(p.numel() for p in m.parameters()) * 4 < 1_000_000  # stored float32 weights stay under 1 MB
    with pytest.raises(FileNotFoundError, match="python -m attncourse.play_lm"):
        play_lm.load_play_lm(0, 61, tmp_path)
    with pytest.raises(TypeError, match="seed"):
        play_lm.play_lm(61, 0.5)
