"""The reversal task, the GRU encoder-decoder with and without attention, training and evaluation."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attncourse import AdditiveAttention
from attncourse.seq2seq import (ATTENTIONS, PAD, SOS, Seq2Seq, Seq2SeqConfig, accuracy_by_length, build_model,
                                count_parameters, loss_on, make_attention, reverse_batch, threads, train)

SMALL = dict(min_len=2, max_len=7, embed_size=8, encoder_size=6, decoder_size=12, attention_size=5,
             batch_size=16)


def test_reverse_batch_reverses_each_row_within_its_length():
    batch = reverse_batch(50, 3, 9, num_digits=4, generator=torch.Generator().manual_seed(0))
    assert batch.src.shape == batch.tgt.shape == (50, int(batch.lengths.max()))
    assert batch.lengths.min() >= 3 and batch.lengths.max() <= 9
    for src, tgt, n in zip(batch.src, batch.tgt, batch.lengths.tolist()):
        assert torch.equal(tgt[:n], src[:n].flip(0))
        assert torch.all(src[n:] == PAD) and torch.all(tgt[n:] == PAD)
        assert torch.all((src[:n] >= 2) & (src[:n] < 2 + 4))  # digits, never PAD or SOS
    assert torch.equal(batch.mask, batch.src != PAD)


def test_reverse_batch_is_seeded_and_fixed_length_works():
    a = reverse_batch(8, 2, 5, generator=torch.Generator().manual_seed(1))
    b = reverse_batch(8, 2, 5, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    fixed = reverse_batch(4, 2, 5, length=11)
    assert fixed.src.shape == (4, 11) and torch.all(fixed.lengths == 11) and torch.all(fixed.src != PAD)


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_size=0, min_len=1, max_len=3), r"batch_size must be positive, got 0"),
    (dict(batch_size=2, min_len=5, max_len=3), r"min_len=5, max_len=3"),
    (dict(batch_size=2, min_len=1, max_len=3, num_digits=1.5), r"num_digits must be an int"),
])
def test_reverse_batch_rejects_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        reverse_batch(**kwargs)


@pytest.mark.parametrize("kind", ATTENTIONS)
def test_shapes_and_attention_weights(kind):
    config = Seq2SeqConfig(**SMALL)
    model = build_model(kind, config)
    batch = reverse_batch(5, 2, 7, generator=torch.Generator().manual_seed(2))
    logits, weights = model(batch.src, batch.lengths, batch.tgt)
    b, s = batch.src.shape
    assert logits.shape == (b, s, config.vocab_size)
    if kind == "none":
        assert weights is None
        return
    assert weights.shape == (b, s, s)
    torch.testing.assert_close(weights.sum(-1), torch.ones(b, s))  # every output step: sums to 1
    assert torch.all(weights.masked_select(~batch.mask[:, None, :]) == 0)  # no weight on padding


@pytest.mark.parametrize("kind", ["none", "additive", "general"])
def test_padding_does_not_change_a_sequence_s_result(kind):
    """A short sequence alone and in a batch with a longer one (so padded) gives the same logits."""
    model = build_model(kind, Seq2SeqConfig(**SMALL)).double()
    short = torch.tensor([[3, 4, 5]])
    long = torch.tensor([[2, 3, 4, 5, 6, 7, 8]])
    padded = torch.cat([torch.cat([short, torch.full((1, 4), PAD)], dim=1), long])  # (2, 7)
    tgt_short = short.flip(1)
    alone, _ = model(short, torch.tensor([3]), tgt_short)
    tgt = torch.cat([torch.cat([tgt_short, torch.full((1, 4), PAD)], dim=1), long.flip(1)])
    batched, _ = model(padded, torch.tensor([3, 7]), tgt)
    torch.testing.assert_close(batched[0, :3], alone[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["none", "additive", "dot", "concat"])
def test_greedy_decoding_equals_teacher_forcing_on_its_own_output(kind):
    """Step-by-step decoding and the all-steps-at-once path compute the same function."""
    model = build_model(kind, Seq2SeqConfig(**SMALL)).double()
    batch = reverse_batch(6, 2, 7, generator=torch.Generator().manual_seed(3))
    greedy_logits, greedy_w = model(batch.src, batch.lengths, steps=5)
    forced_logits, forced_w = model(batch.src, batch.lengths, greedy_logits.argmax(-1))
    torch.testing.assert_close(greedy_logits, forced_logits, rtol=1e-10, atol=1e-12)
    if kind != "none":
        torch.testing.assert_close(greedy_w, forced_w, rtol=1e-10, atol=1e-12)


def test_encoder_without_padding_skips_packing_and_agrees():
    """All rows full length: the unpacked fast path gives what the packed path gives."""
    model = build_model("additive", Seq2SeqConfig(**SMALL)).double()
    full = reverse_batch(4, 5, 5, generator=torch.Generator().manual_seed(6))
    fast, fast_state = model.encode(full.src, full.lengths)
    # the same rows with one padded row added force the packed path
    padded_src = torch.cat([full.src, torch.tensor([[3, 4, PAD, PAD, PAD]])])
    packed, packed_state = model.encode(padded_src, torch.cat([full.lengths, torch.tensor([2])]))
    torch.testing.assert_close(packed[:4], fast, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(packed_state[:4], fast_state, rtol=1e-10, atol=1e-12)
    assert torch.all(packed[4, 2:] == 0)  # padding gets zero annotations


@pytest.mark.parametrize("bucket", [True, False])
def test_training_batches_with_and_without_buckets(bucket, monkeypatch):
    import attncourse.seq2seq as s2s

    seen = []
    real = s2s.loss_on
    monkeypatch.setattr(s2s, "loss_on", lambda model, batch: seen.append(batch) or real(model, batch))
    config = Seq2SeqConfig(**SMALL, steps=12, bucket=bucket)
    train(build_model("none", config), progress=False)
    assert len(seen) == 12
    for batch in seen:
        assert batch.lengths.min() >= config.min_len and batch.lengths.max() <= config.max_len
    if bucket:  # every batch one length, no padding; and not always the same length
        assert all(int(b.lengths.min()) == int(b.lengths.max()) == b.src.shape[1] for b in seen)
        assert len({b.src.shape[1] for b in seen}) > 1
    else:
        assert any(int(b.lengths.min()) < int(b.lengths.max()) for b in seen)


def test_first_decoder_input_is_sos():
    model = build_model("none", Seq2SeqConfig(**SMALL))
    batch = reverse_batch(3, 2, 5, generator=torch.Generator().manual_seed(4))
    seen = []
    model.decoder.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    model(batch.src, batch.lengths, batch.tgt)
    torch.testing.assert_close(seen[0][:, 0], model.embed.weight[SOS].expand(3, -1))


def test_any_module_with_the_signature_works():
    config = Seq2SeqConfig(**SMALL)
    model = Seq2Seq(config, AdditiveAttention(config.decoder_size, config.key_size, 3))
    batch = reverse_batch(4, 2, 7)
    assert model(batch.src, batch.lengths, batch.tgt)[1].shape[0] == 4
    assert count_parameters(model.attention) == 3 * (config.decoder_size + config.key_size + 1)
    assert count_parameters(None) == 0


def test_make_attention_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"attention must be one of.*'luong'"):
        make_attention("luong", Seq2SeqConfig())


def test_training_lowers_the_loss_and_restores_threads():
    config = Seq2SeqConfig(**SMALL, steps=60, lr=1e-2)
    model = build_model("additive", config)
    before = torch.get_num_threads()
    losses = train(model, progress=False)
    assert torch.get_num_threads() == before
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10, losses


def test_build_model_is_seeded():
    a, b = build_model("general", Seq2SeqConfig(**SMALL)), build_model("general", Seq2SeqConfig(**SMALL))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


class _Oracle(nn.Module):
    """Knows the answer (or always says digit 0): to check that accuracy_by_length measures the right thing."""

    def __init__(self, config, perfect):
        super().__init__()
        self.config, self.perfect = config, perfect

    def forward(self, src, lengths, tgt=None, steps=None):
        answer = src.flip(1) if self.perfect else torch.full_like(src, 2)  # fixed-length rows: flip is exact
        return nn.functional.one_hot(answer[:, :steps], self.config.vocab_size).float(), None


def test_accuracy_by_length():
    config = Seq2SeqConfig(num_digits=4, min_len=3, max_len=6)
    perfect = accuracy_by_length(_Oracle(config, True), n=50)
    assert list(perfect) == [3, 4, 5, 6] and all(v == 1.0 for v in perfect.values())
    constant = accuracy_by_length(_Oracle(config, False), lengths=[5], n=400)
    assert abs(constant[5] - 0.25) < 0.05  # one digit in four


def test_loss_ignores_padding():
    model = build_model("dot", Seq2SeqConfig(**SMALL))
    batch = reverse_batch(4, 2, 7, generator=torch.Generator().manual_seed(5))
    logits, _ = model(batch.src, batch.lengths, batch.tgt)
    valid = batch.tgt != PAD
    expected = nn.functional.cross_entropy(logits[valid], batch.tgt[valid])
    torch.testing.assert_close(loss_on(model, batch), expected)


def test_threads_validates_and_restores():
    before = torch.get_num_threads()
    with threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="num_threads must be positive"):
        with threads(0):
            pass


def test_full_config():
    full = Seq2SeqConfig.full(steps=5)
    assert full.max_len > Seq2SeqConfig().max_len and full.steps == 5 and full.key_size == full.decoder_size


def test_run_seeds_trains_each_kind_per_seed_and_workers_change_nothing():
    from attncourse.seq2seq import accuracy_rows, run_seeds

    config = Seq2SeqConfig(**SMALL, steps=6)
    alone = run_seeds(["none", "dot"], seeds=(0, 1), config=config, lengths=[2, 5], n=20, progress=False)
    forked = run_seeds(["none", "dot"], seeds=(0, 1), config=config, lengths=[2, 5], n=20, workers=2,
                       progress=False)
    assert list(alone) == ["none", "dot"] and [r.seed for r in alone["dot"]] == [0, 1]
    for kind in alone:
        for a, b in zip(alone[kind], forked[kind]):
            assert a.losses == b.losses and a.accuracy == b.accuracy  # same model, whatever process trained it
    assert alone["dot"][0].losses != alone["dot"][1].losses  # the seed changes the initialisation and the batches
    single = build_model("dot", Seq2SeqConfig(**SMALL, steps=6, seed=1))
    assert train(single, progress=False) == alone["dot"][1].losses  # a Run is exactly one train() of that seed
    rebuilt = alone["dot"][1].model(config)
    assert all(torch.equal(p, q) for p, q in zip(rebuilt.parameters(), single.parameters()))
    assert accuracy_rows(alone["none"], [2, 5]).shape == (2, 2)
    longer = run_seeds(["none", "dot"], seeds=(1,), config=config, lengths=[2], n=5, steps={"dot": 9}, progress=False)
    assert len(longer["none"][0].losses) == 6 and len(longer["dot"][0].losses) == 9
    assert longer["dot"][0].losses[:6] == alone["dot"][1].losses  # the same run, continued
    with pytest.raises(ValueError, match="attention must be one of"):
        run_seeds(["luong"], config=config)


def test_seed_spread_and_the_encoder_decoder_diagram_draw_labelled_figures():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attncourse import plot

    rows = {"a": [[0.1, 0.2, 0.3], [0.2, 0.3, 0.4]], "b": torch.rand(3, 3)}
    ax = plot.seed_spread([4, 5, 6], rows, title="t", xlabel="x", ylabel="y", ylim=(0, 1))
    assert ax.get_title() == "t" and ax.get_xlabel() == "x" and ax.get_ylabel() == "y"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["a (mean of 2 seeds, band: min-max)", "b (mean of 3 seeds, band: min-max)"]
    means = [line for line in ax.get_lines() if line.get_label().startswith("a ")][0]
    assert means.get_marker() != [line for line in ax.get_lines() if line.get_label().startswith("b ")][0].get_marker()
    assert list(means.get_ydata()) == pytest.approx([0.15, 0.25, 0.35])
    with pytest.raises(ValueError, match="rows of 2 values for 3 x positions"):
        plot.seed_spread([4, 5, 6], {"a": [[0.1, 0.2]]}, title="t", xlabel="x", ylabel="y")
    fig = plot.encoder_decoder_diagram(weights=(0.2, 0.8), step=1)
    assert len(fig.axes) == 2 and all(a.get_title() for a in fig.axes)
    plt.close("all")


# ----------------------------------------------------------------------------- local-p and Bahdanau's own decoder


def _local_p_reference(query, keys, values, mask, module):
    """Luong et al.'s eqs. 9-10 written out one (sequence, query) at a time, in float64."""
    W, W_p, v_p, D = module.W.weight, module.W_p.weight, module.v_p.weight[0], module.window
    b, tq, _ = query.shape
    weights = torch.zeros(b, tq, keys.shape[1], dtype=torch.float64)
    for i in range(b):
        n = int(mask[i].sum())
        h = keys[i, :n]  # the real positions (padding is at the end)
        for t in range(tq):
            s = query[i, t]
            p = n * torch.sigmoid(v_p @ torch.tanh(W_p @ s))  # eq. 9
            j = torch.arange(n, dtype=torch.float64)
            inside = (j - p).abs() <= D
            if not inside.any():
                continue
            align = torch.softmax((h[inside] @ W.T) @ s, dim=0)  # general score s^T W h_j, softmax over the window
            weights[i, t, :n][inside] = align * torch.exp(-((j[inside] - p) ** 2) / (2 * (D / 2) ** 2))  # eq. 10
    return weights @ values, weights


