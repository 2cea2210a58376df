"""Checkpoints on object storage, end to end: ``python -m jaxray.tune`` with ``storage: s3://...``
(moto's S3-compatible server, started here) stages each checkpoint of a 2-worker trial on the
workers' node and Ray uploads it; the summary names the checkpoints by URI, measures them in the
bucket, and ``generate`` reads the run folder's best one from there. Starts its own local Ray
(RAY_ADDRESS=local). A restart fetching its checkpoint back from the bucket after a lost node:
test_cluster_failures.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from s3_server import s3_server

from jaxray import checkpoint, runs

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "jaxray"
pytestmark = [pytest.mark.ray, pytest.mark.slow]

CONFIG = f"""
experiment: s3
storage: s3://{BUCKET}/runs
data: {{seq_len: 32}}
workers: {{num_workers: 2, devices_per_worker: 1}}
sweeps:
  - workload: transformer
    model: {{num_layers: 1, num_heads: 2, max_seq_len: 32}}
    train: {{steps: 12, log_every: 2, checkpoint_every: 3, eval_every: 6, eval_batches: 2}}
    search_space:
      global_batch: [8]
      width: [32]
"""
TRIAL = "transformer_b8_float32_w32_lr0.0003"


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    return proc


def test_a_sweep_checkpoints_to_s3_and_generates_from_it(real_dir, tmp_path):
    config = tmp_path / "s3.yaml"
    config.write_text(CONFIG)
    with s3_server(BUCKET) as s3:
        env = {**os.environ, "RAY_ADDRESS": "local", "JAXRAY_DATA_DIR": str(real_dir)}
        env["JAXRAY_CACHE_DIR"] = str(tmp_path / "cache")
        tune = run(["jaxray.tune", "--config", str(config), "--out", str(tmp_path / "out")], env)
        out = runs.run_folders(tmp_path / "out")[0]
        prefix = f"{BUCKET}/runs/s3/{out.name}/{TRIAL}"  # <storage>/<experiment>/<run folder>
        assert f"checkpoints: s3://{BUCKET}/runs/s3/{out.name}" in tune.stderr
        [row] = json.loads((out / "summary.json").read_text())
        assert row["restarts"] == 0 and s3.get_file_info(f"{prefix}.attempts.json").size > 0
        assert row["checkpoint"] == f"s3://{prefix}/checkpoint_step_00000012_attempt1"
        assert row["checkpoints_kept"] >= 2 and row["checkpoints_mib"] > 0
        # In the bucket: the checkpoints Ray kept, each whole; none left staged on the node, none in
        # the run folder.
        found = s3.get_file_info(pafs.FileSelector(prefix))
        kept = sorted(Path(i.path).name for i in found if i.type == pafs.FileType.Directory)
        kept = [name for name in kept if name.startswith("checkpoint_")]
        assert "checkpoint_step_00000012_attempt1" in kept and len(kept) == row["checkpoints_kept"]
        assert not list((tmp_path / "cache" / "staging").rglob("checkpoint_*"))
        assert not list(out.glob("train/*/checkpoint_*"))
        # The run folder's best transformer, read from the bucket.
        local = runs.resolve(out)
        assert checkpoint.verify(local)["step"] == 12
        text = run(
            ["jaxray.generate", "--checkpoint", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "16"],
            env,
        ).stdout
        assert text.strip()
