"""The tiny GPT: shapes, cached == full logits for every position kind and attention pattern, causality,
generation with and without the cache, training that learns, toy data, bad input."""

import pytest
import torch

from attncourse import masks
from attncourse.bench_decode import decode_speedups, prefill_vs_decode, time_per_token
from attncourse.gpt import GPT, GPTConfig, lm_loss, next_token_accuracy, train_lm
from attncourse.kv_cache import KVCache, SinkWindowCache
from attncourse.toy_data import (bin_centres, discretise, random_windows, recurrence_tokens, sine_wave)


def model(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=13, block_size=40, d_model=32, n_heads=4, n_layers=2)
    return GPT(GPTConfig(**{**cfg, **kw})).double().eval()


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "alibi", "none"])
@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("window,n_sink", [(None, 0), (6, 0), (5, 2)])
def test_cached_logits_equal_full_forward(position, n_kv_heads, window, n_sink):
    m = model(position=position, n_kv_heads=n_kv_heads, window=window, n_sink=n_sink)
    tokens = torch.randint(0, 13, (2, 31))
    full = m(tokens)  # (B, T, V)
    caches = m.new_caches(2, 31)
    outs = [m(tokens[:, :11], caches)]  # prefill
    outs += [m(tokens[:, t:t + 1], caches) for t in range(11, 31)]  # decode, one token at a time
    torch.testing.assert_close(torch.cat(outs, 1), full)
    if window is not None:
        assert all(len(c) <= n_sink + window - 1 for c in caches)


def test_future_tokens_change_nothing_before_them():
    m = model(position="alibi")
    a = torch.randint(0, 13, (1, 20))
    b = a.clone()
    b[0, 12:] = (b[0, 12:] + 1) % 13
    la, lb = m(a), m(b)
    torch.testing.assert_close(la[:, :12], lb[:, :12])
    assert not torch.allclose(la[:, 12:], lb[:, 12:])


def test_sliding_window_model_matches_mask():
    m = model(position="sinusoidal", window=4)
    tokens = torch.randint(0, 13, (1, 12))
    c = tokens.clone()
    c[0, :5] = (c[0, :5] + 3) % 13  # positions 0..4 are out of reach of query 11 (sees 8..11) in both layers
    torch.testing.assert_close(m(tokens)[:, 11], m(c)[:, 11])
    assert torch.equal(masks.materialize(m.mask_mod, 6, 6), masks.materialize(masks.sliding_window(4), 6, 6))


@pytest.mark.parametrize("position,window", [("learned", None), ("alibi", 5)])
def test_generate_with_and_without_cache_agree(position, window):
    m = model(position=position, window=window)
    prompt = torch.randint(0, 13, (3, 5))
    with_cache = m.generate(prompt, 12)
    without = m.generate(prompt, 12, use_cache=False)
    assert with_cache.shape == (3, 17) and torch.equal(with_cache[:, :5], prompt)
    assert torch.equal(with_cache, without)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(m.generate(prompt, 6, temperature=1.0, generator=g1),
                       m.generate(prompt, 6, temperature=1.0, generator=g2, use_cache=False))


def test_caches_match_model_dtype_and_kind():
    m = model(n_kv_heads=2)
    caches = m.new_caches(2, 9)
    assert len(caches) == 2 and isinstance(caches[0], KVCache)
    assert caches[0].k.shape == (2, 2, 9, 8) and caches[0].k.dtype == torch.float64
    assert isinstance(model(window=3).new_caches(1, 9)[0], SinkWindowCache)


def test_training_learns_the_recurrence():
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=8, block_size=16, d_model=32, n_heads=4, n_layers=1, position="learned"))
    gen = torch.Generator().manual_seed(0)
    losses = train_lm(m, lambda step: recurrence_tokens(32, 13, 8, noise=0.0, generator=gen), 120, lr=1e-2)
    assert losses[0] > 1.8  # about ln 8 = 2.08 at the start
    assert sum(losses[-10:]) / 10 < 0.5 * losses[0]
    with torch.no_grad():
        assert lm_loss(m, recurrence_tokens(16, 13, 8, noise=0.0, generator=gen)).item() < 0.5 * losses[0]


def test_toy_data():
    x = recurrence_tokens(4, 30, 10, noise=0.0, generator=torch.Generator().manual_seed(0))
    assert x.shape == (4, 30) and torch.equal(x[:, 2:], (x[:, 1:-1] + x[:, :-2]) % 10)
    noisy = recurrence_tokens(64, 50, 10, noise=0.5, generator=torch.Generator().manual_seed(0))
    follows = (noisy[:, 2:] == (noisy[:, 1:-1] + noisy[:, :-2]) % 10).float().mean()
    assert 0.45 < follows < 0.65  # 50% kept + 10% of the random ones agree by chance
    wave = sine_wave(200, period=40.0)
    tok = discretise(wave, 50)
    assert tok.min() >= 0 and tok.max() <= 49 and tok.dtype == torch.int64
    assert (bin_centres(tok, 50) - wave).abs().max() <= 1 / 50 + 1e-6
    w = random_windows(tok, 5, 16, generator=torch.Generator().manual_seed(0))
    assert w.shape == (5, 16)
    with pytest.raises(ValueError, match="series"):
        random_windows(tok, 2, 500)
    with pytest.raises(ValueError, match="noise"):
        recurrence_tokens(2, 5, noise=2.0)


