"""The files a Tune sweep leaves behind: summary.json, summary.md and two PNG plots.

Written under ``out_dir`` by ``write_reports``:

    summary.json             one object per trial: KEY_ORDER keys first, then extras; NaN/inf -> null
    summary.md               heading, a table row per trial (failed ones too), best trial per workload
    throughput_vs_batch.png  examples/s (MLPs) or tokens/s (transformer) against global batch (log2)
    loss_curves.png          training loss against examples (MLPs) or tokens (transformer) processed

Units: throughput in examples/s or tokens/s, ``ms_per_step`` in milliseconds, ``compile_s`` in
seconds, ``peak_bytes_per_device`` in bytes (shown in MiB: XLA's memory analysis of the compiled
step, ``jaxray.train.compile_report``), losses in nats (cross-entropy), perplexity = exp(val_loss).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # reports are written from headless Ray drivers: never open a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullLocator  # noqa: E402

from jaxray.config import DEFAULT_METRIC  # noqa: E402

Ranking = dict[str, tuple[str, str]]  # workload -> (metric, "min" | "max")

KEY_ORDER = (
    "trial",
    "workload",
    "global_batch",
    "dtype",
    "width",
    "steps",
    "devices",
    "examples_per_sec",
    "tokens_per_sec",
    "ms_per_step",
    "compile_s",
    "peak_bytes_per_device",
    "final_train_loss",
    "test_accuracy",
    "val_loss",
    "val_perplexity",
    "checkpoint",
)
FILES = ("summary.json", "summary.md", "throughput_vs_batch.png", "loss_curves.png")
WORKLOAD_ORDER = ("mlp", "shared_block_mlp", "transformer")
HEADER = (
    "trial",
    "workload",
    "global batch",
    "dtype",
    "width",
    "steps",
    "devices",
    "throughput",
    "ms/step",
    "compile s",
    "peak MiB/device",
    "final train loss",
    "test acc",
    "val loss",
    "val ppl",
    "checkpoint",
)


def write_reports(
    out_dir: str | Path, rows: list[dict], histories: dict[str, list[dict]], ranking: Ranking | None = None
) -> dict[str, Path]:
    """Writes summary.json, summary.md, throughput_vs_batch.png and loss_curves.png under out_dir.

    ``histories`` maps a trial name to its logged rows (``step``, ``examples``, ``loss``, and
    ``tokens`` for the transformer). ``ranking`` maps a workload to the (metric, "min"|"max") that
    picks its best trial (default: ``jaxray.config.DEFAULT_METRIC``). Returns {file name: path}.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in FILES}
    # allow_nan=False: a NaN that slipped past json_safe fails here, not in the reader's parser
    paths["summary.json"].write_text(
        json.dumps([json_safe(ordered_row(r)) for r in rows], indent=2, allow_nan=False) + "\n"
    )
    paths["summary.md"].write_text(markdown_summary(rows, ranking))
    plot_throughput(rows, paths["throughput_vs_batch.png"])
    plot_loss_curves(rows, histories, paths["loss_curves.png"])
    return paths


def check_overwrite(out_dir: str | Path, writer: str, name: str = "summary.json") -> None:
    """Refuse to replace a ``summary.json`` (or ``name``) in ``out_dir`` that ``writer`` (e.g. "jaxray.bench") did
    not write, so pointing ``--out`` at a sweep's folder cannot destroy its results. Raises
    ValueError naming the file; a missing file, or one from the same writer, passes."""
    path = Path(out_dir) / name
    if not path.exists():
        return
    try:
        owner = json.loads(path.read_text()).get("written_by")
    except (ValueError, AttributeError, OSError):
        owner = None
    if owner != writer:
        raise ValueError(
            f"{path} exists and was not written by {writer}; choose another --out (nothing was changed)"
        )


def ordered_row(row: dict) -> dict:
    """The row with the KEY_ORDER keys first (those present), then the others as they came."""
    first = {k: row[k] for k in KEY_ORDER if k in row}
    return first | {k: v for k, v in row.items() if k not in first}


