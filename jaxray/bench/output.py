"""What every benchmark leaves behind, and the progress bar while it runs.

Under ``out`` (default ``runs/bench/<name>/``):

    summary.json   {"written_by", "benchmark", "title", "summary", "notes", "rows"}: one row per measured (or
                   skipped, or failed) case, with the environment every row records
    summary.md     the title, the table and the notes
    *.png          the benchmark's charts

The same table and notes are printed to the terminal.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from jaxray.bench.columns import Column
from jaxray.reporting.format import cell, finite, fmt, json_safe, short_error

# summary.json's "written_by" is "jaxray.bench <name>": a folder is only ever overwritten by the same
# benchmark (runs.check_overwrite), never by another benchmark, a sweep or an evaluation.
WRITER = "jaxray.bench"


@dataclass
class Case:
    """One row to produce: ``label`` shows in the progress bar; ``fields`` describe the case (they
    are kept in the row if ``run`` raises); ``run() -> row``."""

    label: str
    fields: dict[str, Any]
    run: Callable[[], dict[str, Any]]


@dataclass
class Report:
    """A benchmark's rows, how to tabulate them, notes for the reader, chart writers
    ``{file name: draw(rows, path)}`` and the headline figures (``summary``, e.g. a median ratio)."""

    name: str
    title: str
    rows: list[dict[str, Any]]
    columns: list[Column]
    notes: list[str] = field(default_factory=list)
    charts: dict[str, Callable[[list[dict], Path], None]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("error")]


def run_cases(cases: list[Case], desc: str) -> list[dict[str, Any]]:
    """Run every case under a progress bar. A case that raises becomes a row with ``error`` (the
    exception's type and message; tables show its first line) and the run goes on: one bad size
    does not lose the others."""
    rows = []
    for case in tqdm(cases, desc=desc, unit="case", file=sys.stderr, dynamic_ncols=True):
        try:
            rows.append({**case.fields, **case.run()})
        except Exception as err:  # noqa: BLE001 - every failure is reported in its row
            rows.append({**case.fields, "error": f"{type(err).__name__}: {err}"})
    return rows


def _value(row: dict, key: Any, spec: str) -> str:
    value = key(row) if callable(key) else row.get(key)
    if value is None:
        return ""
    if spec and not isinstance(value, str):
        return fmt(value, spec)
    return str(value)


def markdown_table(rows: list[dict], columns: list[Column]) -> str:
    """One line per row; a "note" column is added when any row was skipped or failed."""
    extra = any(r.get("error") or r.get("skipped") for r in rows)
    header = [c[0] for c in columns] + (["note"] if extra else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        cells = [_value(r, key, spec) for _, key, spec in columns]
        if extra:
            cells.append(r.get("skipped") or short_error(r.get("error") or "", 200))
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def render(report: Report) -> str:
    """The Markdown text of ``report``: title, table, notes."""
    notes = [f"- {n}" for n in report.notes]
    measured = [r for r in report.rows if "mfu" in r]
    if measured and all(r["mfu"] is None for r in measured):
        notes.append(
            f"- MFU is blank: no peak FLOP/s is known for device kind {measured[0].get('device_kind')!r} "
            f"(jaxray.bench.mfu.PEAK_TFLOPS covers L4, A100, H100, H200); TFLOP/s is achieved model FLOPs."
        )
    return "\n".join([f"# {report.title}", "", markdown_table(report.rows, report.columns), *notes, ""])


def write_report(report: Report, out: Path, echo: bool = True) -> dict[str, Path]:
    """Write summary.json, summary.md and the charts under ``out``; print the Markdown when ``echo``.
    Returns {file name: path}."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"summary.json": out / "summary.json", "summary.md": out / "summary.md"}
    doc = {
        "written_by": f"{WRITER} {report.name}",
        "benchmark": report.name,
        "title": report.title,
        "summary": report.summary,
        "notes": report.notes,
        "rows": report.rows,
    }
    paths["summary.json"].write_text(json.dumps(json_safe(doc), indent=2, allow_nan=False) + "\n")
    text = render(report)
    paths["summary.md"].write_text(text)
    for name, draw in report.charts.items():
        paths[name] = out / name
        draw(report.rows, paths[name])
    if echo:
        print(text)
        print(f"written: {', '.join(str(p) for p in paths.values())}")
    return paths


def row_value(row: dict, key: str) -> float | None:
    """A finite float from ``row[key]``, else None (skipped and failed rows have none)."""
    return finite(row.get(key))