def test_local_p_follows_luong_eqs_9_and_10():
    from attncourse.rnn_attention import LocalPAttention

    gen = torch.Generator().manual_seed(5)
    module = LocalPAttention(6, 4, window=2, hidden_size=5).double()
    query = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64) * 2
    keys = torch.randn(3, 9, 4, generator=gen, dtype=torch.float64)
    values = torch.randn(3, 9, 3, generator=gen, dtype=torch.float64)
    mask = torch.arange(9) < torch.tensor([9, 5, 2])[:, None]
    with torch.no_grad():
        context, weights = module(query, keys, values, mask)
        ref_context, ref_weights = _local_p_reference(query, keys, values, mask, module)
    torch.testing.assert_close(weights, ref_weights)
    torch.testing.assert_close(context, ref_context)
    assert (weights.masked_select(~mask[:, None, :]) == 0).all() and (weights.sum(-1) <= 1 + 1e-12).all()
    assert ((weights > 0).sum(-1) <= 2 * 2 + 1).all()  # nothing outside the window [p - D, p + D]
    one, _ = module(query[:, 0], keys, values, mask)  # a (B, Dq) query is one row of the (B, Tq, Dq) call
    torch.testing.assert_close(one, context[:, 0])
    with pytest.raises(ValueError, match="window"):
        LocalPAttention(6, 4, window=0)