def json_safe(value: Any) -> Any:
    """A JSON-safe copy: non-finite floats become None, arrays and numpy scalars plain Python."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if hasattr(value, "tolist"):  # numpy / jax scalars and arrays
        return json_safe(value.tolist())
    return str(value)  # Paths and anything else: keep something readable


def _num(value: Any) -> float | None:
    """The value as a float, or None when missing or not a number (NaN/inf are kept)."""
    try:
        return None if value is None or isinstance(value, (bool, str)) else float(value)
    except (TypeError, ValueError):
        return None


def finite(value: Any) -> float | None:
    """The value as a float when it is a finite number, else None (missing, text, NaN, inf)."""
    v = _num(value)  # None for missing and for NaN/inf: what plots and rankings need
    return v if v is not None and math.isfinite(v) else None


def fmt(value: Any, spec: str) -> str:
    v = _num(value)
    return "" if v is None else format(v, spec)  # NaN/inf show as "nan"/"inf": a diverged run


def _throughput(row: dict) -> tuple[float | None, str]:
    """(value, unit) of the row's throughput: tokens/s for the transformer, examples/s otherwise."""
    if row.get("workload") == "transformer" or "tokens_per_sec" in row:
        return _num(row.get("tokens_per_sec")), "tok/s"
    return _num(row.get("examples_per_sec")), "ex/s"


def _mib(n: Any) -> float | None:
    v = _num(n)
    return None if v is None else v / 2**20


def cell(text: Any) -> str:  # a "|" or newline inside a cell would break the table layout
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def short_error(error: Any, limit: int = 80) -> str:
    text = next((ln.strip() for ln in str(error).splitlines() if ln.strip()), "")  # not the traceback
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _table_row(row: dict, with_error: bool) -> list[str]:
    value, unit = _throughput(row)
    ckpt = row.get("checkpoint")
    cells = [
        row.get("trial", ""),
        row.get("workload", ""),
        row.get("global_batch", ""),
        row.get("dtype", ""),
        row.get("width", ""),
        row.get("steps", ""),
        row.get("devices", ""),
        "" if value is None else f"{fmt(value, ',.0f')} {unit}",
        fmt(row.get("ms_per_step"), ".2f"),
        fmt(row.get("compile_s"), ".1f"),
        fmt(_mib(row.get("peak_bytes_per_device")), ",.1f"),
        fmt(row.get("final_train_loss"), ".4f"),
        fmt(row.get("test_accuracy"), ".4f"),
        fmt(row.get("val_loss"), ".4f"),
        fmt(row.get("val_perplexity"), ".2f"),
        "/".join(Path(str(ckpt)).parts[-2:]) if ckpt else "",
    ]
    if with_error:
        cells.append(short_error(row["error"]) if row.get("error") else "")
    return [cell("" if c is None else c) for c in cells]


def markdown_table(rows: list[dict]) -> str:
    """A Markdown table, one line per trial; an "error" column is added when any trial failed."""
    with_error = any(r.get("error") for r in rows)
    header = list(HEADER) + (["error"] if with_error else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_table_row(r, with_error)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _workloads(rows: list[dict]) -> list[str]:
    present = {r.get("workload", "?") for r in rows}
    return [w for w in WORKLOAD_ORDER if w in present] + sorted(present - set(WORKLOAD_ORDER))


def best_per_workload(rows: list[dict], ranking: Ranking | None = None) -> list[str]:
    """One Markdown bullet per workload: its best trial by ``ranking`` (default: highest
    test_accuracy for the MLPs, lowest val_loss for the transformer)."""
    ranking = {**DEFAULT_METRIC, **(ranking or {})}
    lines = []
    for w in _workloads(rows):
        key, mode = ranking.get(w, ("test_accuracy", "max"))
        name, better = key.replace("_", " "), (max if mode == "max" else min)
        scored = [r for r in rows if r.get("workload", "?") == w and finite(r.get(key)) is not None]
        best = better(scored, key=lambda r: finite(r[key])) if scored else None
        lines.append(
            f"- **{w}**: no trial finished with a finite {name}"
            if best is None
            else f"- **{w}**: `{best.get('trial')}`, {name} {finite(best[key]):.4f} ({_describe(best)})"
        )
    return lines


def _describe(row: dict) -> str:
    return f"{row.get('dtype', '?')}, width {row.get('width', '?')}, batch {row.get('global_batch', '?')}"


def markdown_summary(rows: list[dict], ranking: Ranking | None = None) -> str:
    """The whole summary.md: heading, trial counts, table, best trial per workload."""
    failed = sum(1 for r in rows if r.get("error"))
    return "\n".join(
        [
            "# Sweep results",
            "",
            f"{len(rows)} trial(s), {failed} failed. Throughput in examples/s (ex/s, MLPs) or tokens/s "
            "(tok/s, transformer); losses are cross-entropy in nats.",
            "",
            markdown_table(rows),
            "## Best per workload",
            "",
            *best_per_workload(rows, ranking),
            "",
        ]
    )


def _subplots(n: int, title: str):
    fig, axes = plt.subplots(1, max(n, 1), figsize=(5.5 * max(n, 1), 4.3), squeeze=False)
    fig.suptitle(title)
    return fig, list(axes[0])


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)  # sweeps write many reports from one process: do not leak figures


