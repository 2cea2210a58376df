"""The table columns benchmarks show, keyed by the summary.json row field they read.

A benchmark names its columns by field (``columns("case params size_mb")``); the header and
the format spec come from ``FIELDS``, so one field reads the same in every table. A column that
needs another header or format (or computes its cell) is written out as a ``Column`` tuple.
"""

from __future__ import annotations

from typing import Any

from jaxray.reporting.format import fmt

# (header, row key, format spec); a callable key computes the cell from the row.
Column = tuple[str, Any, str]

# row field -> (header, format spec for ``format``; "" prints the value as it is)
FIELDS: dict[str, tuple[str, str]] = {
    # what a case is
    "case": ("case", ""),
    "workload": ("workload", ""),
    "feed": ("feed", ""),
    "impl": ("impl", ""),
    "pair": ("pair", ""),
    "sampler": ("sampler", ""),
    "attention": ("ran", ""),
    "dtype": ("dtype", ""),
    "devices": ("devices", ""),
    "global_batch": ("global batch", ""),
    "per_device_batch": ("per-device batch", ""),
    "batch": ("batch", ""),
    "width": ("width", ""),
    "steps": ("steps", ""),
    "every": ("every", ""),
    "new_tokens": ("new tokens", ""),
    "params": ("params", ",.0f"),
    # speed
    "ms_per_step": ("ms/step", ".2f"),
    "achieved_tflops": ("TFLOP/s", ".3f"),
    "mfu": ("MFU", ".1%"),
    "compile_s": ("compile s", ".1f"),
    "tokens_per_sec": ("tokens/s", ",.0f"),
    "ms_per_token": ("ms/token", ".2f"),
    "input_wait_ms_per_step": ("input wait ms/step", ".2f"),
    "epoch_boundaries": ("epoch ends timed", ""),
    "save_s": ("save s", ".3f"),
    "restore_s": ("restore s", ".3f"),
    "restore_unverified_s": ("restore s, no verify", ".3f"),
    "size_mb": ("size MB", ".1f"),
    # ratios
    "speedup_vs_1": ("speedup", ".2f"),
    "scaling_efficiency": ("efficiency", ".0%"),
    "speed_vs_jit": ("vs jit", ".2f"),
    "ratio_vs_reference": ("ratio", ".3f"),
    "vs_none": ("x no checkpoints", ".3f"),
    "vs_prestaged": ("x pre-staged", ".3f"),
    "vs_full": ("x full recompute", ".1f"),
    "vs_notebook": ("x notebook", ".1f"),
    # quality and agreement
    "final_loss": ("final loss", ".6f"),
    "test_accuracy": ("test acc", ".4f"),
    "val_loss": ("val loss", ".4f"),
    "val_perplexity": ("val ppl", ".2f"),
    "max_param_abs_diff": ("max param diff", ".1e"),
    # serving under load
    "clients": ("clients", ""),
    "requests": ("requests", ""),
    "rps": ("req/s", ".2f"),
    "new_tokens_per_s": ("new tok/s", ",.1f"),
    "p50_ms": ("p50 ms", ",.0f"),
    "p95_ms": ("p95 ms", ",.0f"),
    "p99_ms": ("p99 ms", ",.0f"),
    "errors_4xx": ("4xx", ""),
    "errors_5xx": ("5xx", ""),
    "dropped": ("dropped", ""),
    "decode_calls": ("decode calls", ""),
    "mean_rows": ("mean rows", ".1f"),
    "replica_cpu_pct": ("replica CPU %", ".0f"),
    "server_cpu_pct": ("server CPU %", ".0f"),
    "client_cpu_pct": ("client CPU %", ".0f"),
}


def _throughput_cell(row: dict) -> str:
    if row.get("tokens_per_sec") is not None:
        return f"{fmt(row['tokens_per_sec'], ',.0f')} tok/s"
    if row.get("examples_per_sec") is not None:
        return f"{fmt(row['examples_per_sec'], ',.0f')} ex/s"
    return ""


THROUGHPUT: Column = ("throughput", _throughput_cell, "")


def columns(*specs: str | Column) -> list[Column]:
    """The ``Column``s for ``specs``, in order: a string names row fields of ``FIELDS``, separated by
    whitespace (as ``collections.namedtuple`` takes field names); a ``Column`` tuple is kept as it is.
    Raises KeyError naming a field ``FIELDS`` does not know (a typo in a benchmark's table)."""
    out = []
    for spec in specs:
        if isinstance(spec, tuple):
            out.append(spec)
            continue
        for name in spec.split():
            if name not in FIELDS:
                raise KeyError(f"no column for row field {name!r}; add it to jaxray.bench.columns.FIELDS")
            header, fmt_spec = FIELDS[name]
            out.append((header, name, fmt_spec))
    return out


# The speed columns most suites end with.
COMMON_COLUMNS: list[Column] = [THROUGHPUT, *columns("ms_per_step achieved_tflops mfu")]
