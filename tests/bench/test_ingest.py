"""`python -m jaxray.bench ingest` end to end at a tiny size on real data (a fresh process with its own
local Ray), and its errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray


def bench(*args, data_dir: Path, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RAY_ADDRESS")}
    env.update(JAX_PLATFORMS="cpu", JAXRAY_DATA_DIR=str(data_dir))
    return subprocess.run(
        [sys.executable, "-m", "jaxray.bench", "ingest", *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow  # 150 MLP steps per feed through Ray Data: make test-all
def test_mlp_streamed_and_prestaged_agree(real_dir, tmp_path):
    # Global batch 8192: 7 batches an epoch, so steps 1..8 cross one epoch boundary.
    out = tmp_path / "ingest"
    proc = bench(
        "--workload",
        "mlp",
        "--batch",
        "8192",
        "--warmup",
        "1",
        "--steps",
        "8",
        "--repeats",
        "1",
        "--out",
        out,
        data_dir=real_dir,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "summary.json").read_text())
    assert doc["written_by"] == "jaxray.bench ingest"
    staged, _, streamed, every_epoch = doc["rows"]
    assert [r["feed"] for r in doc["rows"]] == [
        "pre-staged",
        "in memory",
        "ray data",
        "ray data, every epoch",
    ]
    for row in doc["rows"]:
        assert not row.get("error") and row["ms_per_step"] > 0 and row["epoch_boundaries"] == 1
        assert row["final_losses"] == staged["final_losses"]  # the same batches, bit for bit
    assert doc["summary"]["mlp_ratio"] == pytest.approx(streamed["ms_per_step"] / staged["ms_per_step"])
    assert doc["summary"]["mlp_ratio_every_epoch"] == pytest.approx(
        every_epoch["ms_per_step"] / staged["ms_per_step"]
    )
    assert "the final losses differ" not in (out / "summary.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workload", "mlp", "--seq-len", "64"], "--seq-len applies to the transformer only"),
        (
            ["--workload", "mlp", "--parquet", "{ts}"],
            "holds tinyshakespeare, the data of --workload transformer",
        ),
        (["--parquet", "{empty}"], "manifest.json does not exist"),
        (["--steps", "0"], "expected a positive integer"),
    ],
)
def test_bad_input_is_a_clear_error(real_dir, tmp_path, args, message):
    from jaxray.data.prepare import prepare

    ts = tmp_path / "ts"
    if "{ts}" in args:
        prepare("tinyshakespeare", ts, str(real_dir), seq_len=512)
    (tmp_path / "empty").mkdir()
    args = [a.format(ts=ts, empty=tmp_path / "empty") for a in args]
    proc = bench(*args, "--out", "", data_dir=real_dir, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
