"""Orbax round trip: restored params give the same logits; a damaged, incomplete or mismatched
checkpoint is refused, naming the file or the parameter."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_copies import flip_a_byte, largest_params_file
from saved import save_params

from jaxray import checkpoint
from jaxray.config import parse_trial
from jaxray.models import build
from jaxray.train.step import init_state, optimizer_for


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
    save_params(tmp_path / "ck", params, trial)
    restored_model, restored = checkpoint.restore(tmp_path / "ck")
    assert restored_model.config == trial.model
    diff = jnp.max(jnp.abs(model.apply(params, inputs) - restored_model.apply(restored, inputs)))
    assert float(diff) < 1e-5
    assert jax.tree.structure(restored) == jax.tree.structure(params)


def test_a_damaged_or_incomplete_checkpoint_is_refused_naming_the_file(tmp_path):
    trial = parse_trial({"model": {"workload": "mlp", "width": 8}})
    saved = save_params(tmp_path / "ck", build(trial.model).init(jax.random.key(0)), trial)
    recorded = json.loads((saved / checkpoint.TRAIN_STATE).read_text())["files"]
    assert "model_config.json" in recorded and any(f.startswith("params/") for f in recorded)
    damaged = shutil.copytree(saved, tmp_path / "damaged")
    file = largest_params_file(damaged)
    flip_a_byte(file)
    rel = file.relative_to(damaged).as_posix()
    with pytest.raises(checkpoint.CheckpointError, match=f"{rel} does not match its checksum"):
        checkpoint.restore(damaged)
    (saved / checkpoint.TRAIN_STATE).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="is incomplete: train_state.json is missing"):
        checkpoint.restore(saved)
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint: no such folder"):
        checkpoint.restore(tmp_path / "missing")


def test_a_train_state_is_wanted_only_where_a_run_resumes(tmp_path):
    trial = parse_trial({"model": {"workload": "mlp", "width": 8}})
    saved = save_params(tmp_path / "ck", build(trial.model).init(jax.random.key(0)), trial)
    doc = json.loads((saved / checkpoint.TRAIN_STATE).read_text())
    (saved / checkpoint.TRAIN_STATE).write_text(json.dumps({"files": doc["files"]}))  # no step
    opened = checkpoint.open(saved)
    assert opened.path == saved.absolute() and "step" not in opened.state
    for ref in (saved, opened):
        with pytest.raises(checkpoint.CheckpointError, match="holds params only, not a train state"):
            checkpoint.open(ref, full_state=True)
    pinned = checkpoint.manifest_sha256(saved)
    assert checkpoint.open(saved, pinned=pinned).state == opened.state
    with pytest.raises(checkpoint.CheckpointError, match="holds params only"):
        checkpoint.open(saved, full_state=True, pinned=pinned)  # read, not hashed: the same refusal


def test_params_of_another_shape_are_a_clear_error(tmp_path):
    trial = parse_trial({"model": {"workload": "mlp", "width": 16}})
    wider = parse_trial({"model": {"workload": "mlp", "width": 32}})
    # Saved so (its checksums match): params of width 16 under a width-32 config.
    save_params(tmp_path / "ck", build(trial.model).init(jax.random.key(0)), wider)
    with pytest.raises(checkpoint.CheckpointError, match="could not be restored into the model"):
        checkpoint.restore(tmp_path / "ck")


@pytest.mark.parametrize("where", ["history", "summary"])
def test_a_checkpoint_that_recorded_a_non_finite_metric_is_refused(tmp_path, where):
    """A train state whose history or final summary recorded a NaN or inf metric (a run that
    diverged) is refused by every restore, naming the folder, the metric, its value and step."""
    trial = parse_trial({"model": {"workload": "mlp", "width": 8}})
    tx, _ = optimizer_for(trial)
    state = init_state(build(trial.model).init(jax.random.key(0)), tx)
    history = [{"step": 5, "loss": 0.5}, {"step": 10, "loss": float("nan") if where == "history" else 0.4}]
    summary = {"test_accuracy": float("inf"), "final": True} if where == "summary" else None
    folder = checkpoint.save_state(tmp_path / "ck", state, trial, history, {}, summary=summary)
    bad = "loss nan at step 10" if where == "history" else "test_accuracy inf at step 0"
    for restore in (checkpoint.verify, checkpoint.restore):
        with pytest.raises(checkpoint.CheckpointError, match=f"records {bad}: its training diverged"):
            restore(folder)
