"""Chapter 14's exercise 5 (14-indexer-decode) accepts PyTorch's attention over the gathered rows (the skill is the
selection and reading only its rows) and still refuses it over the whole cache with the unselected keys masked."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exercise_routes import NOT_THE_WAY, accepted, refused


def _chosen(q_index, w_index, k_index, top_k):
    return torch.sort(torch.topk(torch.relu(k_index @ q_index.T) @ w_index, min(top_k, len(k_index))).indices)[0]


def test_pytorch_attention_on_the_selected_rows_passes(tmp_path, monkeypatch):
    def gathered_sdpa(q, k, v, q_index, w_index, k_index, top_k):
        chosen = _chosen(q_index, w_index, k_index, top_k)
        return F.scaled_dot_product_attention(q[None], k[chosen][None], v[chosen][None])[0], chosen

    accepted("14-indexer-decode", gathered_sdpa, tmp_path, monkeypatch)


def test_pytorch_attention_over_the_whole_cache_masked_refused(tmp_path, monkeypatch):
    def masked_sdpa(q, k, v, q_index, w_index, k_index, top_k):
        chosen = _chosen(q_index, w_index, k_index, top_k)
        keep = torch.zeros(len(k), dtype=torch.bool)
        keep[chosen] = True
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=keep)[0], chosen

    msg, graded = refused("14-indexer-decode", masked_sdpa, tmp_path, monkeypatch)
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded, msg
