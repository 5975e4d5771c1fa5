"""01-padding-mask's cases with the padding's scores far above the real ones (chapter 01; checks/ch01.py uses them).

A softmax over the whole row followed by zeroing the padding and renormalising is right only while exp of the real
scores minus the row's maximum does not underflow: with the padding 1000 above (float64) or 200 above (float32) it
returns all zeros for a row that has real positions. A right masked softmax is unaffected.
"""

from __future__ import annotations

import torch

from . import Case


def far_padding_cases(gen: torch.Generator) -> list[Case]:
    """Two cases, float64 with the padding 1000 above the real scores, then float32 with it 200 above."""
    lengths, mask = torch.tensor([2, 4]), torch.arange(5) < torch.tensor([[2], [4]])  # (B,), (B, T)
    cases = []
    for above, label, tol in ((1000.0, "", {}), (200.0, "float32 scores, ", {"rtol": 1e-5, "atol": 1e-7})):
        scores = torch.randn(2, 5, generator=gen, dtype=torch.float64) * 3 + above * ~mask
        scores = scores.float() if label else scores
        cases.append(Case(f"{label}the padding's scores sit {above:.0f} above the real ones (the real weights must "
                          "still sum to 1)", (scores, lengths),
                          expected=torch.softmax(scores.masked_fill(~mask, -torch.inf), -1), **tol))
    return cases
