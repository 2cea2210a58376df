"""`python -m jaxray.bench checkpoint` end to end at a tiny size on real data (a fresh process), and
its errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench(*args, data_dir: Path, timeout=600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env.update(JAX_PLATFORMS="cpu", JAXRAY_DATA_DIR=str(data_dir))
    return subprocess.run(
        [sys.executable, "-m", "jaxray.bench", "checkpoint", *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow  # a real checkpoint cost run (18 s); CI runs it
def test_sizes_and_cost_rows(real_dir, tmp_path):
    out = tmp_path / "ckpt"
    proc = bench(
        "--workload", "mlp", "--every", "2", "--steps", "5", "--repeats", "1", "--out", out, data_dir=real_dir
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "summary.json").read_text())
    mlp_size, lm_size, none, every = doc["rows"]
    assert mlp_size["params"] == 235_146 and lm_size["params"] == 3_356_160
    # params + two Adam moments in float32 (Orbax's storage compresses a little), and metadata
    megabytes = 3 * 4 * lm_size["params"] / 1e6
    assert 0.75 * megabytes <= lm_size["size_mb"] <= 1.2 * megabytes
    assert all(r["save_s"] > 0 and r["restore_s"] > 0 for r in (mlp_size, lm_size))
    assert (none["every"], every["every"]) == ("none", 2) and none["vs_none"] == 1.0
    assert doc["summary"]["mlp_every_2"] == pytest.approx(every["ms_per_step"] / none["ms_per_step"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--every", "0"], "expected a positive integer"),
        (["--workload", "cnn"], "invalid choice: 'cnn'"),
    ],
)
def test_bad_input_is_a_clear_error(real_dir, args, message):
    proc = bench(*args, "--out", "", data_dir=real_dir, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
