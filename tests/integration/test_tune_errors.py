"""Mistakes that only show once Ray is up still end with a clear error and exit code 2, never a hang."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
GPU = """
experiment: gpu
workers: {accelerator: gpu}
sweeps:
  - workload: mlp
    train: {steps: 4}
    search_space: {global_batch: [8]}
"""


@pytest.mark.slow  # a private Ray start (14 s); CI runs it
def test_gpu_workers_without_gpus_is_an_error_not_a_hang(real_dir, tmp_path):
    config = tmp_path / "gpu.yaml"
    config.write_text(GPU)
    env = {**os.environ, "RAY_ADDRESS": "local", "JAXRAY_DATA_DIR": str(real_dir)}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxray.tune", "--config", str(config), "--out", str(tmp_path / "o")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        "workers.accelerator is gpu and each worker needs 1 GPU(s), but the Ray cluster has 0" in proc.stderr
    )


def test_missing_data_dir_is_an_error(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxray.tune",
            "--config",
            "tune_configs/smoke.yaml",
            "--data-dir",
            str(tmp_path / "nope"),
            "--out",
            str(tmp_path / "o"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "data.data_dir" in proc.stderr and "is not a directory" in proc.stderr
    assert not (tmp_path / "o").exists()
