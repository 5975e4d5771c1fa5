"""Plots carry titles and axis labels; seeds and the environment report work."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from attncourse import env_report, plot, set_seed  # noqa: E402


def test_heatmap_labels_and_blank_inf():
    data = torch.tensor([[0.5, float("-inf")], [0.2, 0.8]])
    ax = plot.heatmap(data, title="weights")
    assert ax.get_title() == "weights"
    assert ax.get_xlabel() == plot.KEY and ax.get_ylabel() == plot.QUERY
    plt.close("all")


def test_heads_grid_titles_every_panel():
    fig = plot.heads_grid(torch.rand(5, 3, 4), title="five heads", cols=3)
    titled = [ax for ax in fig.axes if ax.get_title().startswith("head ")]
    assert len(titled) == 5
    assert all(ax.get_xlabel() and ax.get_ylabel() for ax in titled)
    assert fig._suptitle.get_text() == "five heads"
    plt.close("all")


def test_heads_grid_panels_share_one_colour_scale():
    weights = torch.rand(3, 2, 4)
    weights[1] *= 0.1                                   # a head with small weights must not get its own scale
    weights[2, 0, 0] = float("-inf")                    # blocked cells do not set the scale
    fig = plot.heads_grid(weights, title="three heads")
    panels = [ax for ax in fig.axes if ax.get_title().startswith("head ")]
    finite = weights[torch.isfinite(weights)]
    for ax in panels:
        assert ax.collections[0].get_clim() == pytest.approx((finite.min().item(), finite.max().item()))
    plt.close("all")


def test_masks_side_by_side():
    fig = plot.masks_side_by_side({"a": torch.ones(3, 3, dtype=torch.bool), "b": torch.eye(3, dtype=torch.bool)})
    assert [ax.get_title() for ax in fig.axes[:2]] == ["a", "b"]
    plt.close("all")


def test_plot_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"must be 2-D .* got shape \(2, 2, 2\)"):
        plot.heatmap(torch.zeros(2, 2, 2), title="x")
    with pytest.raises(ValueError, match=r"\(H, Tq, Tk\)"):
        plot.heads_grid(torch.zeros(2, 2), title="x")


def test_set_seed_reproducible():
    set_seed(7)
    a = torch.randn(3)
    set_seed(7)
    assert torch.equal(a, torch.randn(3))
    with pytest.raises(TypeError, match="seed must be an int"):
        set_seed(1.5)


def test_env_report_keys():
    report = env_report()
    assert report["torch"] == torch.__version__
    assert {"python", "numpy", "cuda available", "cpu threads (torch)"} <= set(report)


def test_device_and_printed_report(capsys):
    from attncourse import device, print_env_report

    assert device(prefer_gpu=False) == torch.device("cpu")
    assert device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    print_env_report()
    out = capsys.readouterr().out
    assert "torch" in out and torch.__version__ in out


def test_causal_mask_helper():
    from attncourse import causal_mask

    assert causal_mask(2, 3).tolist() == [[True, False, False], [True, True, False]]


def test_line_plot_labels_curves_and_marker_line():
    ax = plot.line_plot([16, 32, 64], {"a": [1.0, 2.0, 3.0], "b": torch.tensor([1.0, 1.1, 1.2])}, title="loss",
                        xlabel="length", ylabel="nats", logx=True, vline=16, vline_label="train length")
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("loss", "length", "nats")
    assert ax.get_xscale() == "log" and ax.get_yscale() == "linear"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b", "train length"]
    plt.close("all")


def test_line_plot_tells_curves_apart_without_colour():
    """Each curve: its own Okabe-Ito colour and its own line style, and its own marker unless marker="" (review 8:
    the helper drew matplotlib's default red and green, told apart by colour only)."""
    curves = {name: [1.0 + i, 2.0, 3.0] for i, name in enumerate("abcde")}
    for marker in ("o", ""):
        ax = plot.line_plot([1, 2, 3], curves, title="t", xlabel="x", ylabel="y", marker=marker)
        lines = ax.get_lines()
        assert [matplotlib.colors.to_hex(ln.get_color()) for ln in lines] == [c.lower() for c in plot.OKABE_ITO[:5]]
        assert len({ln.get_linestyle() for ln in lines[:4]}) == 4
        marks = [ln.get_marker() for ln in lines]
        assert marks == ([""] * 5 if marker == "" else list(plot.MARKERS[:5])), marks
        plt.close("all")


def test_line_plot_rejects_length_mismatch():
    with pytest.raises(ValueError, match=r"curve 'a' has 2 values for 3 x positions"):
        plot.line_plot([1, 2, 3], {"a": [1.0, 2.0]}, title="t", xlabel="x", ylabel="y")
    plt.close("all")


def test_heads_grid_takes_one_anchored_scale():
    w = torch.rand(3, 4, 4) * 0.5 + 0.2
    fig = plot.heads_grid(w, title="anchored", vmin=0, vmax=1)
    assert {ax.collections[0].get_clim() for ax in fig.axes if ax.get_title().startswith("head ")} == {(0.0, 1.0)}
    with pytest.raises(ValueError, match="vmin"):
        plot.heads_grid(w, title="x", vmin=1, vmax=0)
    plt.close("all")
