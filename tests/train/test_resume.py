"""Full-state checkpoints without Ray: a run resumed from a checkpoint ends bitwise equal to an
uninterrupted one (transformer on TinyShakespeare, MLP on Fashion-MNIST), a checkpoint restores
onto a mesh of another size and training continues with the same losses, and incomplete, damaged
or mismatched checkpoints are clear errors (or a fallback to the previous one)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxray.checkpoint import CheckpointError, restore_latest, save_state, verify
from jaxray.config import DataConfig, ModelConfig, TrainConfig, TrialConfig
from jaxray.data.batching import train_batches
from jaxray.data.workloads import load_arrays
from jaxray.parallel.mesh import make_mesh
from jaxray.train.run import train

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

TRIALS = {
    "transformer": TrialConfig(
        model=ModelConfig(workload="transformer", width=64, num_layers=2, num_heads=2, max_seq_len=64),
        # Warmup to step 6, then cosine decay: checkpoint 4 is mid-warmup, 8 mid-decay.
        train=TrainConfig(
            steps=12,
            global_batch=16,
            learning_rate=3e-3,
            warmup_steps=6,
            log_every=3,
            eval_every=6,
            checkpoint_every=4,
        ),
        data=DataConfig(seq_len=64),
    ),
    # Dropout on (keys from (seed, step), nothing saved) and the embedding tied to the LM head.
    "transformer_dropout": TrialConfig(
        model=ModelConfig(
            workload="transformer",
            width=64,
            num_layers=2,
            num_heads=2,
            max_seq_len=64,
            dropout=0.2,
            tie_embeddings=True,
        ),
        train=TrainConfig(steps=12, global_batch=16, learning_rate=3e-3, log_every=3, checkpoint_every=4),
        data=DataConfig(seq_len=64),
    ),
    # 60000 / 4096 = 14 batches an epoch: the 20 steps cross an epoch boundary after the checkpoint.
    "mlp": TrialConfig(
        model=ModelConfig(workload="mlp", width=64),
        train=TrainConfig(steps=20, global_batch=4096, log_every=5, checkpoint_every=8),
    ),
}


def run(trial, tmp_path, resume=None):
    arrays, held_out = load_arrays(
        trial.model_copy(
            update={"data": trial.data.model_copy(update={"data_dir": os.environ["JAXRAY_DATA_DIR"]})}
        )
    )
    saved = {}

    def save(step, state, history):
        saved[step] = save_state(tmp_path / f"step_{step}", state, trial, history, {"epoch": 0})

    result = train(
        trial,
        train_batches(arrays, trial.train.global_batch, trial.train.seed),
        held_out,
        make_mesh(jax.devices()[:1]),
        save=None if resume else save,
        resume=resume,
    )
    return result, saved


@pytest.fixture(scope="module")
def uninterrupted(real_dir, tmp_path_factory):
    """workload -> (result, {step: checkpoint}) of ``TRIALS[workload]`` run once without a break,
    saving; made once per module. Tests that damage a checkpoint work on a copy."""
    done = {}

    def get(workload: str):
        if workload not in done:
            done[workload] = run(TRIALS[workload], tmp_path_factory.mktemp(workload))
        return done[workload]

    return get


@pytest.mark.parametrize(
    "workload, at",
    [
        pytest.param("transformer", 4, marks=pytest.mark.slow),  # 25 s: CI
        pytest.param("transformer", 8, marks=pytest.mark.slow),  # slow: CI
        pytest.param("transformer_dropout", 8, marks=pytest.mark.slow),  # 40 s: CI
        ("mlp", 8),
    ],
)
def test_resumed_run_ends_bitwise_equal(uninterrupted, tmp_path, workload, at):
    """Mid-warmup (4) and mid-decay (8): the schedule's count is restored with the optimizer state."""
    trial = TRIALS[workload]
    whole, saved = uninterrupted(workload)
    every = trial.train.checkpoint_every
    assert sorted(saved) == list(range(every, trial.train.steps, every))
    resumed, _ = run(trial, tmp_path, resume=saved[at])
    assert resumed.summary["resumed_from_step"] == at
    for a, b in zip(jax.tree.leaves(whole.state.params), jax.tree.leaves(resumed.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert resumed.history == whole.history  # the restored history plus the same rows after it
    if workload == "transformer_dropout":  # the masks are drawn: the losses differ from no dropout's
        assert whole.history[-1]["loss"] != uninterrupted("transformer")[0].history[-1]["loss"]
        assert "lm_head" not in whole.state.params
    if trial.train.eval_every:  # held-out metrics only in the rows of the steps they were measured at
        assert [r["step"] for r in whole.history if "val_loss" in r] == [6, 12]
    assert resumed.summary["final_train_loss"] == whole.summary["final_train_loss"]


@pytest.mark.slow  # 9 s; CI runs it
def test_a_run_resumed_from_its_final_checkpoint_reports_what_was_measured(uninterrupted, tmp_path):
    # A sweep interrupted after a trial's final save but before Tune recorded the trial finished
    # runs it again from that checkpoint: no step is left, so nothing can be timed.
    trial = TRIALS["mlp"]
    whole, _ = uninterrupted("mlp")
    final_row = {**whole.history[-1], **whole.summary, "final": True}
    final = save_state(tmp_path / "final", whole.state, trial, whole.history, {}, summary=final_row)
    again, _ = run(trial, tmp_path, resume=final)
    assert again.summary == {**final_row, "resumed_from_step": trial.train.steps}
    assert np.isfinite(again.summary["examples_per_sec"]) and again.history == whole.history
    # A final checkpoint without a summary (saved before it was recorded) still resumes.
    bare = save_state(tmp_path / "bare", whole.state, trial, whole.history, {})
    assert run(trial, tmp_path, resume=bare)[0].summary["resumed_from_step"] == trial.train.steps


@pytest.mark.slow  # 10 s; CI runs it
def test_checkpoint_files(uninterrupted):
    _, saved = uninterrupted("transformer")
    doc = verify(saved[4])
    assert doc["step"] == 4 and doc["seed"] == 0 and doc["epoch"] == 0
    assert doc["rng_key_data"] == np.asarray(jax.random.key_data(jax.random.key(0))).tolist()
    assert any(name.startswith("opt_state/") for name in doc["files"])
    assert json.loads((saved[8] / "history.json").read_text())[-1]["step"] == 6  # logged every 3


def test_incomplete_and_damaged_checkpoints_fall_back_to_the_previous(uninterrupted, tmp_path, caplog):
    saved = {
        step: shutil.copytree(path, tmp_path / path.name)
        for step, path in uninterrupted("transformer")[1].items()
    }
    (saved[8] / "train_state.json").unlink()  # a save killed before its manifest
    with pytest.raises(CheckpointError, match="incomplete: train_state.json is missing"):
        verify(saved[8])
    victim = max((f for f in (saved[4] / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        verify(saved[4])
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        restore_latest([saved[8], saved[4]], verify)
    good = save_state(tmp_path / "good", checkpoint_state(saved), TRIALS["transformer"], [], {})
    with caplog.at_level(logging.WARNING, logger="jaxray.checkpoint"):
        doc, path = restore_latest([saved[8], good], verify)
    assert path == good and doc["step"] == 0
    assert str(saved[8]) in caplog.text and str(good) in caplog.text


def checkpoint_state(saved):
    from jaxray.models import build
    from jaxray.train.step import init_state, make_optimizer

    trial = TRIALS["transformer"]
    model = build(trial.model)
    return init_state(model.init(jax.random.key(0)), make_optimizer(trial.learning_rate, 0.0))


def test_restoring_into_another_model_names_the_parameter_and_shapes(uninterrupted, tmp_path):
    _, saved = uninterrupted("transformer")
    wider = TRIALS["transformer"].model_copy(
        update={"model": TRIALS["transformer"].model.model_copy(update={"width": 128})}
    )
    with pytest.raises(
        CheckpointError,
        match=r"parameter blocks/0/attn/key/bias has shape \(2, 32\) in the "
        r"checkpoint but \(2, 64\) in the model",
    ):
        run(wider, tmp_path, resume=saved[4])


@pytest.mark.slow  # four 4-device subprocess runs (a minute); CI runs it
@pytest.mark.parametrize(
    "save, restore",
    [((1, 1), (4, 1)), ((4, 1), (1, 1)), ((4, 4), (1, 1)), ((1, 1), (4, 2))],
    ids=["1-4", "4-1", "fsdp4-1", "1-data2xfsdp2"],
)
def test_restore_onto_another_mesh_continues_with_the_same_loss(real_dir, save, restore):
    """(devices, fsdp) saved on and restored onto: a checkpoint of params split over fsdp restores
    whole onto one device (as serving does) and a whole one restores split."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "resume_on_mesh.py"),
            *("--save-devices", str(save[0]), "--save-fsdp", str(save[1])),
            *("--restore-devices", str(restore[0]), "--restore-fsdp", str(restore[1])),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["devices"] for r in out["largest"]] == [save[0], restore[0]] and out["resumed_from_step"] == 6
    for (_, fsdp), run in zip((save, restore), out["largest"], strict=True):
        # The largest param is an embedding or the LM head: its embed dimension (d_model 64) split
        # over fsdp, its vocab (256) over tensor (1 here) (jaxray.parallel.mesh.RULES).
        assert run["shard"] == [n // fsdp if n == 64 else n for n in run["shape"]], run
    assert out["restored_steps"][-6:] == list(range(7, 13))
    np.testing.assert_allclose(out["restored"], out["continued"], rtol=1e-5)