def compact(x: float, _pos=None) -> str:
    """12000 -> "12k", 3500000 -> "3.5M": tick labels that fit side by side."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:g}{suffix}"
    return f"{x:g}"


def _finish(ax, drawn: bool, empty_text: str) -> None:
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, empty_text, ha="center", va="center", transform=ax.transAxes)
        ax.set(xticks=[], yticks=[])  # ticks of an empty 0..1 range would read as data


def _throughput_series(rows: list[dict], workload: str) -> dict[str, list[tuple[float, float]]]:
    """{"dtype, width W": [(global batch, throughput), ...] sorted by batch}, finite points only."""
    series: dict[tuple, list[tuple[float, float]]] = {}
    for r in (r for r in rows if r.get("workload", "?") == workload):
        value, batch = finite(_throughput(r)[0]), finite(r.get("global_batch"))
        if value is not None and batch is not None and batch > 0:  # log axis: batch must be > 0
            series.setdefault((str(r.get("dtype", "?")), str(r.get("width", "?"))), []).append((batch, value))
    return {f"{d}, width {w}": sorted(pts) for (d, w), pts in sorted(series.items())}


def log2_batch_axis(ax, batches: list[float]) -> None:
    """A log2 x axis labelled with exactly the batch sizes that were run."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(batches, [f"{b:g}" for b in batches])


def plot_throughput(rows: list[dict], path: Path) -> None:
    """Writes throughput (examples/s or tokens/s) against global batch on a log2 axis."""
    workloads = _workloads(rows)
    fig, axes = _subplots(len(workloads), "Throughput vs global batch")
    for ax, w in zip(axes, workloads):
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
    if not workloads:
        _finish(axes[0], False, "no trials")
    save_figure(fig, path)


def _curve(history: list[dict], xkey: str) -> list[tuple[float, float]]:
    points = [(finite(p.get(xkey)), finite(p.get("loss"))) for p in history]
    return [(x, y) for x, y in points if x is not None and y is not None]


def plot_loss_curves(rows: list[dict], histories: dict[str, list[dict]], path: Path) -> None:
    """Writes training loss (nats) against examples (MLPs) or tokens (transformer) processed.

    Trials with no history, or whose name is not in ``rows`` (workload unknown), are skipped.
    """
    by_trial = {r.get("trial"): r for r in rows}
    traced = [by_trial[t] for t, h in histories.items() if h and t in by_trial]
    workloads = _workloads(traced)
    fig, axes = _subplots(len(workloads), "Training loss")
    for ax, w in zip(axes, workloads):
        xkey = "tokens" if w == "transformer" else "examples"
        curves = [(r, _curve(histories[r["trial"]], xkey)) for r in traced if r.get("workload", "?") == w]
        for r, points in (c for c in curves if c[1]):
            label = _describe(r) if "dtype" in r else str(r["trial"])
            ax.plot(*zip(*points), marker="." if len(points) < 30 else None, label=label)
        ax.xaxis.set_major_formatter(FuncFormatter(compact))  # token counts reach millions
        ax.set(title=w, xlabel=f"{xkey} processed", ylabel="training loss (cross-entropy, nats)")
        _finish(ax, any(points for _, points in curves), "no finite loss points")
    if not workloads:
        _finish(axes[0], False, "no training history")
    save_figure(fig, path)
