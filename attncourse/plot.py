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
    vmin: float | None = None,
    vmax: float | None = None,
) -> plt.Figure:
    """One heatmap per head for `weights` of shape (H, Tq, Tk), all on one colour scale so that the panels compare:
    `vmin` to `vmax`, by default the smallest and largest finite value over every head (``vmin=0`` anchors attention
    weights at 0)."""
    arr = _to_numpy(weights)
    if arr.ndim != 3:
        raise ValueError(f"weights must be (H, Tq, Tk), got shape {arr.shape}")
    n = arr.shape[0]
    cols = max(1, min(cols, n))
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.9 * rows), squeeze=False)
    finite = arr[np.isfinite(arr)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    vmin, vmax = (low if vmin is None else float(vmin)), (high if vmax is None else float(vmax))
    if vmin > vmax:
        raise ValueError(f"vmin must be <= vmax, got vmin={vmin}, vmax={vmax}")
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
    (e.g. the training length); log axes on request. Lines are told apart by colour (Okabe-Ito), line style and,
    unless ``marker=""``, marker: `marker` is the first curve's, the others take the next of :data:`MARKERS`."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.8))
    first = MARKERS.index(marker) if marker in MARKERS else 0
    for i, (name, ys) in enumerate(curves.items()):
        if len(ys) != len(x):
            raise ValueError(f"curve {name!r} has {len(ys)} values for {len(x)} x positions")
        mark = "" if marker == "" else (marker if i == 0 else MARKERS[(first + i) % len(MARKERS)])
        ax.plot(x, _to_numpy(ys), marker=mark, ls=LINE_STYLES[i % len(LINE_STYLES)],
                color=OKABE_ITO[i % len(OKABE_ITO)], label=name)
    if vline is not None:
        ax.axvline(vline, color="grey", ls="--", lw=1, label=vline_label)
    ax.set_xscale("log" if logx else "linear")
    ax.set_yscale("log" if logy else "linear")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    return ax


# Okabe & Ito's palette (distinguishable with the common colour-vision deficiencies), black first left out.
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINE_STYLES = ("-", "--", "-.", ":")


def seed_spread(x: Sequence[float], runs: Mapping[str, Sequence[Sequence[float]]], *, title: str, xlabel: str,
                ylabel: str, ax: plt.Axes | None = None, ylim: tuple[float, float] | None = None) -> plt.Axes:
    """One curve per entry of `runs` (name -> one row of y values per seed, each row at `x`): the mean over seeds
    with its own colour (Okabe-Ito) and marker, a band from the lowest to the highest seed, and every seed's
    points, so the spread is seen, not only the average."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4))
    for i, (name, rows) in enumerate(runs.items()):
        arr = np.stack([_to_numpy(r) for r in rows])  # (seeds, len(x))
        if arr.shape[1] != len(x):
            raise ValueError(f"runs[{name!r}] has rows of {arr.shape[1]} values for {len(x)} x positions")
        colour, mark = OKABE_ITO[i % len(OKABE_ITO)], MARKERS[i % len(MARKERS)]
        if len(arr) > 1:  # one seed has no spread to show
            ax.fill_between(x, arr.min(0), arr.max(0), color=colour, alpha=0.18, lw=0)
        for row in arr:
            ax.plot(x, row, ls="none", marker=mark, ms=3, color=colour, alpha=0.45)
        ax.plot(x, arr.mean(0), marker=mark, ms=6, color=colour, ls=("-", "--", "-.", ":")[i % 4],
                label=f"{name} (mean of {arr.shape[0]} seeds, band: min-max)" if len(arr) > 1 else f"{name} (1 seed)")
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    return ax


def _box(ax: plt.Axes, xy: tuple[float, float], text: str, colour: str, w: float = 0.8, h: float = 0.5) -> None:
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((xy[0] - w / 2, xy[1] - h / 2), w, h, boxstyle="round,pad=0.03", fc=colour,
                                ec="black", lw=0.8, alpha=0.9))
    ax.text(*xy, text, ha="center", va="center", fontsize=9)


def _arrow(ax: plt.Axes, start, end, colour: str = "black", lw: float = 1.0, alpha: float = 1.0) -> None:
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="->", color=colour, lw=lw, alpha=alpha))


def encoder_decoder_diagram(weights: Sequence[float] = (0.05, 0.1, 0.15, 0.7), step: int = 0) -> plt.Figure:
    """Two encoder-decoders side by side: without attention (everything passes through the one vector s_0) and
    with attention (decoder step t scores every annotation h_j against its state s_t and mixes them with weights
    alpha_tj into c_t). Arrow widths show `weights` (one per source position) for decoder step `step`."""
    s = len(weights)
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    enc, dec, ctx, att = OKABE_ITO[4], OKABE_ITO[1], OKABE_ITO[2], OKABE_ITO[5]
    xs_enc = [j * 1.1 for j in range(s)]
    x_bridge = s * 1.1 + 0.2
    xs_dec = [x_bridge + 1.1 * (t + 1) for t in range(s)]
    for ax, attention in zip(axes, (False, True)):
        ax.set_xlim(-0.7, xs_dec[-1] + 0.7)
        ax.set_ylim(-0.9, 3.9)
        ax.axis("off")
        for j, x in enumerate(xs_enc):
            ax.text(x, -0.75, f"$x_{{{j + 1}}}$", ha="center", fontsize=10)
            _arrow(ax, (x, -0.55), (x, -0.27))
            _box(ax, (x, 0), f"$h_{{{j + 1}}}$", enc)
            if j:
                ax.annotate("", xy=(x - 0.4, 0.08), xytext=(x - 0.7, 0.08), arrowprops=dict(arrowstyle="<->", lw=0.8))
        _box(ax, (x_bridge, 0.0), "$s_0$", dec, w=0.55)
        _arrow(ax, (xs_enc[-1] + 0.4, 0), (x_bridge - 0.3, 0), lw=1.0 if attention else 3.0)
        for t, x in enumerate(xs_dec):
            _box(ax, (x, 1.0), f"$s_{{{t + 1}}}$", dec)
            _arrow(ax, (xs_dec[t - 1] + 0.4, 1.0) if t else (x_bridge + 0.1, 0.27), (x - 0.4, 1.0))
            top = 3.3
            if attention and t == step:
                _box(ax, (x, 2.2), f"$c_{{{t + 1}}}$", ctx, w=0.55, h=0.42)
                _arrow(ax, (x, 1.25), (x, 1.98), colour="black")
                ax.text(x + 0.08, 1.55, "query", fontsize=8)
                _arrow(ax, (x, 2.42), (x, top - 0.05))
                ax.text(x + 0.35, 2.7, f"$[s_{{{t + 1}}}; c_{{{t + 1}}}]$", fontsize=9)
            else:
                _arrow(ax, (x, 1.25), (x, top - 0.05), colour="black" if not attention else "grey")
            ax.text(x, top + 0.05, f"$y_{{{t + 1}}}$", ha="center", fontsize=10)
        if attention:
            x_c = xs_dec[step]
            for j, (x, w) in enumerate(zip(xs_enc, weights)):
                _arrow(ax, (x, 0.27), (x_c - 0.28, 2.15), colour=att, lw=0.5 + 6 * w, alpha=0.35 + 0.65 * w)
                ax.text(x - 0.35, 0.38, rf"$\alpha_{{{step + 1},{j + 1}}}={w:.2f}$", fontsize=8, color=att)
            ax.set_title(f"With attention: output step {step + 1} reads every annotation, "
                         rf"weighted by $\alpha_{{{step + 1},j}}$", fontsize=11)
        else:
            ax.set_title(r"Without attention: the whole input reaches the decoder through $s_0$ alone", fontsize=11)
    fig.suptitle("Encoder-decoder: encoder annotations $h_j$ (blue, bidirectional GRU), decoder states $s_t$ "
                 "(orange), context $c_t$ (green), attention weights (vermillion)\nthe arrow into $s_0$ carries both "
                 f"ends of the encoder: the forward GRU's state at $h_{{{s}}}$ and the backward GRU's at $h_1$")
    fig.tight_layout()
    return fig


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
