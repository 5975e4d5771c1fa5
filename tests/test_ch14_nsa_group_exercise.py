"""Chapter 14's exercise 6 (one NSA decode step for a GQA group): the right answer, in two spellings, passes check and
grader; a choice per head, summed raw scores, the best head's probability and a missing own block fail (the package's
functions and dense attention with the other blocks masked are the exercise's shortcut and breakers, refused in
tests/test_exercise_standard.py)."""

from __future__ import annotations

import math

import torch

from attncourse.classroom import checks
from attncourse.classroom.checks import gradients
from exercise_routes import accepted, failure

ID = "14-nsa-group-decode"


def _rows(blocks, block_size, s):
    rows = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    return rows[rows < s]


def _attend(q, k, v, rows):
    return torch.softmax(q @ k[rows].T / math.sqrt(q.shape[1]), -1) @ v[rows]


def _choose(q, k_cmp, s, block_size, top_n, combine):
    own = (s - 1) // block_size
    scores = q @ k_cmp.T / math.sqrt(q.shape[1])  # (G, own)
    chosen = combine(scores).topk(min(top_n, own)).indices
    return torch.cat([chosen, torch.tensor([own])]).sort().values


def nsa_group_decode(q, k, v, k_cmp, block_size, top_n):
    blocks = _choose(q, k_cmp, k.shape[0], block_size, top_n, lambda s: torch.softmax(s, -1).sum(0))
    return _attend(q, k, v, _rows(blocks, block_size, k.shape[0])), blocks


def test_right_answers_pass(tmp_path, monkeypatch):
    accepted(ID, nsa_group_decode, tmp_path, monkeypatch)

    def by_slices(q, k, v, k_cmp, block_size, top_n):  # the mean over heads ranks as the sum; blocks taken as slices
        blocks = _choose(q, k_cmp, k.shape[0], block_size, top_n, lambda s: torch.softmax(s, -1).mean(0))
        keys = torch.cat([k[b * block_size:(b + 1) * block_size] for b in blocks.tolist()])
        values = torch.cat([v[b * block_size:(b + 1) * block_size] for b in blocks.tolist()])
        return torch.nn.functional.scaled_dot_product_attention(q[:, None], keys, values)[:, 0], blocks

    accepted(ID, by_slices, tmp_path, monkeypatch)


def test_other_choices_fail():
    def per_head_union(q, k, v, k_cmp, block_size, top_n):  # each head its own best blocks, the group loads the union
        own = (k.shape[0] - 1) // block_size
        top = torch.softmax(q @ k_cmp.T / math.sqrt(q.shape[1]), -1).topk(min(top_n, own), -1).indices
        blocks = torch.cat([top.flatten(), torch.tensor([own])]).unique()
        return _attend(q, k, v, _rows(blocks, block_size, k.shape[0])), blocks

    def summed_scores(q, k, v, k_cmp, block_size, top_n):  # raw scores summed over heads: a loud head decides
        blocks = _choose(q, k_cmp, k.shape[0], block_size, top_n, lambda s: s.sum(0))
        return _attend(q, k, v, _rows(blocks, block_size, k.shape[0])), blocks

    def best_head(q, k, v, k_cmp, block_size, top_n):  # the largest probability of any head
        blocks = _choose(q, k_cmp, k.shape[0], block_size, top_n, lambda s: torch.softmax(s, -1).amax(0))
        return _attend(q, k, v, _rows(blocks, block_size, k.shape[0])), blocks

    def no_own_block(q, k, v, k_cmp, block_size, top_n):  # the local block left out
        blocks = _choose(q, k_cmp, k.shape[0], block_size, top_n, lambda s: torch.softmax(s, -1).sum(0))[:-1]
        return _attend(q, k, v, _rows(blocks, block_size, k.shape[0])), blocks

    for route in (per_head_union, summed_scores, best_head, no_own_block):
        failure(ID, route)
    ex = checks.get(ID)  # the package's functions and dense attention with the other blocks masked: refused by
    assert gradients.declared(ex.make_cases()) == 6 and ex.shortcuts and len(ex.breakers) == 2  # test_exercise_standard's routes
