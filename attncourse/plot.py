"""Every picture the course draws: heatmaps of weights, masks and biases, and grids of heads.

Math modules never import this one. Each function returns the matplotlib objects it drew on and
always sets a title and axis labels, so rows and columns are never unnamed.
Run ``python -m attncourse.plot`` for a demo.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import seaborn as sns
import torch

QUERY = "query position i"
KEY = "key position j"
PALETTE = sns.color_palette("colorblind")  # colour-blind-safe colours for lines and bars (seaborn's "colorblind")


def _to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        x = x.float() if x.dtype in (torch.bfloat16, torch.float16, torch.bool) else x
        return x.numpy()
    return np.asarray(x, dtype=float)


def heatmap(
    data,
    *,
    title: str,
    xlabel: str = KEY,
    ylabel: str = QUERY,
    ax: plt.Axes | None = None,
    xticklabels: Sequence[str] | str = "auto",
    yticklabels: Sequence[str] | str = "auto",
    cmap: str = "viridis",
    annot: bool = False,
    fmt: str = ".2f",
    vmin: float | None = None,
    vmax: float | None = None,
    cbar_label: str | None = "weight",
    center: float | None = None,
) -> plt.Axes:
    """A 2-D heatmap (rows = `ylabel`, columns = `xlabel`); `-inf` entries are drawn blank."""
    arr = _to_numpy(data)
    if arr.ndim != 2:
        raise ValueError(f"data must be 2-D (rows, columns), got shape {arr.shape}")
    if ax is None:
        _, ax = plt.subplots(figsize=(min(1 + 0.45 * arr.shape[1], 9), min(0.8 + 0.4 * arr.shape[0], 8)))
    masked = ~np.isfinite(arr)
    sns.heatmap(
        np.where(masked, np.nan, arr), ax=ax, cmap=cmap, annot=annot, fmt=fmt, vmin=vmin, vmax=vmax,
        center=center, mask=masked, xticklabels=xticklabels, yticklabels=yticklabels, square=False,
        cbar_kws={"label": cbar_label} if cbar_label else None, cbar=cbar_label is not None,
        linewidths=0.3 if arr.size <= 400 else 0, linecolor="white",
    )
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return ax


def mask_heatmap(mask: torch.Tensor, *, title: str, ax: plt.Axes | None = None,
                 xlabel: str = KEY, ylabel: str = QUERY) -> plt.Axes:
    """A boolean mask: dark where attention is allowed (True), light where it is blocked."""
    ax = heatmap(mask, title=title, ax=ax, xlabel=xlabel, ylabel=ylabel, cmap="Blues",
                 vmin=0, vmax=1, cbar_label=None)
    return ax


def heads_grid(
    weights: torch.Tensor,
    *,
    title: str,
    xlabel: str = KEY,
    ylabel: str = QUERY,
    head_names: Sequence[str] | None = None,
    cols: int = 4,
    xticklabels: Sequence[str] | str = "auto",
    yticklabels: Sequence[str] | str = "auto",
    cmap: str = "viridis",
    cbar_label: str = "weight",
) -> plt.Figure:
    """One heatmap per head for `weights` of shape (H, Tq, Tk), sharing a colour scale."""
    arr = _to_numpy(weights)
    if arr.ndim != 3:
        raise ValueError(f"weights must be (H, Tq, Tk), got shape {arr.shape}")
    n = arr.shape[0]
    cols = max(1, min(cols, n))
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.9 * rows), squeeze=False)
    finite = arr[np.isfinite(arr)]
    vmin, vmax = (finite.min(), finite.max()) if finite.size else (0, 1)
    for i, ax in enumerate(axes.flat):
        if i >= n:
            ax.axis("off")
            continue
        name = head_names[i] if head_names is not None else f"head {i}"
        heatmap(arr[i], title=name, ax=ax, xlabel=xlabel, ylabel=ylabel, cmap=cmap, vmin=vmin,
                vmax=vmax, cbar_label=cbar_label if i % cols == cols - 1 or i == n - 1 else None,
                xticklabels=xticklabels, yticklabels=yticklabels)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def masks_side_by_side(masks: Mapping[str, torch.Tensor], *, title: str = "Attention masks "
                       "(dark = may attend)") -> plt.Figure:
    """Several (Tq, Tk) boolean masks in one row, each titled by its key."""
    fig, axes = plt.subplots(1, len(masks), figsize=(3.6 * len(masks), 3.4), squeeze=False)
    for ax, (name, mask) in zip(axes[0], masks.items()):
        mask_heatmap(mask, title=name, ax=ax)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def line_plot(x: Sequence[float], curves: Mapping[str, Sequence[float]], *, title: str, xlabel: str,
              ylabel: str, ax: plt.Axes | None = None, logx: bool = False, logy: bool = False,
              vline: float | None = None, vline_label: str | None = None, marker: str = "o") -> plt.Axes:
    """One line per entry of `curves` (name -> y values at `x`), with an optional vertical marker line
    (e.g. the training length); log axes on request."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.8))
    for name, ys in curves.items():
        if len(ys) != len(x):
            raise ValueError(f"curve {name!r} has {len(ys)} values for {len(x)} x positions")
        ax.plot(x, _to_numpy(ys), marker=marker, label=name)
    if vline is not None:
        ax.axvline(vline, color="grey", ls="--", lw=1, label=vline_label)
    ax.set_xscale("log" if logx else "linear")
    ax.set_yscale("log" if logy else "linear")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    return ax


def diagram(boxes: Mapping[str, tuple[float, float, float, float]], arrows: Sequence[tuple[str, str]], *,
            title: str, ax: plt.Axes | None = None, colors: Mapping[str, int] | None = None,
            size: tuple[float, float] = (6, 4)) -> plt.Axes:
    """A box-and-arrow diagram: `boxes` maps a label to its (x, y, width, height) in data units, `arrows` joins
    labels (from the first box's top to the second's bottom, or side to side when they share a row); `colors`
    maps a label to an index into :data:`PALETTE`. The axes are hidden: position carries no quantity."""
    if ax is None:
        _, ax = plt.subplots(figsize=size)
    colors = colors or {}
    for label, (x, y, w, h) in boxes.items():
        face = PALETTE[colors[label]] if label in colors else (0.93, 0.93, 0.93)
        ax.add_patch(plt.Rectangle((x, y), w, h, facecolor=face, edgecolor="black", alpha=0.85))
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=8, wrap=True)
    for start, end in arrows:
        (x0, y0, w0, h0), (x1, y1, w1, h1) = boxes[start], boxes[end]
        if abs(y0 - y1) < 1e-9:  # same row: side to side
            a, b = (x0 + w0, y0 + h0 / 2), (x1, y1 + h1 / 2)
        else:
            a = (x0 + w0 / 2, y0 + h0 if y1 > y0 else y0)
            b = (x1 + w1 / 2, y1 if y1 > y0 else y1 + h1)
        ax.annotate("", xy=b, xytext=a, arrowprops=dict(arrowstyle="->", lw=1.2))
    xs = [v for x, _, w, _ in boxes.values() for v in (x, x + w)]
    ys = [v for _, y, _, h in boxes.values() for v in (y, y + h)]
    ax.set(xlim=(min(xs) - 0.2, max(xs) + 0.2), ylim=(min(ys) - 0.2, max(ys) + 0.2), title=title)
    ax.set_axis_off()
    return ax


if __name__ == "__main__":  # pragma: no cover - a demo that draws
    from .sdpa import scaled_dot_product_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 6, 8).unbind(0)
    _, w = scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    heads_grid(w, title="Causal self-attention weights of 4 random heads")
    plt.show()
