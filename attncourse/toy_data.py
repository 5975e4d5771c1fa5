"""Synthetic token streams generated in code, for the tiny language models of chapters 06 and 07."""

from __future__ import annotations

import math

import torch

from . import _validate


def recurrence_tokens(batch_size: int, seq_len: int, vocab_size: int = 16, noise: float = 0.1,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, T) sequences where x[t] = (x[t-1] + x[t-2]) mod V, except that with probability `noise`
    a token is uniform at random. A local rule: predicting it needs the last two tokens and their order,
    never the absolute position, so a model that generalises by distance works at any length.
    """
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len), ("vocab_size", vocab_size)):
        _validate.positive_int(name, v)
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    x = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)  # (B, T)
    keep = torch.rand(batch_size, seq_len, generator=generator) >= noise  # (B, T): follow the rule
    for t in range(2, seq_len):
        x[:, t] = torch.where(keep[:, t], (x[:, t - 1] + x[:, t - 2]) % vocab_size, x[:, t])
    return x


def sine_wave(n: int, period: float = 40.0, phase: float = 0.0) -> torch.Tensor:
    """(n,) samples of sin(2 pi t / period + phase), t = 0 .. n-1."""
    _validate.positive_int("n", n)
    t = torch.arange(n, dtype=torch.float64)
    return torch.sin(2 * math.pi * t / period + phase).float()


def discretise(x: torch.Tensor, n_bins: int = 50, low: float = -1.0, high: float = 1.0) -> torch.Tensor:
    """Values in [low, high] to integer bins 0 .. n_bins-1 (same shape, int64)."""
    _validate.tensor("x", x, floating=True)
    _validate.positive_int("n_bins", n_bins)
    scaled = (x.clamp(low, high) - low) / (high - low)  # [0, 1]
    return (scaled * n_bins).long().clamp(max=n_bins - 1)


def bin_centres(tokens: torch.Tensor, n_bins: int = 50, low: float = -1.0, high: float = 1.0) -> torch.Tensor:
    """Inverse of :func:`discretise` up to the bin width: each bin's centre value."""
    return low + (tokens.float() + 0.5) * (high - low) / n_bins


def random_windows(series: torch.Tensor, batch_size: int, length: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, length) windows cut from a 1-D token series at random starts."""
    _validate.tensor("series", series)
    if series.dim() != 1 or len(series) < length:
        raise ValueError(f"series must be 1-D and at least length={length} long, got shape {tuple(series.shape)}")
    starts = torch.randint(0, len(series) - length + 1, (batch_size,), generator=generator)  # (B,)
    return series[starts[:, None] + torch.arange(length)]  # (B, length)
