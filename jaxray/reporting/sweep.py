"""The report a Tune sweep leaves in its run folder: summary.json (one object per trial, KEY_ORDER
keys first, NaN/inf -> null, checkpoint paths relative), summary.md, throughput_vs_batch.png and
loss_curves.png (``jaxray.reporting.figures``).

Units: throughput in examples/s or tokens/s, ``ms_per_step`` in ms, ``compile_s`` in s,
``peak_bytes_per_device`` in bytes (shown in MiB), losses in nats, perplexity = exp(val_loss)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from jaxray.reporting.figures import plot_loss_curves, plot_throughput
from jaxray.reporting.format import (
    cell,
    describe,
    finite,
    fmt,
    json_safe,
    mib,
    short_error,
    throughput,
    workloads,
)
from jaxray.runs import (
    FILES,
    LOSS_PLOT,
    SUMMARY_JSON,
    SUMMARY_MD,
    THROUGHPUT_PLOT,
    Ranking,
    best_trial,
    ranking_metric,
    record_path,
)
from jaxray.storage import written_whole

KEY_ORDER = tuple(
    "trial workload global_batch dtype width learning_rate attention attention_note steps devices mesh "
    "examples_per_sec tokens_per_sec ms_per_step compile_s peak_bytes_per_device final_train_loss "
    "test_accuracy val_loss val_perplexity best_step final_val_loss checkpoint".split()
)
HEADER = tuple(
    "trial|workload|global batch|dtype|width|peak lr|attention|steps|devices|mesh|throughput|ms/step|"
    "compile s|peak MiB/device|final train loss|test acc|val loss|val ppl|checkpoint".split("|")
)


def write_reports(
    out_dir: str | Path, rows: list[dict], histories: dict[str, list[dict]], ranking: Ranking | None = None
) -> dict[str, Path]:
    """Writes the four files under out_dir, each whole or not at all; returns {file name: path}.
    ``histories``: trial name -> logged rows (``step``, ``examples``, ``loss``, ``tokens``).
    ``ranking``: workload -> (metric, "min"|"max") (default ``DEFAULT_METRIC``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in FILES}
    recorded = [
        {**r, "checkpoint": record_path(out, r["checkpoint"])} if r.get("checkpoint") else r for r in rows
    ]
    # allow_nan=False: a NaN that slipped past json_safe fails here, not in the reader's parser
    summary = json.dumps([json_safe(ordered_row(r)) for r in recorded], indent=2, allow_nan=False) + "\n"
    writers = {
        SUMMARY_JSON: lambda tmp: tmp.write_text(summary),
        SUMMARY_MD: lambda tmp: tmp.write_text(markdown_summary(rows, ranking)),
        THROUGHPUT_PLOT: lambda tmp: plot_throughput(rows, tmp),
        LOSS_PLOT: lambda tmp: plot_loss_curves(rows, histories, tmp),
    }
    for name, write in writers.items():
        with written_whole(paths[name]) as tmp:
            write(tmp)
    return paths


def ordered_row(row: dict) -> dict:
    """The row with the KEY_ORDER keys first (those present), then the others as they came."""
    first = {k: row[k] for k in KEY_ORDER if k in row}
    return first | {k: v for k, v in row.items() if k not in first}


def attention(row: dict) -> str:
    """The attention cell: the implementation a transformer trial used and why ("xla (auto: cuDNN
    attention needs an NVIDIA GPU, this device is cpu)"); empty for the MLPs."""
    if not row.get("attention"):
        return ""
    note = row.get("attention_note")
    return f"{row['attention']} ({note})" if note else str(row["attention"])


