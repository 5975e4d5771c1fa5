"""The row sums train_sink_variant reports (chapter 12, section 4b): BOS's share of the weight on real keys."""

from __future__ import annotations

import torch

from attncourse.sink_variants import train_sink_variant


def test_row_mass_is_one_for_softmax_and_below_one_with_a_sink_logit():
    soft = train_sink_variant("softmax", 0, steps=2, batch_size=4)
    sink = train_sink_variant("sink_logit", 0, steps=2, batch_size=4)
    for layer in range(2):
        torch.testing.assert_close(torch.tensor(soft["row_mass"][layer]), torch.ones(4))
        mass = torch.tensor(sink["row_mass"][layer])
        assert ((mass > 0) & (mass < 1)).all(), mass  # the sink's column takes part of every row
        assert (torch.tensor(sink["first_token"][layer]) <= mass).all()
