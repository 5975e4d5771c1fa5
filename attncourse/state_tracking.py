r"""State tracking with the delta rule: why a write strength beta in [0, 2] lets DeltaNet count modulo 2.

The delta rule's transition is :math:`S_t = (I - \beta_t k_t k_t^\top) S_{t-1} + \beta_t k_t v_t^\top` (unit
:math:`k_t`). The matrix :math:`I - \beta_t k_t k_t^\top` has eigenvalue :math:`1 - \beta_t` along :math:`k_t` and
1 elsewhere. With :math:`\beta_t \in [0, 1]` (a sigmoid, as DeltaNet and Gated DeltaNet ship) every eigenvalue is in
[0, 1]: the state can shrink a direction but never flip it. Grazzi et al. 2025 ("Unlocking State-Tracking in Linear
RNNs Through Negative Eigenvalues", arXiv:2411.12537, ICLR 2025) prove that a linear RNN whose transitions have only
non-negative eigenvalues cannot solve parity at arbitrary length with a finite-precision readout, and that
:math:`\beta_t \in [0, 2]` (eigenvalue in [-1, 1]: :math:`\beta = 2` is a reflection) is enough;
flash-linear-attention exposes it as ``allow_neg_eigval`` (it multiplies the sigmoid by 2).

The task here: a begin token, then bits; at every bit, the parity of the bits so far. One DeltaNet layer (one head),
a linear readout, trained on short sequences and tested on longer ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate
from . import linear_attention as la


def parity_batch(gen: torch.Generator, batch_size: int, n_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, 1 + n_bits): 2 (begin) then bits 0/1; targets (B, n_bits): the parity of the bits up to each.

    Raises:
        ValueError: if batch_size or n_bits is not a positive int.
    """
    _validate.positive_int("batch_size", batch_size)
    _validate.positive_int("n_bits", n_bits)
    bits = torch.randint(0, 2, (batch_size, n_bits), generator=gen)  # (B, n)
    tokens = torch.cat([torch.full((batch_size, 1), 2), bits], dim=1)  # (B, 1 + n)
    return tokens, bits.cumsum(1) % 2


class ParityDeltaNet(nn.Module):
    """One DeltaNet head over embedded tokens with a linear readout: ids (B, T) -> parity logits (B, T - 1).

    Args:
        beta_max: the write strength is ``beta_max * sigmoid(.)``: 1 gives eigenvalues in [0, 1] (DeltaNet as
            shipped), 2 gives [-1, 1] (Grazzi et al. 2025).
        dim: width of the embedding, the key and the value. chunk_size: of the chunkwise delta rule.
    Raises:
        ValueError: if beta_max is not in (0, 2] or dim is not a positive int.
    """

    def __init__(self, beta_max: float, dim: int = 8, chunk_size: int = 16):
        super().__init__()
        if isinstance(beta_max, bool) or not isinstance(beta_max, (int, float)) or not 0 < beta_max <= 2:
            raise ValueError(f"beta_max must be a number in (0, 2], got {beta_max!r}")
        _validate.positive_int("dim", dim)
        self.beta_max, self.chunk_size = float(beta_max), chunk_size
        self.embed = nn.Embedding(3, dim)
        self.qkvb = nn.Linear(dim, 3 * dim + 1)
        self.out = nn.Linear(dim, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, d)
        q, k, v, b = self.qkvb(x).split([x.shape[-1]] * 3 + [1], dim=-1)
        q, k = F.normalize(q, dim=-1)[:, None], F.normalize(k, dim=-1)[:, None]  # (B, 1, T, d): one head, unit keys
        beta = self.beta_max * torch.sigmoid(b[..., 0])[:, None]  # (B, 1, T)
        o, _ = la.chunked(q, k, v[:, None], beta=beta, chunk_size=self.chunk_size, scale=1.0)  # (B, 1, T, d)
        return self.out(o[:, 0, 1:]).squeeze(-1)  # (B, T - 1): one logit per bit


def train_parity(beta_max: float, seed: int, steps: int = 120, train_bits: int = 15, test_bits: int = 64,
                 batch_size: int = 64, lr: float = 1e-2) -> tuple[float, float]:
    """Train :class:`ParityDeltaNet` on ``train_bits``-bit sequences; accuracy (train length, test length).

    Accuracy is over every position of 512 held-out sequences of each length (0.5 is chance).
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = ParityDeltaNet(beta_max)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        tokens, target = parity_batch(gen, batch_size, train_bits)
        loss = F.binary_cross_entropy_with_logits(model(tokens), target.float())
        opt.zero_grad()
        loss.backward()
        opt.step()
    held = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        accs = []
        for n in (train_bits, test_bits):
            tokens, target = parity_batch(held, 512, n)
            accs.append(float(((model(tokens) > 0).long() == target).float().mean()))
    return accs[0], accs[1]