def test_local_p_with_an_endless_window_is_general_attention():
    """With D huge the window holds every position and the Gaussian is 1: global general attention, checked
    against PyTorch's kernel (scale 1, the score s^T W h as q . (W h))."""
    from attncourse.rnn_attention import LocalPAttention

    gen = torch.Generator().manual_seed(6)
    module = LocalPAttention(6, 4, window=10**6).double()
    query = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64)
    keys = torch.randn(2, 7, 4, generator=gen, dtype=torch.float64)
    values = torch.randn(2, 7, 5, generator=gen, dtype=torch.float64)
    mask = torch.arange(7) < torch.tensor([7, 4])[:, None]
    with torch.no_grad():
        context, _ = module(query, keys, values, mask)
        ref = F.scaled_dot_product_attention(query, module.W(keys), values, attn_mask=mask[:, None, :], scale=1.0)
    torch.testing.assert_close(context, ref)


def test_bahdanau_decoder_queries_with_the_previous_state():
    from attncourse.bahdanau import BahdanauSeq2Seq

    model = build_model("bahdanau", Seq2SeqConfig(**SMALL)).double()
    assert isinstance(model, BahdanauSeq2Seq)
    batch = reverse_batch(4, 3, 7, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, weights = model(batch.src, batch.lengths, batch.tgt)
        annotations, s0 = model.encode(batch.src, batch.lengths)
        # s_0 = tanh(W_s <-h_1 + b): the backward GRU's state after reading the sequence back to its first token
        packed = torch.nn.utils.rnn.pack_padded_sequence(model.embed(batch.src), batch.lengths, batch_first=True,
                                                         enforce_sorted=False)
        torch.testing.assert_close(s0, torch.tanh(model.bridge(model.encoder(packed)[1][1])))
        # step 1 asks with s_0; step 2 with s_1 = GRU([E y_0; c_1], s_0)
        c1, w1 = model.attention(s0, annotations, mask=batch.mask)
        torch.testing.assert_close(weights[:, 0], w1)
        y0 = model.embed(torch.full((4,), SOS))
        s1 = model.decoder(torch.cat([y0, c1], dim=-1), s0)
        torch.testing.assert_close(weights[:, 1], model.attention(s1, annotations, mask=batch.mask)[1])
        t = (model.out_state(s0) + model.out_token(y0) + model.out_context(c1)).view(4, -1, 2).amax(-1)
        torch.testing.assert_close(logits[:, 0], model.out(t))  # the deep output reads s_0, y_0 and c_1
        greedy, greedy_w = model(batch.src, batch.lengths, steps=5)
        forced, forced_w = model(batch.src, batch.lengths, greedy.argmax(-1))
    torch.testing.assert_close(forced, greedy)
    torch.testing.assert_close(forced_w, greedy_w)
    assert torch.all(weights.masked_select(~batch.mask[:, None, :]) == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:2], dtype=torch.float64))


