"""Figures: the sweep's two plots (throughput_vs_batch.png, loss_curves.png) and shared helpers
(saving, a log2 batch axis, compact tick labels). Importing selects matplotlib's Agg backend."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # reports are written from headless Ray drivers: never open a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullLocator  # noqa: E402

from jaxray.reporting.format import finite, throughput, workloads  # noqa: E402


def save_figure(fig, path: Path) -> None:
    """Lay out ``fig``, write it to ``path`` as a 120-dpi PNG and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)  # sweeps write many reports from one process: do not leak figures


def compact(x: float, _pos=None) -> str:
    """12000 -> "12k", 3500000 -> "3.5M": tick labels that fit side by side."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:g}{suffix}"
    return f"{x:g}"


def log2_batch_axis(ax, batches: list[float]) -> None:
    """A log2 x axis labelled with exactly the batch sizes that were run."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(batches, [f"{b:g}" for b in batches])


def _subplots(n: int, title: str):
    fig, axes = plt.subplots(1, max(n, 1), figsize=(5.5 * max(n, 1), 4.3), squeeze=False)
    fig.suptitle(title)
    return fig, list(axes[0])


def _finish(ax, drawn: bool, empty_text: str) -> None:
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, empty_text, ha="center", va="center", transform=ax.transAxes)
        ax.set(xticks=[], yticks=[])  # ticks of an empty 0..1 range would read as data


def _throughput_series(rows: list[dict], workload: str) -> dict[str, list[tuple[float, float]]]:
    """{"dtype, width W, peak lr L": [(global batch, throughput), ...] sorted by batch}, finite
    points only: one series per grid point but the batch."""
    series: dict[tuple, list[tuple[float, float]]] = {}
    for r in (r for r in rows if r.get("workload", "?") == workload):
        value, batch = finite(throughput(r)[0]), finite(r.get("global_batch"))
        if value is not None and batch is not None and batch > 0:  # log axis: batch must be > 0
            lr = r.get("learning_rate")
            # The rate as trial names write it: two rates never share a series.
            key = (str(r.get("dtype", "?")), str(r.get("width", "?")), "?" if lr is None else repr(float(lr)))
            series.setdefault(key, []).append((batch, value))
    return {f"{d}, width {w}, peak lr {lr}": sorted(pts) for (d, w, lr), pts in sorted(series.items())}


def plot_throughput(rows: list[dict], path: Path) -> None:
    """Writes throughput (examples/s or tokens/s) against global batch on a log2 axis."""
    shown = workloads(rows)
    fig, axes = _subplots(len(shown), "Throughput vs global batch")
    for ax, w in zip(axes, shown):
        series = _throughput_series(rows, w)
        for label, points in series.items():
            ax.plot(*zip(*points), marker="o", label=label)
        log2_batch_axis(ax, sorted({x for pts in series.values() for x, _ in pts}))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}" if abs(y) >= 100 else f"{y:g}"))
        ax.set(
            title=w,
            xlabel="global batch (examples per step, log2)",
            ylabel="throughput (tokens/s)" if w == "transformer" else "throughput (examples/s)",
        )
        _finish(ax, bool(series), "no finished trials")
    if not shown:
        _finish(axes[0], False, "no trials")
    save_figure(fig, path)


def _curve(history: list[dict], xkey: str) -> list[tuple[float, float]]:
    points = [(finite(p.get(xkey)), finite(p.get("loss"))) for p in history]
    return [(x, y) for x, y in points if x is not None and y is not None]


def plot_loss_curves(rows: list[dict], histories: dict[str, list[dict]], path: Path) -> None:
    """Writes training loss (nats) against examples (MLPs) or tokens (transformer); trials without
    history or not in ``rows`` are skipped."""
    by_trial = {r.get("trial"): r for r in rows}
    traced = [by_trial[t] for t, h in histories.items() if h and t in by_trial]
    shown = workloads(traced)
    fig, axes = _subplots(len(shown), "Training loss")
    for ax, w in zip(axes, shown):
        xkey = "tokens" if w == "transformer" else "examples"
        curves = [(r, _curve(histories[r["trial"]], xkey)) for r in traced if r.get("workload", "?") == w]
        for r, points in (c for c in curves if c[1]):
            ax.plot(*zip(*points), marker="." if len(points) < 30 else None, label=str(r["trial"]))
        ax.xaxis.set_major_formatter(FuncFormatter(compact))  # token counts reach millions
        ax.set(title=w, xlabel=f"{xkey} processed", ylabel="training loss (cross-entropy, nats)")
        _finish(ax, any(points for _, points in curves), "no finite loss points")
    if not shown:
        _finish(axes[0], False, "no training history")
    save_figure(fig, path)
