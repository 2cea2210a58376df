"""A sweep's trial whose driver dies (Tune's trial actor, and with it Ray Train's controller and the
workers: what a lost node holding them does) is restarted by Tune and resumes from its newest
complete checkpoint, so ``python -m jaxray.tune`` ends with exit 0; a trial that failed on its own is
not trained again by that restart. Each starts its own local Ray (RAY_ADDRESS=local)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import faults
import pytest
from serve_load import replica_pids

from jaxray import runs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray, pytest.mark.slow]
TRIAL_TITLE = "ray::ImplicitFunc"  # Tune's trial actor (a function trainable), in its process title
TRIAL = "mlp_b64_float32_w32_lr0.003"
CONFIG = """
experiment: driver_loss
workers: {num_workers: 1, devices_per_worker: 1, max_failures: 0}
sweeps:
  - workload: mlp
    train: {steps: 40, log_every: 10, checkpoint_every: 20}
    search_space: {global_batch: [64], width: [32]}
"""


def run_tune(tmp_path: Path, real_dir: Path, fault: dict, on_checkpoint=None) -> tuple[int, str, Path]:
    """``python -m jaxray.tune`` on CONFIG with the fault hook ``fault``; once step 20's checkpoint
    is complete, ``on_checkpoint(pid)`` (the driver's pid). Returns (exit code, output, run folder)."""
    config, log, out = tmp_path / "c.yaml", tmp_path / "tune.log", tmp_path / "out"
    config.write_text(CONFIG)
    env = faults.env(fault, RAY_ADDRESS="local", JAXRAY_DATA_DIR=str(real_dir))
    cmd = [sys.executable, "-m", "jaxray.tune", "--config", str(config), "--out", str(out)]
    with log.open("w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 240
        while on_checkpoint and proc.poll() is None and time.monotonic() < deadline:
            run = next(iter(runs.run_folders(out)), out)
            if (run / "train" / TRIAL / "checkpoint_step_00000020_attempt1" / "train_state.json").is_file():
                on_checkpoint(proc.pid)
                break
            time.sleep(0.5)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc, log.read_text(), next(iter(runs.run_folders(out)))


def test_a_killed_trial_driver_is_restarted_and_resumes_from_its_checkpoint(real_dir, tmp_path):
    def kill_driver(pid: int) -> None:
        [trial_actor] = replica_pids(TRIAL_TITLE, under=pid)
        os.kill(trial_actor, signal.SIGKILL)

    # Step 20's save is committed (train_state.json) with the next report, step 30's; the workers
    # pause at step 31 of the first attempt: the driver dies with step 20 saved and 40 not begun.
    rc, text, run = run_tune(tmp_path, real_dir, {"pause_at_steps": [31], "pause_s": 30}, kill_driver)
    assert rc == 0, text[-5000:]
    [row] = json.loads((run / "summary.json").read_text())
    assert "error" not in row, row
    assert (row["restarts"], row["resumed_from_step"], row["steps"]) == (1, 20, 40), row
    assert row["restart_causes"] == "driver lost", row


def test_a_failed_trial_is_not_trained_again_by_tunes_restart(real_dir, tmp_path):
    # The worker exits at step 5 and workers.max_failures is 0: Ray Train fails the run.
    rc, text, run = run_tune(tmp_path, real_dir, {"kill_at_step": 5})
    assert rc == 1, text[-5000:]
    [row] = json.loads((run / "summary.json").read_text())
    assert "TrialFailed" in row["error"], row
    record = json.loads((run / "train" / f"{TRIAL}.invocation.json").read_text())
    assert record["error"].split(":")[0] in row["error"], (record, row)  # the run's own error, again
    attempts = json.loads((run / "train" / f"{TRIAL}.attempts.json").read_text())
    assert attempts["attempts"] == 1, attempts  # Tune's restart raised at once: no second attempt
    assert "--resume" in text  # what trains it again
