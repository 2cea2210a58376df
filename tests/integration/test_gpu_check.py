"""End to end: ``bash scripts/gpu-check.sh --cpu`` (the GPU check's steps at tiny sizes: doctor, the
benchmarks, a real Tune sweep, the Serve app under load, pytest) passes on a CPU and writes both
reports. It starts its own local Ray twice (RAY_ADDRESS=local) and takes about 4 minutes on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = [
    "doctor",
    "precision",
    "tune",
    "serve",
    "compile-float32",
    "compile-bfloat16",
    "pytest-gpu",
    "decode",
    "pytest",
    "attention",
    "batch-sweep",
    "throughput-gpt2",
]
pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_gpu_check_runs_end_to_end_on_cpu(real_dir, tmp_path):
    out = tmp_path / "gpucheck"
    env = {**os.environ, "JAXRAY_DATA_DIR": str(real_dir)}
    proc = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--cpu", "--work", str(tmp_path / "work"), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, (proc.stdout[-5000:], proc.stderr[-3000:])

    doc = json.loads((out / "gpu-check.json").read_text())
    assert doc["result"] == "passed" and doc["environment"]["mode"] == "cpu"
    steps = {s["name"]: s for s in doc["steps"]}
    assert list(steps) == STEPS
    for name, step in steps.items():
        assert step["status"] == "ran" and step["exit_code"] == 0, (name, step)
        assert (out / step["log"]).is_file() and step["seconds"] >= 0 and step["command"]
    # Figures were parsed from each step's output, not only exit codes.
    assert steps["doctor"]["figures"]["backend"] == "cpu"
    assert set(steps["precision"]["figures"]["bf16_vs_fp32"]) == {"mlp", "transformer"}
    tune = steps["tune"]["figures"]
    assert (
        tune["trials"]["float32"]["tokens_per_sec"] > 0 and tune["trials"]["bfloat16"]["tokens_per_sec"] > 0
    )
    assert tune["bf16_vs_fp32"] > 0 and tune["gpu_uuids"] == [] and len(tune["worker_lines"]) >= 2
    assert tune["trials"]["float32"]["compile_json"]["peak_bytes"] > 0
    assert steps["serve"]["figures"]["ratio_16_vs_1"] > 0 and steps["serve"]["figures"]["errors_5xx"] == 0
    for dtype in ("float32", "bfloat16"):
        assert steps[f"compile-{dtype}"]["figures"]["peak_bytes"] > 0
    assert steps["pytest"]["figures"]["passed"] > 0 and steps["pytest-gpu"]["figures"].get("skipped", 0) >= 1
    assert steps["throughput-gpt2"]["figures"]["tokens_per_sec"] > 0
    assert {b["verdict"] for b in doc["bars"]} == {"n/a on CPU"}

    md = (out / "gpu-check.md").read_text()
    assert md.startswith("# GPU check (cpu run") and all(f"| {name} | passed | 0 |" in md for name in STEPS)
    # OUTDIR stays shallow (the sweep's checkpoints are in --work) and its file names are plain.
    for path in out.rglob("*"):
        rel = path.relative_to(out)
        assert len(rel.parts) <= 2, rel
        assert all(c.isalnum() or c in "._-" for c in path.name), rel
