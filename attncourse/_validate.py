"""Input validation shared by every public function: messages name the argument and the shapes seen."""

from __future__ import annotations

import torch


def tensor(name: str, x: object, *, min_rank: int = 1, floating: bool = False) -> torch.Tensor:
    """Raise TypeError unless `x` is a tensor; ValueError if its rank is below `min_rank`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_rank:
        raise ValueError(f"{name} must have at least {min_rank} dims, got shape {tuple(x.shape)}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def positive_int(name: str, value: object) -> int:
    """Raise TypeError for a non-int (bools included) and ValueError for a value < 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def broadcastable(name: str, shape: tuple[int, ...], target: tuple[int, ...], what: str) -> None:
    """Raise ValueError unless `shape` broadcasts to `target`."""
    try:
        if torch.broadcast_shapes(shape, target) != torch.Size(target):
            raise RuntimeError
    except RuntimeError:
        raise ValueError(
            f"{name} of shape {tuple(shape)} does not broadcast to {what} {tuple(target)}"
        ) from None
