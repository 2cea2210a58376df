"""The best trial of a real sweep ranked by a metric that is not the default: the trial summary.md
names is the one ``--checkpoint runs/<experiment>`` loads (``jaxray.runs.resolve``).

A two-trial MLP sweep through `python -m jaxray.tune` (Ray Tune and Ray Train, the real data,
RAY_ADDRESS=local) ranked by the highest test loss: the worst trial on held-out loss, which the
default metric (highest test accuracy) would never pick, so a look-up that ignored the sweep's
metric would load the other one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxray import checkpoint, runs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray, pytest.mark.slow]

# smoke.yaml's MLP sizes; widths 8 and 64 train to clearly different test losses and accuracies.
SWEEP = """
experiment: best_trial
workers: {num_workers: 1, devices_per_worker: 1}
max_concurrent_trials: 1
sweeps:
  - workload: mlp
    metric: test_loss
    mode: max
    train: {steps: 20, log_every: 10}
    search_space:
      global_batch: [128]
      width: [8, 64]
"""


@pytest.fixture(scope="module")
def sweep(real_dir, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("best_trial")
    config, out = tmp / "sweep.yaml", tmp / "out"
    config.write_text(SWEEP)
    env = {**os.environ, "RAY_ADDRESS": "local", "JAXRAY_DATA_DIR": str(real_dir)}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxray.tune", "--config", str(config), "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    return runs.latest_run(out)


def test_summary_md_and_the_checkpoint_lookup_name_the_same_trial(sweep):
    rows = json.loads((sweep / runs.SUMMARY_JSON).read_text())
    assert len(rows) == 2 and not any(r.get("error") for r in rows)
    named = re.search(r"- \*\*mlp\*\*: `([^`]+)`, test loss", (sweep / runs.SUMMARY_MD).read_text())
    assert named, (sweep / runs.SUMMARY_MD).read_text()
    resolved = runs.resolve(sweep)
    assert resolved.parent.name == named.group(1)  # train/<trial>/checkpoint_...
    best = max(rows, key=lambda r: r["test_loss"])
    assert named.group(1) == best["trial"] and resolved == sweep / best["checkpoint"]  # relative to it
    assert checkpoint.load_trial_config(resolved).model.width == best["width"]


def test_the_default_metric_would_have_picked_the_other_trial(sweep):
    """Guards the test above: on these two trials the two rankings disagree."""
    rows = json.loads((sweep / runs.SUMMARY_JSON).read_text())
    by_default = runs.best_trial(rows, "mlp")  # DEFAULT_METRIC: highest test accuracy
    by_sweep = runs.best_trial(rows, "mlp", runs.saved_ranking(sweep))
    assert runs.saved_ranking(sweep) == {"mlp": ("test_loss", "max")}
    assert by_default["trial"] != by_sweep["trial"]
