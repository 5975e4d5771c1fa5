"""Lesson 02's extra models. Luong's local-m attention (p_t = t, the general score's softmax over the window
|j - t| <= D) and the decoder step it needs: checked against the equations written out, against PyTorch's kernel for
an endless window, and in the course's greedy decoder, where each one-step call must be told its step. The general
score with a factored, low-rank matrix (a Transformer head's score), checked against general and PyTorch."""

import pytest
import torch
import torch.nn.functional as F

from attncourse.rnn_attention import LocalMAttention
from attncourse.seq2seq import Seq2SeqConfig, build_model, reverse_batch


def _reference(query, keys, values, mask, module, first_step=0):
    W, D = module.W.weight, module.window
    b, tq, _ = query.shape
    weights = torch.zeros(b, tq, keys.shape[1], dtype=torch.float64)
    for i in range(b):
        n = int(mask[i].sum())
        for t in range(tq):
            j = torch.arange(n)
            inside = (j - (first_step + t)).abs() <= D  # p_t = t
            if inside.any():
                weights[i, t, :n][inside] = torch.softmax((keys[i, :n][inside] @ W.T) @ query[i, t], dim=0)
    return weights @ values, weights


@pytest.mark.parametrize("first_step", [0, 3])
def test_local_m_follows_the_equations(first_step):
    gen = torch.Generator().manual_seed(11)
    module = LocalMAttention(6, 4, window=2).double()
    query = torch.randn(3, 5, 6, generator=gen, dtype=torch.float64)
    keys = torch.randn(3, 9, 4, generator=gen, dtype=torch.float64)
    values = torch.randn(3, 9, 3, generator=gen, dtype=torch.float64)
    mask = torch.arange(9) < torch.tensor([9, 5, 2])[:, None]
    with torch.no_grad():
        context, weights = module(query, keys, values, mask, first_step=first_step)
        ref_context, ref_weights = _reference(query, keys, values, mask, module, first_step)
        one, one_w = module(query[:, 2], keys, values, mask, first_step=first_step + 2)  # one step, told its step
    torch.testing.assert_close(weights, ref_weights)
    torch.testing.assert_close(context, ref_context)
    torch.testing.assert_close(one, context[:, 2])
    torch.testing.assert_close(one_w, weights[:, 2])
    assert ((weights > 0).sum(-1) <= 5).all() and (weights.masked_select(~mask[:, None, :]) == 0).all()


def test_local_m_with_an_endless_window_is_general_attention():
    gen = torch.Generator().manual_seed(12)
    module = LocalMAttention(6, 4, window=100).double()
    query, keys = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64), torch.randn(2, 7, 4, generator=gen,
                                                                                            dtype=torch.float64)
    mask = torch.arange(7) < torch.tensor([7, 4])[:, None]
    with torch.no_grad():
        context, _ = module(query, keys, mask=mask)
        ref = F.scaled_dot_product_attention(query, module.W(keys), keys, attn_mask=mask[:, None, :], scale=1.0)
    torch.testing.assert_close(context, ref)


def test_the_greedy_decoder_tells_local_m_its_step():
    """Greedy decoding (one step per call) gives the same weights as teacher forcing on the same inputs."""
    model = build_model("local-m", Seq2SeqConfig(local_window=2))
    batch = reverse_batch(3, 5, 7, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, greedy_w = model(batch.src, batch.lengths, steps=batch.src.shape[1])
        tokens = logits.argmax(-1)  # feed greedy's own outputs back with teacher forcing
        _, forced_w = model(batch.src, batch.lengths, tokens)
    torch.testing.assert_close(greedy_w, forced_w)
    t = torch.arange(batch.src.shape[1])
    assert (greedy_w[:, (t[:, None] - t).abs() > 2] == 0).all()  # nothing outside [t - 2, t + 2]


def test_local_m_rejects_bad_input():
    with pytest.raises(ValueError, match="window"):
        LocalMAttention(6, 4, window=0)
    with pytest.raises(ValueError, match="first_step"):
        LocalMAttention(6, 4, window=2)(torch.randn(2, 6), torch.randn(2, 5, 4), first_step=-1)


def test_stored_local_m_model_is_the_stored_runs_model():
    """results/ch02_local_m_D2_seed0.pt (lesson 02 re-measures it) is seed 0 of the stored local-m D=2 run: its
    greedy accuracy at every length is the stored one (no retraining)."""
    import json
    from dataclasses import replace
    from pathlib import Path

    from attncourse.seq2seq import accuracy_by_length

    results = Path(__file__).resolve().parents[1] / "notebooks" / "results"
    stored = json.loads((results / "ch02_local_m.json").read_text())["local-m D=2"]["accuracy"][0]  # lengths 4-16
    model = build_model("local-m", replace(Seq2SeqConfig(), local_window=2))
    model.load_state_dict(torch.load(results / "ch02_local_m_D2_seed0.pt", weights_only=True))
    accuracy = accuracy_by_length(model.eval(), range(4, 17), 200)  # one generator draws every length in turn
    torch.testing.assert_close(torch.tensor(list(accuracy.values())), torch.tensor(stored), rtol=0, atol=0.005)


def test_factored_general_is_general_with_a_low_rank_matrix():
    """FactoredGeneralAttention (lesson 02's rank runs) scores (W_q s) . (W_k h): Luong's general score with
    W = W_q^T W_k, and PyTorch's kernel on the projected queries and keys (scale 1)."""
    from attncourse.rnn_attention import FactoredGeneralAttention, LuongAttention

    gen = torch.Generator().manual_seed(13)
    module = FactoredGeneralAttention(6, 5, rank=2).double()
    general = LuongAttention(6, 5, "general").double()
    with torch.no_grad():
        general.W.weight.copy_(module.W_q.weight.T @ module.W_k.weight)  # (6, 2) @ (2, 5)
    query, keys = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64), torch.randn(3, 7, 5, generator=gen,
                                                                                            dtype=torch.float64)
    mask = torch.arange(7) < torch.tensor([7, 3, 1])[:, None]
    with torch.no_grad():
        context, weights = module(query, keys, mask=mask)
        ref_context, ref_weights = general(query, keys, mask=mask)
        sdpa = F.scaled_dot_product_attention(module.W_q(query), module.W_k(keys), keys, attn_mask=mask[:, None, :],
                                              scale=1.0)
        one, _ = module(query[:, 1], keys, mask=mask)
    torch.testing.assert_close(weights, ref_weights)
    torch.testing.assert_close(context, ref_context)
    torch.testing.assert_close(context, sdpa)
    torch.testing.assert_close(one, context[:, 1])
    model = build_model("general-rank-4", Seq2SeqConfig())
    assert sum(p.numel() for p in model.attention.parameters()) == 4 * (64 + 64)
    with pytest.raises(ValueError, match="rank"):
        FactoredGeneralAttention(6, 5, rank=0)
