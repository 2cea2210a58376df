"""jaxray.reporting.format: values as report text and JSON (shared by sweeps, benchmarks, evaluation)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from jaxray.reporting.format import (
    cell,
    describe,
    finite,
    fmt,
    json_safe,
    mib,
    number,
    short_error,
    throughput,
    workloads,
)


def test_json_safe_turns_non_finite_into_null_and_numpy_into_python():
    doc = {"a": float("nan"), 1: [np.float32(1.5), np.arange(3), (float("inf"), None)], "p": Path("/x")}
    safe = json_safe(doc)
    assert safe == {"a": None, "1": [1.5, [0, 1, 2], [None, None]], "p": "/x"}
    json.dumps(safe, allow_nan=False)


def test_numbers_finite_and_fmt():
    assert number("3") is None and number(True) is None and number(None) is None
    assert math.isnan(number(float("nan"))) and number(np.int64(4)) == 4.0
    assert finite(float("inf")) is None and finite(2) == 2.0
    assert fmt(1234.5, ",.0f") == "1,234" and fmt(None, ".2f") == "" and fmt(float("nan"), ".2f") == "nan"
    assert mib(3 * 2**20) == 3.0 and mib("x") is None


def test_cells_and_errors_fit_one_table_line():
    assert cell(" a|b\nc ") == "a\\|b c"
    assert short_error("RuntimeError: boom\n  Traceback ...") == "RuntimeError: boom"
    long = short_error("x" * 100, limit=10)
    assert len(long) == 10 and long.endswith("…")


def test_trial_rows_in_words():
    assert throughput({"workload": "transformer", "tokens_per_sec": 10.0}) == (10.0, "tok/s")
    assert throughput({"workload": "mlp", "examples_per_sec": 5}) == (5.0, "ex/s")
    assert workloads([{"workload": "transformer"}, {"workload": "zeta"}, {}, {"workload": "mlp"}]) == [
        "mlp",
        "transformer",
        "?",
        "zeta",
    ]
    point = {"dtype": "bfloat16", "width": 64, "global_batch": 128, "learning_rate": 0.003}
    assert describe(point) == "bfloat16, width 64, batch 128, peak lr 0.003"
