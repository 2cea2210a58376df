"""Nothing lost, through Ray Train on the real data: a worker killed in the middle of a checkpoint's
save, with the newest saved checkpoint then damaged, is restarted by Ray Train (FailureConfig) and
the run resumes from the newest usable checkpoint with the same data order: its final params are
bitwise equal to an uninterrupted run's. (Bitwise resume in-process, each workload and a kill
between checkpoints: tests/train/test_resume.py.)"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import faults
import jax
import numpy as np
import pytest
import ray
from private_ray import init_private_ray

from jaxray import checkpoint
from jaxray.config import parse_trial
from jaxray.data.workloads import load_arrays
from jaxray.raytrain.trainable import trial_datasets
from jaxray.raytrain.trainer import make_trainer

pytestmark = [pytest.mark.ray, pytest.mark.slow]
TRIALS = {
    "transformer": {
        "model": {"workload": "transformer", "width": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 32},
        "data": {"seq_len": 32},
        "train": {"global_batch": 8, "steps": 12, "checkpoint_every": 4},
    },
}
EVAL_ROWS = 64
FAULT_FILE = Path(tempfile.gettempdir()) / f"jaxray-fault-{os.getpid()}.json"  # read by the workers


@pytest.fixture(scope="module")
def local_ray():
    init_private_ray(num_cpus=2, runtime_env=faults.runtime_env(FAULT_FILE))
    yield
    ray.shutdown()


def fit(workload: str, real_dir: Path, tmp_path: Path, name: str, fault: dict | None = None, **train):
    spec = TRIALS[workload]
    trial = parse_trial(
        {
            "model": spec["model"],
            "data": {"data_dir": str(real_dir), **spec.get("data", {})},
            "train": {"log_every": 2, "learning_rate": 3e-3, **spec["train"], **train},
            "workers": {"max_failures": 1 if fault else 0},
        }
    )
    train_arrays, held_out = load_arrays(trial)
    datasets = trial_datasets(trial, (train_arrays, {k: v[:EVAL_ROWS] for k, v in held_out.items()}))
    with faults.inject(FAULT_FILE, fault):
        result = make_trainer(trial, datasets, storage_path=tmp_path / "ray", name=name).fit()
    assert result.error is None, result.error
    return result


def final_params(result) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(checkpoint.restore(result.checkpoint.path)[1])]


def assert_bitwise_equal(a, b):
    for x, y in zip(final_params(a), final_params(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.metrics["final_train_loss"] == b.metrics["final_train_loss"]


@pytest.fixture(scope="module")
def uninterrupted(real_dir, tmp_path_factory, local_ray):
    """The uninterrupted transformer run (checkpointing does not change what is trained)."""
    return {"transformer": fit("transformer", real_dir, tmp_path_factory.mktemp("whole"), "whole")}


def test_killed_mid_save_then_damaged_falls_back(real_dir, tmp_path, uninterrupted):
    """Checkpoints every 3 steps; the worker dies inside the save of step 9 (the arrays written, not
    its manifest, never reported), and before the restore the newest reported checkpoint is damaged:
    the run skips it, resumes from the one before and still ends bitwise equal."""
    resumed = fit(
        "transformer",
        real_dir,
        tmp_path,
        "mid-save",
        checkpoint_every=3,
        fault={"kill_at_step": 9, "corrupt_latest_checkpoint": True},
    )
    m = resumed.metrics
    assert (m["restarts"], m["restart_causes"]) == (1, "worker died")
    # The half-written checkpoint of step 9 never appeared; the newest reported one (6) was damaged
    # and skipped; the run went on from 3.
    assert m["skipped_checkpoints"] == 1 and m["resumed_from_step"] == 3
    assert_bitwise_equal(resumed, uninterrupted["transformer"])
    # Ray keeps the newest 3 (by name: step, then attempt): those the restarted attempt saved, each
    # complete and intact; the half-written step 9 of attempt 1 never reached storage.
    kept = sorted((tmp_path / "ray" / "mid-save").glob("checkpoint_step_*"))
    assert [p.name for p in kept] == [f"checkpoint_step_{s:08d}_attempt2" for s in (6, 9, 12)]
    assert [checkpoint.verify(p)["step"] for p in kept] == [6, 9, 12]
