"""jaxray.reporting.figures: the sweep's plots and the shared figure helpers, from hand-written rows."""

from __future__ import annotations

import matplotlib.pyplot as plt

from jaxray.reporting.figures import compact, log2_batch_axis, plot_loss_curves, plot_throughput, save_figure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_compact_tick_labels():
    assert [compact(x) for x in (12, 12000, 3_500_000, 2e9, -4000)] == ["12", "12k", "3.5M", "2G", "-4k"]


def test_log2_axis_shows_the_batches_that_ran_and_figures_are_closed(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([64, 256, 1024], [1, 2, 3])
    log2_batch_axis(ax, [64, 256, 1024])
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "256", "1024"]
    save_figure(fig, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:8] == PNG_SIGNATURE
    assert not plt.fignum_exists(fig.number)


def test_plots_skip_what_cannot_be_drawn(tmp_path):
    rows = [
        {
            "trial": "a",
            "workload": "mlp",
            "global_batch": 64,
            "dtype": "float32",
            "width": 8,
            "examples_per_sec": 10,
        },
        {"trial": "b", "workload": "mlp", "global_batch": 0, "examples_per_sec": 5},  # no log2 position
        {"trial": "c", "workload": "transformer", "global_batch": 8, "tokens_per_sec": float("nan")},
    ]
    plot_throughput(rows, tmp_path / "t.png")
    histories = {"a": [{"examples": 64, "loss": 2.0}, {"examples": 128, "loss": float("nan")}], "ghost": [{}]}
    plot_loss_curves(rows, histories, tmp_path / "l.png")
    plot_throughput([], tmp_path / "empty.png")
    for name in ("t.png", "l.png", "empty.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE
