"""End to end: ``python -m jaxray.bench check`` at tiny sizes on a CPU: the preset's sweep under a
private local Ray (Ray Tune + Ray Train, float32 vs bfloat16), then a model step and its profile in
the check's own process; one report (summary.json, summary.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_check_runs_the_sweep_under_ray_then_the_steps_in_process(real_dir, tmp_path):
    out = tmp_path / "check"
    command = [sys.executable, "-m", "jaxray.bench", "check", "--preset", "tiny", "--only", "sweep,tiny_f32"]
    proc = subprocess.run(
        [*command, "--out", str(out)],
        cwd=ROOT,
        env=child_env(JAXRAY_DATA_DIR=str(real_dir), RAY_ADDRESS="local"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    doc = json.loads((out / "summary.json").read_text())
    rows = {r["case"]: r for r in doc["rows"]}
    sweep = {r["dtype"]: r for case, r in rows.items() if case.startswith("sweep ")}
    assert set(sweep) == {"float32", "bfloat16"}, list(rows)
    for row in sweep.values():
        assert row["tokens_per_sec"] > 0 and row["val_loss"] > 0 and row["global_batch"] == 8
        assert "error" not in row
    assert rows["tiny_f32"]["ms_per_step"] > 0 and "error" not in rows["tiny_f32"]
    assert not any(case.startswith("attention") for case in rows)  # --only left it out
    notes = "\n".join(doc["notes"])
    assert "2 trial(s) under Ray Tune and Ray Train" in notes and "profile of tiny_f32" in notes
    assert "| sweep transformer_b8_float32_w32" in (out / "summary.md").read_text()
