r"""Feature maps for linear attention, and what each lets a fixed state recall.

Linear attention replaces :math:`\exp(q \cdot k)` by :math:`\phi(q)^\top \phi(k)`; the state then holds
:math:`\sum_i \phi(k_i) v_i^\top`, a (feature dim x value dim) matrix. Three maps of chapter 13:

- ``"identity"``: :math:`\phi(x) = x` on L2-normalised keys (DeltaNet's, Gated DeltaNet's);
- ``"elu+1"``: :math:`\phi(x) = \mathrm{elu}(x) + 1` (Katharopoulos et al. 2020, arXiv:2006.16236), positive features;
- ``"taylor2"``: the second-order Taylor map of Based (Arora et al. 2024, arXiv:2402.18668),
  :math:`\phi(x) = [1, x, \mathrm{vec}(x x^\top) / \sqrt 2]`, so that
  :math:`\phi(q)^\top \phi(k) = 1 + q \cdot k + (q \cdot k)^2 / 2`, the first three terms of :math:`e^{q \cdot k}`.
  A key of :math:`d` dimensions becomes :math:`1 + d + d^2` features: the state grows with the square of the key
  dimension.

:func:`feature_recall` is :func:`attncourse.recall.memory_recall`'s untrained test with the map as the argument.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _validate

FEATURE_MAPS = ("identity", "elu+1", "taylor2")


def taylor2(x: torch.Tensor) -> torch.Tensor:
    """(..., d) -> (..., 1 + d + d^2): ``[1, x, vec(x x^T) / sqrt(2)]``; ``taylor2(q) @ taylor2(k)`` is
    ``1 + q.k + (q.k)^2 / 2``. Raises TypeError for a non-tensor, ValueError for a 0-d tensor."""
    _validate.tensor("x", x, min_rank=1)
    outer = (x[..., :, None] * x[..., None, :]).flatten(-2)  # (..., d * d)
    return torch.cat([torch.ones_like(x[..., :1]), x, outer * 2 ** -0.5], dim=-1)


def feature_map(name: str, x: torch.Tensor) -> torch.Tensor:
    """Apply the map called `name` (one of :data:`FEATURE_MAPS`) to the last dimension of `x`."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"feature map must be one of {FEATURE_MAPS}, got {name!r}")
    _validate.tensor("x", x, min_rank=1)
    if name == "identity":
        return x
    if name == "elu+1":
        return F.elu(x) + 1.0
    return taylor2(x)


def feature_dim(name: str, key_dim: int) -> int:
    """Features per key: the state's number of rows."""
    _validate.positive_int("key_dim", key_dim)
    return feature_map(name, torch.zeros(key_dim)).shape[-1]


def feature_recall(name: str, n_pairs: int, key_dim: int, seed: int, value_dim: int = 32,
                   scale: float = 1.0) -> float:
    """Fraction of `n_pairs` stored pairs read back exactly through the state :math:`S = \\sum_i \\phi(k_i)
    v_i^\\top`: keys random unit vectors of `key_dim` dims multiplied by :math:`\\sqrt{scale}` (so the kernel sees
    scale * q.k, as softmax's temperature), values random unit vectors of `value_dim`; a read is right when the
    stored value closest to :math:`S^\\top \\phi(k_j)` is :math:`v_j`. (The denominator :math:`\\phi(q)^\\top z` is
    positive for elu+1 and taylor2 and does not change which value is closest; identity has none.) With
    ``"identity"`` and ``key_dim == value_dim`` this is ``memory_recall("linear", ...)``, draw for draw.

    Raises: ValueError for an unknown map or a scale that is not a positive number; TypeError/ValueError for
    sizes that are not positive ints.
    """
    for arg, v in (("n_pairs", n_pairs), ("key_dim", key_dim), ("value_dim", value_dim)):
        _validate.positive_int(arg, v)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    gen = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(n_pairs, key_dim, generator=gen, dtype=torch.float64), dim=-1)  # (N, dk)
    values = F.normalize(torch.randn(n_pairs, value_dim, generator=gen, dtype=torch.float64), dim=-1)  # (N, dv)
    feats = feature_map(name, keys * float(scale) ** 0.5)  # (N, features)
    state = feats.T @ values  # (features, dv): sum_i phi(k_i) v_i^T
    read = feats @ state  # (N, dv): S^T phi(k_j) for every key
    return float(((read @ values.T).argmax(-1) == torch.arange(n_pairs)).double().mean())
