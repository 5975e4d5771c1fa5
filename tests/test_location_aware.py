"""Location-aware attention (chapter 01): U = 0 is the additive model, the score is the formula, greedy decoding
agrees with teacher forcing on its own tokens, bad input is refused."""

import pytest
import torch
import torch.nn.functional as F

from attncourse.location_aware import LocationAwareAttention, build_location_aware
from attncourse.seq2seq import Seq2SeqConfig, build_model, reverse_batch

SMALL = Seq2SeqConfig(embed_size=8, encoder_size=8, decoder_size=16, attention_size=8, max_len=9)


def test_starts_as_the_additive_model():
    batch = reverse_batch(4, 3, 9, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = build_location_aware(SMALL)(batch.src, batch.lengths, batch.tgt)
        want = build_model("additive", SMALL)(batch.src, batch.lengths, batch.tgt)
    torch.testing.assert_close(got, want)


def test_score_is_the_formula_and_its_gradient_autograds():
    torch.manual_seed(0)
    att = LocationAwareAttention(6, 5, 4, filters=3, width=3).double()
    q, k, prev = torch.randn(2, 6, dtype=torch.float64), torch.randn(2, 7, 5, dtype=torch.float64), \
        torch.rand(2, 7, dtype=torch.float64)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    padded = F.pad(prev, (1, 1))
    f = torch.stack([padded[:, j:j + 3] @ att.conv.weight[:, 0].T for j in range(7)], 1)  # (2, 7, 3)
    e = torch.tanh(att.query_proj(q)[:, None] + att.key_proj(k) + att.loc_proj(f)) @ att.v.weight[0]
    want = torch.softmax(e.masked_fill(~mask, -torch.inf), -1)
    ctx, w = att(q, k, prev, mask=mask)
    torch.testing.assert_close(w, want)
    torch.testing.assert_close(ctx, (want[..., None] * k).sum(1))
    assert torch.autograd.gradcheck(lambda p: att(q, k, p, mask=mask)[0], prev.clone().requires_grad_())


def test_greedy_agrees_with_teacher_forcing_on_its_own_tokens():
    model = build_location_aware(SMALL)
    with torch.no_grad():
        torch.nn.init.normal_(model.attention.loc_proj.weight)
        batch = reverse_batch(3, 3, 9, generator=torch.Generator().manual_seed(1))
        logits, weights = model(batch.src, batch.lengths, steps=9)
        again, w2 = model(batch.src, batch.lengths, logits.argmax(-1))
    torch.testing.assert_close(again, logits)
    torch.testing.assert_close(w2, weights)


def test_bad_input():
    with pytest.raises(ValueError, match="width"):
        LocationAwareAttention(4, 4, 4, width=4)
    att = LocationAwareAttention(4, 4, 4)
    with pytest.raises(ValueError, match="previous"):
        att(torch.randn(2, 4), torch.randn(2, 5, 4), torch.rand(2, 4))
    with pytest.raises(ValueError, match="query"):
        att(torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.rand(2, 5))
