"""What every benchmark leaves under ``--out`` (default ``runs/bench/<name>/``): summary.json
({"written_by", "benchmark", "title", "summary", "notes", "rows"}, a row per case), summary.md (the
title, the Markdown table, also printed, and the notes) and its charts (*.png, matplotlib, headless)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from tqdm import tqdm

from jaxray.reporting.figures import log2_batch_axis, save_figure
from jaxray.reporting.format import cell, finite, json_safe, number, short_error, throughput

WRITER = "jaxray.bench"  # summary.json's written_by is "jaxray.bench <name>"
HEADERS = {
    "global_batch": "global batch", "per_device_batch": "per-device batch", "attention": "ran",
    "tokens_per_sec": "tokens/s", "examples_per_sec": "examples/s", "ms_per_step": "ms/step",
    "achieved_tflops": "TFLOP/s", "mfu": "MFU", "speedup_vs_1": "speedup", "speed_vs_jit": "x jit",
    "scaling_efficiency": "efficiency", "max_param_abs_diff": "max param diff", "rps": "req/s",
    "new_tokens_per_s": "new tok/s", "ratio_vs_reference": "x reference", "vs_none": "x no checkpoints",
    "vs_prestaged": "x pre-staged", "vs_full": "x full recompute", "vs_notebook": "x notebook",
    "input_wait_ms_per_step": "input wait ms/step", "epoch_boundaries": "epoch ends timed",
    "ttft_p50_ms": "TTFT p50 ms", "ttft_p99_ms": "TTFT p99 ms",
}  # fmt: skip
SPEED = "tokens_per_sec examples_per_sec ms_per_step achieved_tflops mfu"


@dataclass
class Report:
    """Rows, the keys shown as columns (space-separated), notes, charts {file: draw(rows, path)}, summary."""

    name: str
    title: str
    rows: list[dict[str, Any]]
    columns: str
    notes: list[str] = field(default_factory=list)
    charts: dict[str, Callable[[list[dict], Path], None]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("error")]


def run_cases(cases: list[tuple[dict, Callable[[], dict]]], desc: str) -> list[dict[str, Any]]:
    """Each (fields, run) as a row ``{**fields, **run()}``; one that raises is a row with ``error``."""
    rows = []
    for fields, run in tqdm(cases, desc=desc, unit="case", file=sys.stderr, dynamic_ncols=True):
        try:
            rows.append({**fields, **run()})
        except Exception as err:  # noqa: BLE001 - every failure is reported in its row
            rows.append({**fields, "error": f"{type(err).__name__}: {err}"})
    return rows


def ratio(a: dict | None, b: dict | None, key: str | None = None) -> float | None:
    """a's over b's ``key`` (default: tokens/s where a has it, else examples/s)."""
    if not a or not b:
        return None
    key = key or ("tokens_per_sec" if a.get("tokens_per_sec") is not None else "examples_per_sec")
    x, y = finite(a.get(key)), finite(b.get(key))
    return x / y if x and y else None


def text(v: Any) -> str:
    """A table cell: ints with thousands separators, floats to 3-4 significant digits."""
    n = number(v)
    if n is None or isinstance(v, (str, bool)):
        return "" if v is None else str(v)
    if isinstance(v, int) or abs(n) >= 1000:
        return f"{n:,.0f}"
    return f"{n:.4g}" if n == 0 or abs(n) >= 1e-3 else f"{n:.1e}"


def render(report: Report) -> str:
    """The Markdown text: title, table (a note column when a row was skipped or failed), notes."""
    extra = any(r.get("error") or r.get("skipped") for r in report.rows)
    columns = report.columns.split()
    header = [HEADERS.get(c, c.replace("_", " ")) for c in columns] + (["note"] if extra else [])
    lines = [f"# {report.title}", "", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for r in report.rows:
        cells = [text(r.get(c)) for c in columns]
        if extra:
            cells.append(r.get("skipped") or short_error(r.get("error") or "", 200))
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    notes = list(report.notes)
    if any("mfu" in r for r in report.rows) and all(r.get("mfu") is None for r in report.rows):
        notes.append("MFU is blank: no peak FLOP/s is known for this device (jaxray.bench.mfu.PEAK_TFLOPS).")
    return "\n".join([*lines, "", *(f"- {n}" for n in notes), ""])


def write_report(report: Report, out: Path | None, echo: bool = True) -> None:
    """summary.json, summary.md and the charts under ``out`` (None: none); prints the text when ``echo``.
    RuntimeError, and nothing written, when no case was measured."""
    if all(r.get("error") or r.get("skipped") for r in report.rows):
        print(render(report))
        first = next((r.get("error") or r.get("skipped") for r in report.rows), "no cases")
        raise RuntimeError(f"no case of {report.name} could be measured; {out} is as it was (first: {first})")
    if echo:
        print(render(report))
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    doc = {"written_by": f"{WRITER} {report.name}", "benchmark": report.name, "title": report.title}
    doc |= {"summary": report.summary, "notes": report.notes, "rows": report.rows}
    (out / "summary.json").write_text(json.dumps(json_safe(doc), indent=2, allow_nan=False) + "\n")
    (out / "summary.md").write_text(render(report))
    for name, draw in report.charts.items():
        draw(report.rows, out / name)
    if echo:
        print(f"written: {out}/summary.json, summary.md{''.join(', ' + n for n in report.charts)}")


def bar_chart(rows: list[dict], path: Path, label: str = "case", title: str = "") -> None:
    """A bar of throughput per row, one panel per unit; rows without a figure show as "n/a"."""
    units = sorted({throughput(r)[1] for r in rows}) or ["ex/s"]
    fig, axes = plt.subplots(1, len(units), figsize=(5.5 * len(units), 4), squeeze=False)
    for ax, unit in zip(axes[0], units):
        picked = [r for r in rows if throughput(r)[1] == unit]
        values = [finite(throughput(r)[0]) or 0.0 for r in picked]
        ax.bar([str(r.get(label)) for r in picked], values)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:,.0f}" if v else "n/a", ha="center", va="bottom", fontsize=8)
        ax.set(ylabel=unit, title=title)
        ax.tick_params(axis="x", rotation=20)
    save_figure(fig, path)


def line_chart(path: Path, series: dict[str, tuple[list, list]], xlabel: str, ylabel: str, log2x=False):
    """One line per {label: (xs, ys)}; ``log2x`` labels exactly the x values run."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, label=label)
        if log2x and xs:
            log2_batch_axis(ax, list(xs))
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize="small")
    save_figure(fig, path)


def curve(rows: list[dict], x: str, y: str) -> tuple[list, list]:
    """(xs, ys) of the rows where ``y`` is a finite number, sorted by ``x``."""
    points = sorted((r[x], finite(r.get(y))) for r in rows if finite(r.get(y)) is not None)
    return [p[0] for p in points], [p[1] for p in points]
