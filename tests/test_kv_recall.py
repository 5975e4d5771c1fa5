"""attncourse.kv_recall: the question-at-the-end recall prompts, the eviction policies' key sets, the answers decoded
from a compressed cache against kv_compress.compressed_eval and a greedy decode by hand, and the planted circuit's
needs (every answer from the full cache, and from the question plus one key per question, the right ones)."""

from __future__ import annotations

import pytest
import torch

from attncourse.kv_compress import compressed_eval
from attncourse.kv_recall import (answer_accuracy, keep_masks, planted_recall_model, prefill_maps,
                                  question_batch)


def test_question_batch_layout():
    tokens, prompt, answers = question_batch(torch.Generator().manual_seed(0), 8, n_pairs=6, n_queries=2, n_keys=8)
    assert tokens.shape == (8, 2 * 6 + 1 + 3 * 2) and prompt == 15 and answers.tolist() == [16, 18]
    for row in tokens.tolist():
        pairs = dict(zip(row[0:12:2], row[1:12:2]))
        assert len(pairs) == 6 and all(k < 8 <= v < 16 for k, v in pairs.items()) and row[12] == 16
        assert row[13:15] == row[15::2] and len(set(row[13:15])) == 2  # the question, asked again in order
        assert row[16::2] == [pairs[q] for q in row[13:15]]  # each answer is its key's value
    with pytest.raises(ValueError, match="n_queries"):
        question_batch(torch.Generator(), 2, n_pairs=4, n_queries=5, n_keys=8)


def test_keep_masks_budget_window_and_errors():
    maps = [torch.softmax(torch.randn(2, 2, 10, 10).masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(),
                                                                 float("-inf")), -1) for _ in range(2)]
    for policy in ("snapkv", "h2o", "recent", "random"):
        for keep in keep_masks(maps, policy, 5, window=3, generator=torch.Generator().manual_seed(1)):
            assert keep.shape == (2, 2, 10) and (keep.sum(-1) == 5).all() and keep[..., 7:].all()
    assert all(k.all() for k in keep_masks(maps, "full"))
    a, b = (keep_masks(maps, "random", 5, window=3, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    assert not all(torch.equal(x, y) for x, y in zip(a, b))  # the draw follows the generator
    with pytest.raises(ValueError, match="policy"):
        keep_masks(maps, "lru", 5)
    with pytest.raises(ValueError, match="budget"):
        keep_masks(maps, "snapkv", 2, window=3)


def test_answers_match_compressed_eval_and_a_greedy_decode():
    model = planted_recall_model(8, 6, 2, generator=torch.Generator().manual_seed(0), noise=1.0)  # noisy: wrong often
    tokens, prompt, answers = question_batch(torch.Generator().manual_seed(3), 16, n_pairs=6, n_queries=2, n_keys=8)
    for policy in ("full", "snapkv", "h2o", "recent"):
        got = answer_accuracy(model, tokens, prompt, answers, policy, None if policy == "full" else 6, window=2)
        kw = {} if policy == "full" else dict(budget=6, window=2, kernel=5, pool="avg") if policy == "snapkv" \
            else dict(budget=6, window=2)
        ref = compressed_eval(model, tokens, prompt, policy, **kw)["logits"][:, answers - 1].argmax(-1)
        assert torch.equal(got["pred"], ref)
    seq = tokens.clone()  # decoded by hand with the full cache: each answer the model's own greedy token
    with torch.no_grad():
        for pos in answers.tolist():
            seq[:, pos] = model(seq)[:, pos - 1].argmax(-1)
    assert torch.equal(answer_accuracy(model, tokens, prompt, answers, "full", decoded=True)["pred"], seq[:, answers])
    maps = prefill_maps(model, tokens, prompt)  # masks chosen elsewhere give what the same policy gives
    mine = [keep.clone() for keep in keep_masks(maps, "h2o", 6, window=2)]
    assert torch.equal(answer_accuracy(model, tokens, prompt, answers, keeps=mine, maps=maps)["pred"],
                       answer_accuracy(model, tokens, prompt, answers, "h2o", 6, window=2, maps=maps)["pred"])
    with pytest.raises(ValueError, match="keeps"):
        answer_accuracy(model, tokens, prompt, answers, keeps=mine[:1], maps=maps)


def test_planted_circuit_needs_one_value_per_question_key():
    model = planted_recall_model(8, 6, 2, generator=torch.Generator().manual_seed(0))
    tokens, prompt, answers = question_batch(torch.Generator().manual_seed(4), 64, n_pairs=6, n_queries=2, n_keys=8)
    assert answer_accuracy(model, tokens, prompt, answers)["accuracy"] == 1.0
    assert answer_accuracy(model, tokens, prompt, answers, "snapkv", 4, window=2, kernel=1)["accuracy"] == 1.0
    assert answer_accuracy(model, tokens, prompt, answers, "recent", 4, window=2)["accuracy"] < 0.5
