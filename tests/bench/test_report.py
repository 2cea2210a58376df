"""The bench report (tables, files, charts), the clock's call order and the preset sizes."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import pytest

from jaxray.bench.presets import PRESETS
from jaxray.bench.report import Report, bar_chart, line_chart, render, run_cases, text, write_report
from jaxray.bench.throughput import environment, time_calls


def test_cells_format_numbers_by_size():
    assert [text(None), text(235146), text(12345.6), text(1.23456), text(0.0001234), text("x")] == [
        "", "235,146", "12,346", "1.235", "1.2e-04", "x"
    ]  # fmt: skip


def test_render_names_columns_by_field_and_adds_a_note_column_for_failures():
    rows = run_cases(
        [({"case": "a"}, lambda: {"ms_per_step": 2.5, "mfu": None}), ({"case": "b"}, lambda: 1 / 0)], "t"
    )
    table = render(Report("t", "Title", rows, "case ms_per_step mfu", ["a note"]))
    assert table.startswith("# Title") and "| case | ms/step | MFU | note |" in table
    assert "| a | 2.5 |  |  |" in table and "ZeroDivisionError" in table and "- a note" in table
    assert "MFU is blank" in table


def test_write_report_writes_json_markdown_and_charts(tmp_path):
    rows = [{"case": "x", "workload": "mlp", "examples_per_sec": 10.0, "global_batch": 2}]
    rows += [{"case": "y", "workload": "transformer", "tokens_per_sec": float("nan"), "global_batch": 4}]
    charts = {
        "bars.png": bar_chart,
        "line.png": lambda r, p: line_chart(p, {"a": ([2, 4], [1, 2])}, "x", "y", True),
    }
    write_report(
        Report("demo", "Demo", rows, "case global_batch", summary={"k": 1}, charts=charts), tmp_path, False
    )
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["written_by"] == "jaxray.bench demo" and doc["summary"] == {"k": 1}
    assert doc["rows"][1]["tokens_per_sec"] is None  # NaN is null in JSON
    assert (tmp_path / "bars.png").stat().st_size > 0 and (tmp_path / "line.png").stat().st_size > 0


def test_time_calls_runs_warmup_then_each_window():
    seen = []
    median, windows = time_calls(lambda i: seen.append(i) or jnp.ones(3) * i, calls=4, repeats=3, warmup=2)
    assert seen == [0, 1] + [0, 1, 2, 3] * 3 and len(windows) == 3 and median == sorted(windows)[1]
    with pytest.raises(ValueError, match="calls and repeats"):
        time_calls(lambda i: None, 0, 1)
    assert environment(1)["platform"] == "cpu" and environment(1)["jaxlib"]


def test_presets_yaml_gives_every_preset_its_sizes_with_shared_shapes_merged():
    assert set(PRESETS) == {"cpu", "gpu", "tiny"}
    for preset in PRESETS.values():
        assert all(size["workload"] for size in [preset.dispatch, *preset.precision, *preset.devices])
        assert dataclasses.asdict(preset)["sweep_batches"]
    lm = {"workload": "transformer", "width": 128, "seq_len": 128, "max_seq_len": 128}
    assert PRESETS["cpu"].precision[-1] == lm | {"global_batch": 16, "steps": 4, "repeats": 5}
