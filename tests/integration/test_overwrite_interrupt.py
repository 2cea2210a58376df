"""Ctrl-C (SIGINT to the driver) early in an ``--overwrite`` run, 0 s and 1.5 s after it set the
earlier run's results aside, before Tune has started a trial: the run ends as interrupted (exit
130) and the earlier results are back in place, byte for byte. A fresh user found the interrupt
lost there and the earlier run deleted at the end. Starts its own local Ray (RAY_ADDRESS=local)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from earlier_runs import earlier_run, results

from jaxray.overwrite import ASIDE_DIR

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.parametrize("delay_s", [0.0, 1.5])
def test_ctrl_c_just_after_the_set_aside_puts_the_earlier_run_back(real_dir, tmp_path, delay_s):
    out = tmp_path / "run"
    before = earlier_run(out)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxray.tune", "--config", "tune_configs/smoke.yaml"]
        + ["--out", str(out), "--overwrite"],
        cwd=ROOT,
        env={**os.environ, "RAY_ADDRESS": "local", "JAXRAY_DATA_DIR": str(real_dir)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / ASIDE_DIR).exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.02)
        time.sleep(delay_s)
        proc.send_signal(signal.SIGINT)
        log, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, log[-4000:]
    assert not (out / ASIDE_DIR).exists(), log[-4000:]
    assert results(out) == before, log[-4000:]  # and the interrupted run's log beside them
