"""A save that cannot finish (issue 15, point 7), end to end on a real full disk: ``python -m
jaxray.tune`` with ``--out`` on a small tmpfs, filled up (a filler file, to ENOSPC, less 1 MiB for
Ray's and Tune's small files) once the trial's first checkpoint is registered. The next checkpoint's
write into the run's storage fails; the worker says so in words, removes its partial folder, Ray Train
restarts it once (``max_failures: 1``) from the newest checkpoint, it fails the same way, and the run
ends in bounded time with the failed trial's exit code and summary row naming the step, the folder
and ``[Errno 28] No space left on device``. Every checkpoint saved before is intact, and once the
filler is gone ``python -m jaxray.evaluate`` on the trial's run folder uses the newest of them.
Starts its own local Ray (RAY_ADDRESS=local)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from full_disk import fill, small_tmpfs

from jaxray import checkpoint

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray, pytest.mark.slow]

# Width 256: a checkpoint is ~2.4 MiB (params, Adam's two moments), more than the 1 MiB left free.
# Checkpoints every 20 steps of 3000: the run is still saving when the disk fills. keep_checkpoints
# high, so that Ray Train's rotation deletes none of those saved before.
EXPERIMENT = """
experiment: no-space
workers: {num_workers: 1, devices_per_worker: 1, max_failures: 1}
sweeps:
  - workload: mlp
    train: {steps: 3000, log_every: 50, checkpoint_every: 20, keep_checkpoints: 100}
    search_space: {global_batch: [64], width: [256]}
"""
TRIAL = "mlp_b64_float32_w256_lr0.003"
HEADROOM = 1 << 20
NO_SPACE = "No space left on device"


def trial_folder(out: Path) -> Path:
    """``TRIAL``'s Ray Train folder in the run that ``python -m jaxray.tune --out out`` made."""
    return next(iter(out.glob(f"*/train/{TRIAL}")), out / "not-yet" / "train" / TRIAL)


def registered(run: Path) -> list[str]:
    """The checkpoints Ray Train has registered for the run (its checkpoint manager's snapshot)."""
    snapshot = run / "checkpoint_manager_snapshot.json"
    try:
        results = json.loads(snapshot.read_text())["checkpoint_results"]
    except (OSError, ValueError, KeyError):  # not written yet, or being written
        return []
    return [r["checkpoint_dir_name"] for r in results]


def run_until_the_disk_fills(
    cmd: list[str], env: dict, run: Path, disk: Path, log: Path, leave: int = HEADROOM
) -> tuple[int, list[str]]:
    """Start ``cmd`` (a run into the experiment folder ``run``); once Ray Train has registered a
    checkpoint of it, fill ``disk`` but
    ``leave`` bytes; (exit code, the checkpoints registered by then). SIGKILLs the process group and
    fails if the run has not ended 180 s after the disk filled."""
    with log.open("w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and not registered(trial_folder(run)):
            time.sleep(0.2)
        assert proc.poll() is None, f"the run ended before the disk filled:\n{log.read_text()[-3000:]}"
        before = registered(trial_folder(run))
        assert before, f"no checkpoint within 180 s:\n{log.read_text()[-3000:]}"
        fill(disk, leave=leave)
        try:
            return proc.wait(timeout=180), before
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not end within 180 s of the disk filling:\n{log.read_text()[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_full_disk_fails_the_trial_in_words_and_keeps_every_earlier_checkpoint(real_dir, tmp_path):
    config, log = tmp_path / "no-space.yaml", tmp_path / "tune.log"  # off the small disk
    config.write_text(EXPERIMENT)
    env = {**os.environ, "RAY_ADDRESS": "local", "JAXRAY_DATA_DIR": str(real_dir)}
    with small_tmpfs(tmp_path / "disk", 64) as disk:
        out = disk / "out"
        cmd = [sys.executable, "-m", "jaxray.tune", "--config", str(config), "--out", str(out)]
        rc, before = run_until_the_disk_fills(cmd, env, out, disk, log)
        text, run = log.read_text(), trial_folder(out)
        out = run.parent.parent  # the run's own folder
        assert rc == 1, text[-5000:]  # a failed trial (jaxray.tune.report)
        assert f"error: 1 trial(s) failed: {TRIAL}" in text
        # The trial's error reaches the terminal when it fails, with where its traceback and the
        # run's whole output are; Ray's, Tune's and the workers' lines are only in that log.
        [run_log] = (out / "logs").glob("tune-*.log")
        failed = next(ln for ln in text.splitlines() if ln.startswith(f"error: trial {TRIAL} failed: "))
        assert "CheckpointSaveError" in failed and f"(traceback: {out / 'tune' / 'mlp'}/" in failed, failed
        assert failed.endswith(f"; all output: {run_log}"), failed
        assert "(RayTrainWorker pid=" not in text
        assert "jaxray: attempt 2, resuming from" in run_log.read_text()  # Ray Train's restart failed too

        [row] = json.loads((out / "summary.json").read_text())
        failure = "CheckpointSaveError: could not save the checkpoint of step "
        assert failure in row["error"] and f" in {run}/checkpoint_step_" in row["error"]
        assert NO_SPACE in row["error"] and "the partial folder is removed" in row["error"]

        # No partial copy is left behind, and every checkpoint registered before the disk filled is whole.
        left = sorted(p.name for p in run.glob("checkpoint_step_*"))
        assert set(before) <= set(left) and set(left) == set(registered(run)), (before, left)
        for name in left:
            checkpoint.verify(run / name)

        (disk / "filler").unlink()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxray.evaluate",
                "--checkpoint",
                str(run),
                "--out",
                str(tmp_path / "eval"),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"checkpoint     {run / left[-1]} (mlp)" in done.stdout
