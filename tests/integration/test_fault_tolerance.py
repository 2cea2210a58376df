"""Nothing lost, through Ray Train on the real data: a worker killed between two checkpoints, or in
the middle of a checkpoint's save with the newest saved checkpoint then damaged, is restarted by
Ray Train (FailureConfig) and the run resumes from the newest usable checkpoint with the same data
order: its final params are bitwise equal to an uninterrupted run's."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import ray

from jaxray import checkpoint
from jaxray.config import parse_trial
from jaxray.data.ray_data import to_dataset
from jaxray.data.workloads import load_arrays
from jaxray.raytrain.trainer import make_trainer

pytestmark = [pytest.mark.ray, pytest.mark.slow]
TRIALS = {
    "transformer": {
        "model": {"workload": "transformer", "width": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 32},
        "data": {"seq_len": 32},
        "train": {"global_batch": 8, "steps": 12, "checkpoint_every": 4},
    },
    # 60000 / 4096 = 14 batches an epoch: the run crosses an epoch end after its checkpoint at 8.
    "mlp": {
        "model": {"workload": "mlp", "width": 32},
        "train": {"global_batch": 4096, "steps": 20, "checkpoint_every": 8},
    },
}
EVAL_ROWS = 64


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
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
            "fault": fault or {},
        }
    )
    train_arrays, held_out = load_arrays(trial)
    datasets = {
        "train": to_dataset(train_arrays),
        "eval": to_dataset({k: v[:EVAL_ROWS] for k, v in held_out.items()}),
    }
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
    """One uninterrupted run per workload (checkpointing does not change what is trained)."""
    return {w: fit(w, real_dir, tmp_path_factory.mktemp(w), "whole") for w in TRIALS}


@pytest.mark.parametrize("workload, kill", [("transformer", 6), ("mlp", 10)])
def test_killed_worker_resumes_bitwise_equal(workload, kill, real_dir, tmp_path, uninterrupted):
    whole = uninterrupted[workload]
    assert whole.metrics["restarts"] == 0 and whole.metrics["resumed_from_step"] == 0
    resumed = fit(workload, real_dir, tmp_path, "killed", fault={"kill_at_step": kill})
    assert resumed.metrics["restarts"] == 1
    every = TRIALS[workload]["train"]["checkpoint_every"]
    assert (
        resumed.metrics["resumed_from_step"] == kill // every * every
    )  # the newest checkpoint before the kill
    assert_bitwise_equal(resumed, whole)
    history = json.loads((Path(resumed.checkpoint.path) / "history.json").read_text())
    assert [r["step"] for r in history] == list(range(2, TRIALS[workload]["train"]["steps"] + 1, 2))


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
    assert m["restarts"] == 1
    # The half-written checkpoint of step 9 never appeared; the newest reported one (6) was damaged
    # and skipped; the run went on from 3.
    assert m["skipped_checkpoints"] == 1 and m["resumed_from_step"] == 3
    assert_bitwise_equal(resumed, uninterrupted["transformer"])
    # Ray keeps the newest 3 (by name: step, then attempt): those the restarted attempt saved, each
    # complete and intact; the half-written step 9 of attempt 1 never reached storage.
    kept = sorted((tmp_path / "ray" / "mid-save").glob("checkpoint_step_*"))
    assert [p.name for p in kept] == [f"checkpoint_step_{s:08d}_attempt2" for s in (6, 9, 12)]
    assert [checkpoint.verify(p)["step"] for p in kept] == [6, 9, 12]
