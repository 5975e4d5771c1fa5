"""Chapter 14's exercise 5 (one DSA decode step): the right answer passes check and grader; the package's functions,
dense attention with the unselected keys masked, a copy of the whole cache, a score without the ReLU, and typed
numbers are refused."""

from __future__ import annotations

import math

import torch

from attncourse.classroom import checks
from exercise_routes import NOT_THE_WAY, accepted, failure, refused
from test_salting import SALT, _grader


def indexer_decode(q, k, v, q_index, w_index, k_index, top_k):
    relu_dots = torch.clamp(k_index @ q_index.T, min=0)  # (S, HI)
    chosen = torch.topk(relu_dots @ w_index, min(top_k, len(k))).indices  # (k,)
    chosen, _ = torch.sort(chosen)
    keys, values = torch.index_select(k, 0, chosen), torch.index_select(v, 0, chosen)  # (k, D), (k, Dv)
    w = torch.softmax((q @ keys.T) * q.shape[1] ** -0.5, dim=1)  # (H, k)
    return w @ values, chosen


def test_right_answer_passes(tmp_path, monkeypatch):
    accepted("14-indexer-decode", indexer_decode, tmp_path, monkeypatch)


def test_gathering_by_flat_indices_passes(tmp_path, monkeypatch):
    def by_take(q, k, v, q_index, w_index, k_index, top_k):  # the selected rows taken by flat indices
        chosen = torch.sort(torch.topk(torch.relu(k_index @ q_index.T) @ w_index, min(top_k, len(k))).indices)[0]
        rows_k = torch.take(k, (chosen[:, None] * k.shape[1] + torch.arange(k.shape[1])).reshape(-1))
        rows_v = torch.take(v, (chosen[:, None] * v.shape[1] + torch.arange(v.shape[1])).reshape(-1))
        w = torch.softmax(q @ rows_k.view(len(chosen), -1).T / math.sqrt(q.shape[1]), 1)
        return w @ rows_v.view(len(chosen), -1), chosen

    accepted("14-indexer-decode", by_take, tmp_path, monkeypatch)


def test_gathering_by_embedding_passes(tmp_path, monkeypatch):
    def by_embedding(q, k, v, q_index, w_index, k_index, top_k):  # F.embedding(idx, cache) is a row gather too
        chosen = torch.sort(torch.topk(torch.relu(k_index @ q_index.T) @ w_index, min(top_k, len(k))).indices)[0]
        keys, values = torch.nn.functional.embedding(chosen, k), torch.nn.functional.embedding(chosen, v)
        return torch.softmax(q @ keys.T / math.sqrt(q.shape[1]), 1) @ values, chosen

    accepted("14-indexer-decode", by_embedding, tmp_path, monkeypatch)


def test_dense_then_mask_and_row_by_row_reads_refused(tmp_path, monkeypatch):
    def dense_weights_zeroed(q, k, v, q_index, w_index, k_index, top_k):  # every weight, then the unselected zeroed
        chosen = torch.sort(torch.topk(torch.relu(k_index @ q_index.T) @ w_index, min(top_k, len(k))).indices)[0]
        keep = torch.zeros(len(k), dtype=torch.bool)
        keep[chosen] = True
        w = torch.softmax((q @ k.T) / math.sqrt(q.shape[1]), 1) * keep
        return (w / w.sum(1, keepdim=True)) @ v, chosen

    def each_row(q, k, v, q_index, w_index, k_index, top_k):  # every main key scored one row at a time
        chosen = torch.sort(torch.topk(torch.relu(k_index @ q_index.T) @ w_index, min(top_k, len(k))).indices)[0]
        s = torch.stack([q @ k[i] for i in range(len(k))], 1) / math.sqrt(q.shape[1])  # (H, S), row by row
        w = torch.softmax(s[:, chosen], 1)
        return w @ v[chosen], chosen

    for route in (dense_weights_zeroed, each_row):
        msg, graded = refused("14-indexer-decode", route, tmp_path, monkeypatch)
        assert NOT_THE_WAY in msg and NOT_THE_WAY in graded, (route.__name__, msg)


def test_wrong_score_and_typed_numbers_refused(tmp_path, monkeypatch):
    def no_relu(q, k, v, q_index, w_index, k_index, top_k):  # the weighted sum of raw dot products
        chosen = torch.sort(torch.topk(k_index @ q_index.T @ w_index, min(top_k, len(k))).indices)[0]
        return torch.softmax(q @ k[chosen].T / math.sqrt(q.shape[1]), 1) @ v[chosen], chosen

    def main_scores(q, k, v, q_index, w_index, k_index, top_k):  # the main heads' own scores rank the tokens
        chosen = torch.sort(torch.topk((q @ k.T).sum(0), min(top_k, len(k))).indices)[0]
        return torch.softmax(q @ k[chosen].T / math.sqrt(q.shape[1]), 1) @ v[chosen], chosen

    failure("14-indexer-decode", no_relu)
    refused("14-indexer-decode", main_scores, tmp_path, monkeypatch)
    ex = checks.get("14-indexer-decode")
    table = {c.args[-1]: c.expected for c in ex.make_cases()}  # the check cell's values, by top_k

    def typed(q, k, v, q_index, w_index, k_index, top_k):
        return table[top_k]

    failure(ex.id, typed)  # the check cell's gradient case refuses typed numbers: they carry no gradient
    assert _grader(ex, typed, SALT, tmp_path, monkeypatch)[0] in ("failed", "error")
