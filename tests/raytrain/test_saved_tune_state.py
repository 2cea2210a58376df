"""``--resume`` of a run folder whose saved Tune state is damaged (a truncated ``tuner.pkl``, a
truncated experiment state, a missing ``tuner.pkl``): refused before Ray starts, naming the file and
the cause, with the way out, and nothing in the folder changed. A fresh user saw Tune's raw
traceback instead (UnpicklingError, or a KeyError after Tune logged and skipped the state). The
state files are Tune's own, from a real one-trial Tune run on a local Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tune_cli import tune_cli

from jaxray.config import ConfigError
from jaxray.config.experiment import load_experiment
from jaxray.raytrain.sweep import check_saved_state
from jaxray.tune import save_experiment

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray, pytest.mark.slow]  # a real Tune run first (about 20 s in all): CI

# A one-trial Tune sweep named like jaxray's mlp sweep, stored where jaxray's is: <out>/tune/mlp.
TUNE_RUN = """
import sys
import ray
from ray import tune
ray.init(address="local", num_cpus=1, include_dashboard=False)  # never a cluster from /tmp/ray
tune.Tuner(
    lambda config: {"loss": config["x"]},
    param_space={"x": tune.grid_search([1])},
    run_config=tune.RunConfig(name="mlp", storage_path=sys.argv[1], verbose=0),
).fit()
"""


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A run folder holding the smoke experiment's experiment.yaml and a real saved Tune state."""
    out = tmp_path_factory.mktemp("saved") / "run"
    save_experiment(out, load_experiment(ROOT / "tune_configs/smoke.yaml"))
    env = {**os.environ, "RAY_ADDRESS": "local"}
    done = subprocess.run(
        [sys.executable, "-c", TUNE_RUN, str(out / "tune")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    subprocess.run(["cp", "-a", str(run), str(tmp_path / "run")], check=True)
    return tmp_path / "run"


def files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}


def test_an_intact_saved_state_passes(saved_run):
    check_saved_state(saved_run, "mlp")
    check_saved_state(saved_run, "transformer")  # a sweep that never started: nothing to check


@pytest.mark.parametrize(
    ("damaged", "cause"),
    [
        ("tuner.pkl", "cannot be read (UnpicklingError"),
        ("experiment_state-*.json", "cannot be read (JSONDecodeError"),
        ("basic-variant-state-*.json", "cannot be read ("),
    ],
)
def test_a_truncated_state_file_is_named(saved_run, tmp_path, damaged, cause):
    run = copy_of(saved_run, tmp_path)
    [file] = (run / "tune" / "mlp").glob(damaged)
    file.write_bytes(file.read_bytes()[:40])
    with pytest.raises(ConfigError) as err:
        check_saved_state(run, "mlp")
    assert f"{file}, part of the saved Tune state of the mlp sweep, {cause}" in str(err.value)
    assert f"move {run / 'tune' / 'mlp'} out of the run folder, then --resume again" in str(err.value)


def test_resume_refuses_a_missing_tuner_file_before_ray_starts_and_changes_nothing(saved_run, tmp_path):
    run = copy_of(saved_run, tmp_path)
    (run / "tune" / "mlp" / "tuner.pkl").unlink()
    before = files(run)
    done = tune_cli("--resume", run, env={"RAY_ADDRESS": "local"})
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        f"{run / 'tune' / 'mlp' / 'tuner.pkl'}, part of the saved Tune state of the mlp sweep, is missing"
        in (done.stderr)
    )
    assert "Traceback" not in done.stderr and "Started a local Ray instance" not in done.stderr
    assert files(run) == before
