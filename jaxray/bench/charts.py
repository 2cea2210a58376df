"""The benchmarks' PNG charts (matplotlib, headless): bars per case, throughput against global
batch on a log2 axis, transformer loss/perplexity against tokens processed, and the Serve load
test's new tokens/s and latency against concurrent clients."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # benchmarks run on headless machines: never open a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from jaxray.bench.output import row_value  # noqa: E402
from jaxray.reporting.figures import compact, log2_batch_axis, save_figure  # noqa: E402


def _throughput(row: dict) -> tuple[float | None, str]:
    """(value or None, unit): tokens/s for the transformer, examples/s otherwise; skipped and failed
    rows keep their workload's unit so they show as "n/a" beside the measured ones."""
    if row.get("workload") == "transformer" or row.get("tokens_per_sec") is not None:
        return row_value(row, "tokens_per_sec"), "tokens/s"
    return row_value(row, "examples_per_sec"), "examples/s"


def bars(rows: list[dict], path: Path, label: str, title: str) -> None:
    """One bar per measured row (skipped/failed rows shown as empty slots), grouped by unit."""
    units = sorted({_throughput(r)[1] for r in rows})
    fig, axes = plt.subplots(1, len(units), figsize=(5.5 * len(units), 4), squeeze=False)
    for ax, unit in zip(axes[0], units):
        picked = [r for r in rows if _throughput(r)[1] == unit]
        values = [_throughput(r)[0] or 0.0 for r in picked]
        ax.bar([str(r.get(label)) for r in picked], values, color="tab:blue")
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:,.0f}" if v else "n/a", ha="center", va="bottom", fontsize=8)
        ax.set(ylabel=unit, title=title)
        ax.tick_params(axis="x", rotation=20)
        ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, path)


def throughput_vs_batch(rows: list[dict], path: Path) -> None:
    """Throughput against global batch (log2 x axis); skipped and failed sizes have no point."""
    points = sorted((r["global_batch"], _throughput(r)[0]) for r in rows if _throughput(r)[0])
    unit = _throughput(rows[0])[1] if rows else "examples/s"
    fig, ax = plt.subplots(figsize=(6, 4))
    if points:
        ax.plot(*zip(*points), marker="o")
        log2_batch_axis(ax, [p[0] for p in points])
    ax.yaxis.set_major_formatter(FuncFormatter(compact))
    ax.set(xlabel="global batch (log2)", ylabel=unit, title="Throughput vs global batch")
    ax.grid(True, alpha=0.3)
    save_figure(fig, path)


def lm_curves(rows: list[dict], path: Path, kept: dict) -> None:
    """Training loss and perplexity against tokens processed for each transformer measurement in
    ``kept`` ({label: Measurement}); tokens after step i = i x global batch x (T - 1)."""
    fig, (loss_ax, ppl_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for label, m in kept.items():
        per_step = m.row["global_batch"] * (m.row["seq_len"] - 1)
        tokens = [per_step * (i + 1) for i in range(len(m.losses))]
        loss_ax.plot(tokens, m.losses, label=label)
        ppl_ax.plot(tokens, [math.exp(min(x, 50.0)) for x in m.losses], label=label)
    for ax, name in ((loss_ax, "training loss (nats)"), (ppl_ax, "perplexity")):
        ax.xaxis.set_major_formatter(FuncFormatter(compact))
        ax.set(xlabel="tokens processed", ylabel=name)
        ax.grid(True, alpha=0.3)
        if kept:
            ax.legend(fontsize="small")
    fig.suptitle("Transformer: loss and perplexity vs tokens")
    save_figure(fig, path)


def loss_per_step(rows: list[dict], path: Path, kept: dict) -> None:
    """Training loss of every step run (warm-up and timed windows) for each Measurement in ``kept``."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, m in kept.items():
        ax.plot(range(1, len(m.losses) + 1), m.losses, label=label)
    ax.set(
        xlabel="step (warm-up first, then the timed windows)",
        ylabel="training loss (nats)",
        title="Loss of every step run",
    )
    ax.grid(True, alpha=0.3)
    if kept:
        ax.legend(fontsize="small")
    save_figure(fig, path)


def serve_load(rows: list[dict], path: Path) -> None:
    """New tokens/s and p95 latency (ms) against concurrent clients (log2 axis)."""
    fig, (tok_ax, lat_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in (
        (tok_ax, "new_tokens_per_s", "new tokens/s"),
        (lat_ax, "p95_ms", "p95 latency (ms)"),
    ):
        points = sorted((r["clients"], row_value(r, key)) for r in rows if row_value(r, key) is not None)
        if points:
            ax.plot(*zip(*points), marker="o")
            log2_batch_axis(ax, [p[0] for p in points])
        ax.set(xlabel="concurrent clients (log2)", ylabel=label, title=f"{label} vs clients")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    fig.suptitle("jaxray Serve under closed-loop HTTP load")
    save_figure(fig, path)
