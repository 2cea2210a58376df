"""Orbax round trip: restored params give the same logits; bad paths give clear errors."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxray import checkpoint
from jaxray.config import parse_trial
from jaxray.models import build


@pytest.mark.parametrize(
    "workload,inputs",
    [
        ("mlp", np.random.default_rng(0).random((4, 784), dtype=np.float32)),
        ("shared_block_mlp", np.random.default_rng(1).random((4, 784), dtype=np.float32)),
        ("transformer", np.random.default_rng(2).integers(0, 256, (2, 24)).astype(np.int32)),
    ],
)
def test_round_trip_logits(tmp_path, workload, inputs):
    trial = parse_trial({"model": {"workload": workload, "width": 32, "num_layers": 2, "block_repeats": 2}})
    model = build(trial.model)
    params = model.init(jax.random.key(3))
    checkpoint.save(tmp_path / "ck", params, trial)
    restored_model, restored = checkpoint.restore(tmp_path / "ck")
    assert restored_model.config == trial.model
    diff = jnp.max(jnp.abs(model.apply(params, inputs) - restored_model.apply(restored, inputs)))
    assert float(diff) < 1e-5
    assert jax.tree.structure(restored) == jax.tree.structure(params)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A real checkpoint of a width-8 MLP (Orbax save, checksums.json), copied where a test needs one."""
    trial = parse_trial({"model": {"workload": "mlp", "width": 8}})
    return checkpoint.save(
        tmp_path_factory.mktemp("stored") / "ck", build(trial.model).init(jax.random.key(0)), trial
    )


def test_resolve_experiment_dir_picks_best_trial(tmp_path, stored):
    for name in "abcmn":
        shutil.copytree(stored, tmp_path / name)
    rows = [
        {"trial": "a", "workload": "transformer", "val_loss": 2.4, "checkpoint": str(tmp_path / "a")},
        {"trial": "b", "workload": "transformer", "val_loss": 2.1, "checkpoint": str(tmp_path / "b")},
        {"trial": "c", "workload": "transformer", "val_loss": None, "checkpoint": str(tmp_path / "c")},
        {"trial": "m", "workload": "mlp", "test_accuracy": 0.9, "checkpoint": str(tmp_path / "m")},
        {"trial": "n", "workload": "mlp", "test_accuracy": 0.8, "checkpoint": str(tmp_path / "n")},
    ]
    (tmp_path / "summary.json").write_text(json.dumps(rows))
    assert checkpoint.resolve(tmp_path).name == "b"
    assert checkpoint.resolve(tmp_path, workload="mlp").name == "m"
    with pytest.raises(
        checkpoint.CheckpointError, match="no finished trial with a checkpoint of workload 'shared_block_mlp'"
    ):
        checkpoint.resolve(tmp_path, workload="shared_block_mlp")


def test_resolve_a_run_folder_gives_its_newest_checkpoint(tmp_path, stored):
    for name in ("checkpoint_2026-01-01_10-00-00", "checkpoint_2026-01-02_09-00-00"):
        shutil.copytree(stored, tmp_path / name)
    assert checkpoint.resolve(tmp_path).name == "checkpoint_2026-01-02_09-00-00"


def test_damaged_files_are_named(tmp_path):
    (tmp_path / "summary.json").write_text("{bad")
    with pytest.raises(checkpoint.CheckpointError, match="summary.json is damaged"):
        checkpoint.resolve(tmp_path)
    (tmp_path / "model_config.json").write_text('{"workload": "cnn"}')
    with pytest.raises(checkpoint.CheckpointError, match="model_config.json is damaged"):
        checkpoint.load_model_config(tmp_path)


def test_bad_paths(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="neither a checkpoint"):
        checkpoint.resolve(tmp_path / "missing")
    with pytest.raises(checkpoint.CheckpointError, match="model_config.json is missing"):
        checkpoint.restore(tmp_path)


def test_params_of_another_shape_are_a_clear_error(tmp_path):
    trial = parse_trial({"model": {"workload": "mlp", "width": 16}})
    wider = parse_trial({"model": {"workload": "mlp", "width": 32}})
    # Saved so (its checksums match): params of width 16 under a width-32 config. An edited config
    # of a saved checkpoint is refused earlier, as damaged (tests/test_checkpoint_reads.py).
    checkpoint.save(tmp_path / "ck", build(trial.model).init(jax.random.key(0)), wider)
    with pytest.raises(checkpoint.CheckpointError, match="could not be restored into the model"):
        checkpoint.restore(tmp_path / "ck")


def test_a_benchmark_summary_is_not_a_sweep(tmp_path):
    (tmp_path / "summary.json").write_text('{"written_by": "jaxray.bench dispatch", "rows": []}')
    with pytest.raises(checkpoint.CheckpointError, match="is not a sweep summary"):
        checkpoint.resolve(tmp_path)
