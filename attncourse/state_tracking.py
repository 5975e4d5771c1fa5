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

One reflection per token is not enough to count modulo 3: that needs a transition of order 3, a rotation, and
:math:`I - \beta k k^\top` has real eigenvalues only. DeltaProduct (Siems et al. 2025, arXiv:2502.10297) takes
``n_h`` delta steps per token (:func:`delta_product`); two reflections make a rotation (:func:`train_counting`).
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


# ----------------------------------------------------------------------------- DeltaProduct: several steps per token


def delta_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, chunk_size: int = 16,
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""DeltaProduct (Siems et al. 2025, arXiv:2502.10297): ``n_h`` delta-rule steps per token, each with its own key,
    value and write strength, so the token's transition is a product of ``n_h`` generalised Householder matrices
    :math:`\prod_j (I - \beta_j k_j k_j^\top)`; the query reads the state after the token's last step.

    It is DeltaNet over a sequence ``n_h`` times as long, the steps of each token interleaved, read at every
    ``n_h``-th position (the paper's implementation does the same).

    Args:
        q: (B, H, T, Dk); k: (B, H, T, n_h, Dk); v: (B, H, T, n_h, Dv); beta: (B, H, T, n_h).
        chunk_size, scale: as :func:`attncourse.linear_attention.chunked`.
    Returns:
        (o, state): o (B, H, T, Dv) and the final state (B, H, Dk, Dv).
    Raises:
        TypeError, ValueError: for non-tensors or shapes that do not fit together.
    """
    _validate.tensor("k", k, min_rank=5, floating=True)
    _validate.tensor("q", q, min_rank=4, floating=True)
    b, h, t, n_h, dk = k.shape
    if q.shape != (b, h, t, dk) or v.dim() != 5 or v.shape[:4] != k.shape[:4] or tuple(beta.shape) != k.shape[:4]:
        raise ValueError(f"need q (B, H, T, Dk), k (B, H, T, n_h, Dk), v (B, H, T, n_h, Dv), beta (B, H, T, n_h); got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, beta {tuple(beta.shape)}")
    reads = torch.cat([q.new_zeros(b, h, t, n_h - 1, dk), q[:, :, :, None]], 3)  # (B, H, T, n_h, Dk): last step only
    o, state = la.chunked(reads.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3), beta=beta.flatten(2, 3),
                          chunk_size=chunk_size, scale=scale)  # (B, H, T * n_h, Dv): one position per step
    return o.unflatten(2, (t, n_h))[:, :, :, -1], state


class CountingDeltaProduct(nn.Module):
    """One DeltaProduct head (beta in [0, 2]) over embedded tokens with a linear readout: ids (B, T) of a begin token
    then digits 0..m-1 -> logits (B, T - 1, m) of the running sum modulo m. ``n_h = 1`` is DeltaNet.

    Raises:
        ValueError: if n_h, modulus or dim is not a positive int.
    """

    def __init__(self, n_h: int, modulus: int = 3, dim: int = 8, chunk_size: int = 16):
        super().__init__()
        for name, x in (("n_h", n_h), ("modulus", modulus), ("dim", dim)):
            _validate.positive_int(name, x)
        self.n_h, self.chunk_size = n_h, chunk_size
        self.embed = nn.Embedding(modulus + 1, dim)
        self.proj = nn.Linear(dim, dim + n_h * (2 * dim + 1))  # q, then (k, v, beta) for each step
        self.out = nn.Linear(dim, modulus)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, d)
        b, t, d = x.shape
        p = self.proj(x)
        steps = p[..., d:].unflatten(-1, (self.n_h, 2 * d + 1))  # (B, T, n_h, 2d + 1)
        q = F.normalize(p[..., :d], dim=-1)[:, None]  # (B, 1, T, d)
        k = F.normalize(steps[..., :d], dim=-1)[:, None]  # (B, 1, T, n_h, d): unit keys
        beta = 2 * torch.sigmoid(steps[..., -1])[:, None]  # (B, 1, T, n_h) in [0, 2]: reflections allowed
        o, _ = delta_product(q, k, steps[..., d:2 * d][:, None], beta, self.chunk_size, scale=1.0)
        return self.out(o[:, 0, 1:])  # (B, T - 1, m)


def train_counting(n_h: int, seed: int, modulus: int = 3, steps: int = 300, train_len: int = 15,
                   test_len: int = 64, batch_size: int = 64, lr: float = 1e-2) -> tuple[float, float]:
    """Train :class:`CountingDeltaProduct` on the running sum modulo ``modulus`` of ``train_len`` digits; accuracy at
    every position of 512 held-out sequences of the training length and of ``test_len`` (chance: 1 / modulus)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = CountingDeltaProduct(n_h, modulus)
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def batch(g: torch.Generator, n_seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        digits = torch.randint(0, modulus, (n_seq, length), generator=g)  # (B, n)
        return torch.cat([torch.full((n_seq, 1), modulus), digits], 1), digits.cumsum(1) % modulus

    for _ in range(steps):
        tokens, target = batch(gen, batch_size, train_len)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    held = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        accs = []
        for n in (train_len, test_len):
            tokens, target = batch(held, 512, n)
            accs.append(float((model(tokens).argmax(-1) == target).float().mean()))
    return accs[0], accs[1]
