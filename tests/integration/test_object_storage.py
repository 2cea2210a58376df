"""Checkpoints on object storage, end to end: ``python -m jaxray.tune`` with ``storage: s3://...``
(moto's S3-compatible server, started here) stages each checkpoint of a 2-worker trial on the
workers' node and Ray uploads it. The run is interrupted (Ctrl+C) once a checkpoint is in the
bucket and continued with ``--resume`` from there; the summary names the checkpoints by URI and
measures them in the bucket, and ``python -m jaxray.serve`` serves the run folder's best one over
HTTP, then stops with SIGTERM (kill, docker stop) as with Ctrl-C: exit 0 within 10 s, its Ray
gone. Starts its own local Rays (RAY_ADDRESS=local). A restart fetching its checkpoint back from
the bucket after a lost node: test_cluster_failures.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import faults
import pyarrow.fs as pafs
import pytest
import requests
from private_ray import free_port
from s3_server import s3_server
from serve_load import start_serving, stopped_by

from jaxray import checkpoint, runs
from jaxray.config.experiment import load_experiment

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
    train: {{steps: 12, log_every: 2, checkpoint_every: 3, eval_every: 6}}
    search_space:
      global_batch: [8]
      width: [32]
"""
TRIAL = "transformer_b8_float32_w32_lr0.0003"
# The workers wait at step 7 to be interrupted: by then the step-3 checkpoint is in the bucket (a
# save goes with the next report, the step-6 save's).
PAUSE = {"pause_at_steps": [7], "pause_s": 30}


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    return proc


def bucket_folder(run: Path) -> str:
    """The run's folder in the bucket, as its experiment.yaml records it: runs/s3/<run folder>-<8 hex>."""
    storage = load_experiment(run / runs.EXPERIMENT_FILE).storage
    assert re.fullmatch(rf"s3://{BUCKET}/runs/s3/{run.name}-[0-9a-f]{{8}}", storage), storage
    return storage.removeprefix("s3://")


def interrupted_in_the_pause(args: list[str], env: dict, experiment: Path, s3, log: Path) -> Path:
    """Run ``python -m jaxray.tune *args`` with the workers pausing at step 7 and Ctrl+C it once the
    step-3 checkpoint is whole in the bucket; returns the run folder. Kills its process group if
    it does not exit within 120 s."""
    env = faults.fault_env(env, PAUSE)
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", *args],
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline, state = time.monotonic() + 240, None
        while time.monotonic() < deadline and proc.poll() is None:
            folder = next(iter(runs.run_folders(experiment)), None)
            if folder:
                state = f"{bucket_folder(folder)}/{TRIAL}/checkpoint_step_00000003_attempt1"
                if s3.get_file_info(f"{state}/{checkpoint.TRAIN_STATE}").type == pafs.FileType.File:
                    break
            time.sleep(0.5)
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) != 0
        return folder
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_sweep_on_s3_resumed_and_served_from_the_bucket(real_dir, tmp_path, monkeypatch):
    config, experiment = tmp_path / "s3.yaml", tmp_path / "out"
    config.write_text(CONFIG)
    monkeypatch.setenv("JAXRAY_CACHE_DIR", str(tmp_path / "cache"))  # also serve's
    with s3_server(BUCKET) as s3:
        env = {**os.environ, "RAY_ADDRESS": "local", "JAXRAY_DATA_DIR": str(real_dir)}
        args = ["jaxray.tune", "--config", str(config), "--out", str(experiment)]
        out = interrupted_in_the_pause(args, env, experiment, s3, tmp_path / "first.log")
        assert f"checkpoints: s3://{bucket_folder(out)}" in (tmp_path / "first.log").read_text()
        run(["jaxray.tune", "--resume", str(experiment)], env)
        prefix = f"{bucket_folder(out)}/{TRIAL}"  # <storage>/<experiment>/<run folder>-<8 hex>
        [row] = json.loads((out / "summary.json").read_text())
        # Continued from the bucket's step-3 checkpoint.
        assert row["restarts"] == 1 and row["resumed_from_step"] == 3, row
        assert row["restart_causes"] == "interrupted", row
        assert row["checkpoint"] == f"s3://{prefix}/checkpoint_step_00000012_attempt2"
        assert s3.get_file_info(f"{prefix}.attempts.json").size > 0
        assert row["checkpoints_kept"] >= 2 and row["checkpoints_mib"] > 0
        # In the bucket: the checkpoints Ray kept, each whole; none left staged on the node, none in
        # the run folder.
        found = s3.get_file_info(pafs.FileSelector(prefix))
        kept = sorted(Path(i.path).name for i in found if i.type == pafs.FileType.Directory)
        kept = [name for name in kept if name.startswith("checkpoint_")]
        assert "checkpoint_step_00000012_attempt2" in kept and len(kept) == row["checkpoints_kept"]
        assert not list((tmp_path / "cache" / "staging").rglob("checkpoint_*"))
        assert not list(out.glob("train/*/checkpoint_*"))
        # The run folder's best transformer, read from the bucket and served over HTTP.
        assert checkpoint.verify(runs.open_checkpoint(out).path)["step"] == 12
        port = free_port()
        server = start_serving(out, port)
        try:
            reply = requests.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0},
                timeout=60,
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 8
            # SIGTERM (a job scheduler's stop) as Ctrl-C: test_serve_command.py sends SIGINT.
            rest = stopped_by(server, lambda: server.send_signal(signal.SIGTERM))
            assert "Traceback" not in rest, rest[-3000:]
        finally:
            with contextlib.suppress(ProcessLookupError):  # gone, or stopped: its group's leftovers too
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
