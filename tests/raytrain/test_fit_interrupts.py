"""Ctrl-C around a real Tune fit (``interrupts.around_fit``). Tune 2.60 installs its own SIGINT
handler for each fit and leaves it installed after a fit it did not have to stop, so a Ctrl-C
between two sweeps reached only a finished fit and was lost (a fresh user saw the next sweep run to
its end, exit 0). Each driver is a real ``python`` process with a local Ray and a one-trial fit;
the signal is a real SIGINT to it: after the fit, and during it (sent by the trial)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

DRIVER = """
import os, signal, sys, time
import ray
from ray import tune
from jaxray.raytrain import interrupts

def trial(config):
    if config["signal_from_trial"]:
        os.kill(config["driver"], signal.SIGINT)  # Ctrl-C while the fit runs
        time.sleep(30)
    return {"loss": 1.0}

ray.init(num_cpus=1, include_dashboard=False)
space = {"driver": os.getpid(), "signal_from_trial": sys.argv[2] == "during"}
with interrupts.recording():
    try:
        with interrupts.around_fit():
            tune.Tuner(
                trial, param_space=space, run_config=tune.RunConfig(storage_path=sys.argv[1], verbose=0)
            ).fit()
        print("after the fit:", "recorded" if interrupts.interrupted() else "not recorded")
        if sys.argv[2] == "after":
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C between two sweeps
            time.sleep(5)
        print("lost")
    except KeyboardInterrupt:
        print("raised")
"""


@pytest.mark.parametrize(
    ("when", "told"),
    [
        ("after", ["after the fit: not recorded", "raised"]),  # ours again: the next sweep never starts
        ("during", ["after the fit: recorded", "lost"]),  # Tune's graceful stop, and the record of it
    ],
)
def test_a_ctrl_c_around_a_tune_fit_is_never_lost(tmp_path, when, told):
    env = {**os.environ, "RAY_ADDRESS": "local"}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path), when],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [
        line for line in done.stdout.splitlines() if line.startswith(("after the fit", "raised", "lost"))
    ]
    assert lines == told, done.stdout[-3000:] + done.stderr[-3000:]