def test_location_score_reads_the_state_alone_and_masks_padding():
    """Luong's location score: a_t = softmax(W_a s_t) over the first T of max_len positions, padding masked; the
    annotations do not move the weights; checked against PyTorch's kernel with the scores as a float mask."""
    from attncourse.rnn_attention import LocationAttention

    gen = torch.Generator().manual_seed(7)
    module = LocationAttention(6, 4, max_len=9).double()
    query = torch.randn(3, 5, 6, generator=gen, dtype=torch.float64)
    keys = torch.randn(3, 7, 4, generator=gen, dtype=torch.float64)
    mask = torch.arange(7) < torch.tensor([7, 3, 1])[:, None]
    with torch.no_grad():
        context, weights = module(query, keys, mask=mask)
        scores = (query @ module.W_a.weight.T)[..., :7]  # (B, Tq, max_len) -> (B, Tq, T)
        ref = F.scaled_dot_product_attention(torch.zeros(3, 5, 1, dtype=torch.float64), torch.zeros(3, 7, 1,
                                             dtype=torch.float64), keys,
                                             attn_mask=scores.masked_fill(~mask[:, None], float("-inf")))
        torch.testing.assert_close(context, ref)
        _, other = module(query, torch.randn(3, 7, 4, generator=gen, dtype=torch.float64), mask=mask)
    torch.testing.assert_close(weights, other)  # the keys never enter the score
    assert (weights.masked_select(~mask[:, None, :]) == 0).all()
    with pytest.raises(ValueError, match="max_len"):
        module(query, torch.randn(3, 10, 4, dtype=torch.float64))
    assert count_parameters(module) == 6 * 9


def test_mean_attention_is_the_plain_mean_of_the_real_annotations():
    from attncourse.rnn_attention import MeanAttention

    keys = torch.randn(2, 5, 4, dtype=torch.float64)
    mask = torch.arange(5) < torch.tensor([5, 2])[:, None]
    context, weights = MeanAttention(3, 4)(torch.randn(2, 6, 3, dtype=torch.float64), keys, mask=mask)
    torch.testing.assert_close(context[0], keys[0].mean(0).expand(6, 4))
    torch.testing.assert_close(context[1], keys[1, :2].mean(0).expand(6, 4))
    assert (weights[1, :, 2:] == 0).all() and count_parameters(MeanAttention(3, 4)) == 0
    for kind in ("location", "mean"):  # both build on the course's model and run a step
        model = build_model(kind, Seq2SeqConfig(max_len=6, batch_size=4))
        batch = reverse_batch(4, 2, 6, generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(loss_on(model, batch))
