"""attncourse.one_way: the one-way baseline of chapter 01's Sutskever control."""

import pytest
import torch

from attncourse.one_way import OneWaySeq2Seq, flip_rows
from attncourse.seq2seq import Seq2SeqConfig, reverse_batch


def test_flip_rows_is_the_reversal_target_and_keeps_padding():
    batch = reverse_batch(6, 1, 9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(flip_rows(batch.src, batch.lengths), batch.tgt)  # the task's target, padding included
    assert torch.equal(flip_rows(flip_rows(batch.src, batch.lengths), batch.lengths), batch.src)


def test_reverse_source_is_the_same_model_on_flipped_rows():
    config = Seq2SeqConfig(embed_size=5, encoder_size=4, decoder_size=6)
    batch = reverse_batch(4, 2, 7, generator=torch.Generator().manual_seed(1))
    plain, flipped = OneWaySeq2Seq(config), OneWaySeq2Seq(config, reverse_source=True)
    flipped.load_state_dict(plain.state_dict())
    with torch.no_grad():
        a, _ = flipped(batch.src, batch.lengths, batch.tgt)
        b, _ = plain(flip_rows(batch.src, batch.lengths), batch.lengths, batch.tgt)
        c, _ = plain(batch.src, batch.lengths, batch.tgt)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)  # the order the encoder reads in matters to a one-way encoder
    assert sum(p.numel() for p in plain.encoder.parameters()) == 3 * 4 * (5 + 4 + 2)  # one direction only


def test_bad_input():
    with pytest.raises(TypeError, match="reverse_source"):
        OneWaySeq2Seq(Seq2SeqConfig(), reverse_source=1)
    with pytest.raises(ValueError, match="lengths"):
        flip_rows(torch.zeros(2, 3, dtype=torch.long), torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="readings"):
        from attncourse.one_way import train_one_way

        train_one_way((0,), readings=("backwards",))
