"""attncourse.nsa_groups: the two-needle task, and NSA's group-shared against per-head block selection in a model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attncourse.learned_sparse import blocks_to_mask, compressed_attention, nsa_select
from attncourse.nsa_groups import GroupConfig, GroupModel, train_groups, two_needle_batch
from attncourse.sdpa import scaled_dot_product_attention

CFG = GroupConfig(seq_len=32, block_size=4, n_heads=4, head_dim=8, d_model=16, steps=3, batch=8)


def test_two_needles_once_each_in_different_earlier_blocks():
    b = two_needle_batch(CFG, 64, torch.Generator().manual_seed(0))
    rows = torch.arange(64)
    assert (b["pos"] // CFG.block_size < CFG.seq_len // CFG.block_size - 1).all()  # before the last block
    assert (b["pos"][:, 0] // CFG.block_size != b["pos"][:, 1] // CFG.block_size).all()
    assert (b["ids"][:, 0] != b["ids"][:, 1]).all()
    for j in (0, 1):
        counts = (b["keys"][:, :-1] == b["ids"][:, j:j + 1]).sum(1)
        assert (counts == 1).all()  # each needle's id appears once before the query
        assert torch.equal(b["keys"][rows, b["pos"][:, j]], b["ids"][:, j])
    assert torch.equal(b["keys"][:, -1], b["ids"][:, 0]) and (b["values"][:, -1] == CFG.n_values).all()
    assert torch.equal(b["answer"], b["values"].gather(1, b["pos"]))


@pytest.mark.parametrize("select", ["shared", "per_head"])
def test_the_last_query_reads_the_chosen_blocks_and_the_branch_equals_torch(select):
    torch.manual_seed(0)
    model = GroupModel(CFG, select, 2)
    batch = two_needle_batch(CFG, 5, torch.Generator().manual_seed(1))
    _logits, read = model(batch)  # (B, H, T)
    x = model.key_emb(batch["keys"]) + model.val_emb(batch["values"])
    x[:, -1] += model.second_emb(batch["ids"][:, 1])
    q = model.wq(x).view(5, CFG.seq_len, CFG.n_heads, CFG.head_dim).transpose(1, 2)
    k, v = model.wk(x)[:, None], model.wv(x)[:, None]
    probs = compressed_attention(q, k, v, CFG.block_size)[1]
    sel = nsa_select(probs, 1 if select == "shared" else CFG.n_heads, 2, CFG.block_size)[:, :, -1]  # (B, 1|H, nB)
    want = blocks_to_mask(sel[:, :, None], CFG.block_size, CFG.seq_len, causal=False)[:, :, 0].expand_as(read)
    assert torch.equal(read, want)
    blocks = read.view(5, CFG.n_heads, -1, CFG.block_size).any(-1).sum(-1)  # (B, H)
    assert (blocks == 3).all()  # the own block and top_n = 2 for every head
    if select == "shared":
        assert (read == read[:, :1]).all()  # one choice for the whole group
    o = F.scaled_dot_product_attention(q[:, :, -1:], k.expand(-1, CFG.n_heads, -1, -1), v.expand(-1, CFG.n_heads, -1, -1),
                                       attn_mask=read[:, :, None])
    ours = scaled_dot_product_attention(
        q[:, :, -1:], k.expand(-1, CFG.n_heads, -1, -1), v.expand(-1, CFG.n_heads, -1, -1), read[:, :, None])
    torch.testing.assert_close(ours, o)


def test_training_reports_loads_and_rejects_bad_arguments():
    shared = train_groups("shared", 2, 0, CFG, eval_batch=16)
    per_head = train_groups("per_head", 2, 0, CFG, eval_batch=16)
    assert shared["blocks_loaded"] == 3.0  # top_n + 1 per group, however many heads
    assert 3.0 <= per_head["blocks_loaded"] <= min(CFG.n_heads * 2 + 1, CFG.seq_len // CFG.block_size)
    assert set(shared) == {"accuracy", "needle_accuracy", "loss", "recall", "blocks_loaded"}
    with pytest.raises(ValueError, match="select"):
        GroupModel(CFG, "union", 1)
    with pytest.raises(ValueError, match="top_n"):
        GroupModel(CFG, "shared", 0)
    with pytest.raises(ValueError, match="multiple"):
        two_needle_batch(GroupConfig(seq_len=30, block_size=4), 2, torch.Generator())