def _table_row(row: dict, with_error: bool) -> list[str]:
    value, unit = throughput(row)
    ckpt = row.get("checkpoint")
    stopped_val = row.get("stopped_value") if row.get("stopped_metric") == "val_loss" else None
    # its perplexity as evaluation's, exp(val loss); none past exp's float range (or NaN)
    stopped_ppl = math.exp(v) if (v := finite(stopped_val)) is not None and v < 700 else None
    cells = [
        row.get("trial", ""),
        row.get("workload", ""),
        row.get("global_batch", ""),
        row.get("dtype", ""),
        row.get("width", ""),
        fmt(row.get("learning_rate"), ".2g"),
        attention(row),
        row.get("steps", "") if "stopped_at_step" not in row else f"{row['stopped_at_step']} (stopped early)",
        row.get("devices", ""),
        row.get("mesh", ""),
        "" if value is None else f"{fmt(value, ',.0f')} {unit}",
        fmt(row.get("ms_per_step"), ".2f"),
        fmt(row.get("compile_s"), ".1f"),
        fmt(mib(row.get("peak_bytes_per_device")), ",.1f"),
        fmt(row.get("final_train_loss"), ".4f"),
        fmt(row.get("test_accuracy"), ".4f"),
        fmt(row.get("val_loss", stopped_val), ".4f"),
        fmt(row.get("val_perplexity", stopped_ppl), ".2f"),
        "/".join(Path(str(ckpt)).parts[-2:]) if ckpt else "",  # trial run folder / checkpoint
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


def best_per_workload(rows: list[dict], ranking: Ranking | None = None) -> list[str]:
    """One Markdown bullet per workload: its best trial by ``ranking`` (``jaxray.runs.best_trial``)."""
    lines = []
    for w in workloads(rows):
        key = ranking_metric(w, ranking)[0]
        name, best = key.replace("_", " "), best_trial(rows, w, ranking)
        lines.append(
            f"- **{w}**: no trial finished with a finite {name}"
            if best is None
            else f"- **{w}**: `{best.get('trial')}`, {name} {float(best[key]):.4f} ({describe(best)})"
        )
    return lines


# The sweep axes (jaxray.config.experiment.SEARCHABLE) and their names in summary.md.
AXES = {"global_batch": "global batch", "dtype": "dtype", "width": "width", "learning_rate": "peak lr"}


def axis_effects(rows: list[dict], ranking: Ranking | None = None) -> list[str]:
    """A Markdown table of each swept axis (two or more values in a workload): per value, how many
    trials ran it, the best ranking metric among them (``best_trial``) and their median throughput.
    Empty when no axis was swept."""
    lines = []
    for w in workloads(rows):
        trials = [r for r in rows if r.get("workload", "?") == w]
        for key, label in AXES.items():
            values = {r[key] for r in trials if r.get(key) is not None}
            for value in sorted(values, key=lambda v: (isinstance(v, str), v)) if len(values) > 1 else ():
                cells = _effect(w, label, value, [r for r in trials if r.get(key) == value], ranking)
                lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    if not lines:
        return []
    header = "| workload | axis | value | trials | best | median throughput |"
    return [header, "|---|---|---|---|---|---|", *lines]


def _effect(workload: str, label: str, value, trials: list[dict], ranking: Ranking | None) -> list:
    """One row of ``axis_effects``: the trials of ``workload`` run at ``value`` of the axis ``label``."""
    metric = ranking_metric(workload, ranking)[0]
    best = best_trial(trials, workload, ranking)
    speeds = [v for v, _ in map(throughput, trials) if finite(v) is not None]
    return [
        workload,
        label,
        repr(value) if isinstance(value, float) else value,  # a rate as trial names write it
        len(trials),
        f"{float(best[metric]):.4f} ({best['trial']})" if best else _no_best(trials),
        f"{statistics.median(speeds):,.0f} {throughput(trials[0])[1]}" if speeds else "",
    ]


def _no_best(trials: list[dict]) -> str:
    """The "best" cell of trials none of which has a finite ranking metric: why."""
    stopped = [r["stopped_at_step"] for r in trials if "stopped_at_step" in r]
    if len(stopped) == len(trials):
        return f"stopped early (step {', '.join(map(str, stopped))})"
    return "none finite"


def markdown_summary(rows: list[dict], ranking: Ranking | None = None) -> str:
    """summary.md: heading, trial counts, table, best trial per workload, effect of each swept axis."""
    failed = sum(1 for r in rows if r.get("error"))
    stopped = [r for r in rows if "stopped_at_step" in r]
    return "\n".join(
        [
            "# Sweep results",
            "",
            f"{len(rows)} trial(s), {failed} failed{stopped_early(stopped)}{restarted(rows)}. "
            "Throughput in examples/s (ex/s, MLPs) or tokens/s (tok/s, transformer); losses are "
            "cross-entropy in nats.",
            "",
            markdown_table(rows),
            "## Best per workload",
            "",
            *best_per_workload(rows, ranking),
            "",
            *effects_section(rows, ranking),
        ]
    )


def restarted(rows: list[dict]) -> str:
    """ ", 1 restarted (transformer_...: node lost, resumed from step 100)" for the rows whose worker
    group restarted (``restarts``, ``restart_causes``, ``resumed_from_step``); "" when none."""
    again = [r for r in rows if r.get("restarts")]
    if not again:
        return ""
    each = "; ".join(
        f"{r.get('trial')}: {r.get('restart_causes') or 'restarted'}, "
        f"resumed from step {r.get('resumed_from_step', 0)}"
        for r in again
    )
    return f", {len(again)} restarted ({each})"


def stopped_early(rows: list[dict]) -> str:
    """ ", 1 stopped early by ASHA (transformer_..._lr0.003 at step 500: val_loss 2.0586)" for the rows
    a sweep's scheduler stopped (``stopped_at_step``); "" when none."""
    if not rows:
        return ""
    each = "; ".join(
        f"{r.get('trial')} at step {r['stopped_at_step']}: {r.get('stopped_metric')} "
        f"{fmt(r.get('stopped_value'), '.4f') or '?'}"
        for r in rows
    )
    return f", {len(rows)} stopped early by ASHA ({each})"


def effects_section(rows: list[dict], ranking: Ranking | None = None) -> list[str]:
    """summary.md's "Effect of each axis" section, or nothing without a swept axis."""
    table = axis_effects(rows, ranking)
    if not table:
        return []
    metrics = ", ".join(f"{w}: {ranking_metric(w, ranking)[0].replace('_', ' ')}" for w in workloads(rows))
    return ["## Effect of each axis", "", f"Best among the trials at each value ({metrics}).", "", *table, ""]