def test_bad_input():
    with pytest.raises(ValueError, match="position"):
        GPTConfig(vocab_size=5, position="rope2")
    with pytest.raises(ValueError, match="n_sink"):
        GPTConfig(vocab_size=5, n_sink=2)
    with pytest.raises(TypeError, match="config"):
        GPT({"vocab_size": 5})
    m = model()
    with pytest.raises(ValueError, match="tokens"):
        m(torch.randn(2, 5))
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, 41, dtype=torch.long))  # learned positions stop at 40
    with pytest.raises(ValueError, match="one cache per layer"):
        m(torch.zeros(1, 3, dtype=torch.long), m.new_caches(1, 3)[:1])
    with pytest.raises(ValueError, match="full"):
        caches = m.new_caches(1, 4)
        m(torch.zeros(1, 3, dtype=torch.long), caches)
        m(torch.zeros(1, 2, dtype=torch.long), caches)
    assert model(position="sinusoidal")(torch.zeros(1, 100, dtype=torch.long)).shape == (1, 100, 13)


class _NextIsPlusOne(torch.nn.Module):
    """A stand-in 'model' whose greedy prediction is always (last token + 1) mod V, and which records the
    inputs it was called with."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.seen = vocab, []

    def forward(self, tokens):
        self.seen.append(tokens.clone())
        return torch.nn.functional.one_hot((tokens + 1) % self.vocab, self.vocab).double()  # (B, T, V)


def test_next_token_accuracy_scores_every_target_with_fixed_context():
    series = torch.arange(30) % 7  # follows the +1 rule everywhere
    m = _NextIsPlusOne(7)
    assert next_token_accuracy(m, series, start=20, context=5, batch_size=4) == 1.0
    inputs = torch.cat(m.seen)  # (10, 5): one window per target 20..29
    assert inputs.shape == (10, 5) and torch.equal(inputs[0], series[15:20]) and torch.equal(inputs[-1], series[24:29])
    broken = series.clone()
    broken[[21, 25, 29]] = 0  # three targets (and the windows around them) no longer follow the rule
    expected = sum(int((broken[t - 1] + 1) % 7 == broken[t]) for t in range(20, 30)) / 10
    assert next_token_accuracy(_NextIsPlusOne(7), broken, 20, 5) == pytest.approx(expected)
    assert expected < 1.0
    assert next_token_accuracy(_NextIsPlusOne(7), series, 29, 29) == 1.0  # a single target, all context
    with pytest.raises(ValueError, match="context <= start"):
        next_token_accuracy(m, series, start=3, context=5)
    with pytest.raises(ValueError, match="context <= start"):
        next_token_accuracy(m, series, start=30, context=5)
    with pytest.raises(ValueError, match="series"):
        next_token_accuracy(m, series.float(), start=10, context=5)
    with pytest.raises(ValueError, match="series"):
        next_token_accuracy(m, series.view(5, 6), start=10, context=5)


def test_a_trained_model_scores_high_on_a_held_out_sine_tail():
    torch.manual_seed(0)
    tokens = discretise(sine_wave(600, period=23.7), 20)
    m = GPT(GPTConfig(vocab_size=20, block_size=24, d_model=32, n_heads=4, n_layers=1, position="alibi"))
    gen = torch.Generator().manual_seed(0)
    chance = next_token_accuracy(m, tokens, 540, 23)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only add overhead (and fight on a busy machine)
    try:
        train_lm(m, lambda step: random_windows(tokens[:540], 16, 24, generator=gen), 120, lr=1e-2)
    finally:
        torch.set_num_threads(threads)
    acc = next_token_accuracy(m, tokens, 540, 23)
    assert acc > 0.8 and acc > chance + 0.5


def test_decode_benchmark_functions_run_and_validate():
    m = GPT(GPTConfig(vocab_size=11, block_size=64, d_model=16, n_heads=2, n_layers=1)).eval()
    rates = prefill_vs_decode(m, 20, 3, repeats=1, batch_size=2)
    assert set(rates) == {"prefill_tokens_per_s", "decode_tokens_per_s"}
    assert all(0 < v < float("inf") for v in rates.values())
    table = decode_speedups(m, [4, 9], n_new=2, repeats=1)
    assert sorted(table) == [4, 9] and all(len(row) == 3 and row[2] > 0 for row in table.values())
    assert time_per_token(m, 5, 2, use_cache=True, repeats=1) > 0
    with pytest.raises(ValueError, match="context_len"):
        prefill_vs_decode(m, 0)
    with pytest.raises(TypeError, match="n_new"):
        time_per_token(m, 5, 2.5, use_cache=False)
