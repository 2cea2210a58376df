"""The worker's checkpoint saver when the disk is full (issue 15, point 7), without a Ray cluster: the
local save (``save_locally``) and the copy into the run's storage (``checkpoint_saver`` around
``ray.train.report``, here Ray Train's own StorageContext copy on a real full tmpfs) each raise a
CheckpointSaveError naming the step, the folder and the OS error, remove what they wrote and leave
the earlier checkpoint as it was; a failed trial's summary row keeps that message (``error_text``)."""

from __future__ import annotations

import shutil
import tempfile

import jax
import jax.numpy as jnp
import pytest
import ray.train
from full_disk import fill, small_tmpfs
from ray.train.v2._internal.execution.storage import StorageContext

from jaxray import checkpoint, runs
from jaxray.config import TrainConfig, parse_trial
from jaxray.models import build
from jaxray.raytrain.reports import checkpoint_saver, log_reporter, save_locally
from jaxray.raytrain.resume import checkpoint_name
from jaxray.raytrain.sweep import MAX_ERROR_CHARS, error_text
from jaxray.train.step import init_state, make_optimizer

TRIAL = parse_trial({"model": {"workload": "mlp", "width": 64}})
NO_SPACE = "No space left on device"
# Orbax's background writer, stopped by the full disk, leaves an "Event loop is closed" behind.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def state():
    return init_state(build(TRIAL.model).init(jax.random.key(0)), make_optimizer(1e-3, 0.0))


def at_step(state, step: int):
    return state._replace(step=jnp.asarray(step, state.step.dtype))


def test_a_local_save_onto_a_full_disk_names_the_folder_and_removes_it(tmp_path, state, monkeypatch):
    with small_tmpfs(tmp_path / "local", 8) as disk:
        monkeypatch.setattr(tempfile, "tempdir", str(disk))  # where mkdtemp makes the local folder
        fill(disk)
        with pytest.raises(checkpoint.CheckpointSaveError) as err:
            save_locally(40, lambda local: checkpoint.save_state(local, at_step(state, 40), TRIAL, [], {}))
        message = str(err.value)
        assert message.startswith(f"could not save the checkpoint of step 40 in {disk}/jaxray-ckpt-")
        assert NO_SPACE in message and "the partial folder is removed" in message
        assert not list(disk.glob("jaxray-ckpt-*"))


class FakeContext:
    """What ``ray.train.get_context()`` gives the saver: the run's storage."""

    def __init__(self, storage: StorageContext):
        self.storage = storage

    def get_storage(self) -> StorageContext:
        return self.storage


def test_a_copy_into_full_storage_names_it_removes_both_and_keeps_the_earlier(tmp_path, state, monkeypatch):
    local = tmp_path / "local"
    local.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(local))
    with small_tmpfs(tmp_path / "storage", 8) as disk:
        storage = StorageContext(storage_path=str(disk), experiment_dir_name="run")

        def report(
            metrics, checkpoint=None, checkpoint_dir_name=None, delete_local_checkpoint_after_upload=False
        ):
            if checkpoint is not None:  # Ray Train's copy, as ray.train.report makes it, with no cluster
                storage.persist_current_checkpoint(checkpoint, checkpoint_dir_name)
                if delete_local_checkpoint_after_upload:
                    shutil.rmtree(checkpoint.path)

        monkeypatch.setattr(ray.train, "get_context", lambda: FakeContext(storage))
        monkeypatch.setattr(ray.train, "report", report)
        save = checkpoint_saver(TRIAL, rank=0, attempt=1, batches_per_epoch=None)
        save(20, at_step(state, 20), [{"step": 20}])
        run = disk / "run"
        earlier, failed = (run / checkpoint_name(step, 1) for step in (20, 40))
        fill(disk, leave=100 << 10)  # room for part of the copy
        with pytest.raises(checkpoint.CheckpointSaveError) as err:
            save(40, at_step(state, 40), [{"step": 20}])
        message = str(err.value)
        assert message.startswith(
            f"could not copy the checkpoint of step 40 into the run's storage {failed}: "
        )
        assert NO_SPACE in message and "the partial copy is removed" in message
        assert not failed.exists() and not list(local.iterdir())
        assert checkpoint.verify(earlier)["step"] == 20
        assert runs.resolve(run) == earlier


def test_a_failed_trials_row_keeps_the_end_of_a_long_error():
    failure = (
        "jaxray.checkpoint.trees.CheckpointSaveError: could not copy the checkpoint of step 60 "
        f"into the run's storage /runs/x/train/t/checkpoint_step_00000060_attempt1: {NO_SPACE}"
    )
    traceback = "\n".join(f'  File "/site-packages/ray/x{i}.py", line {i}, in f' for i in range(200))
    text = error_text(RuntimeError(f"Training failed due to worker errors:\n{traceback}\n{failure}"))
    assert len(text) <= MAX_ERROR_CHARS
    assert text.startswith("RuntimeError: Training failed due to worker errors:\n...\n")
    assert text.endswith(failure)
    assert error_text(ValueError("\x1b[31mshort\x1b[0m")) == "ValueError: short"


def test_reports_carry_the_latest_held_out_metrics_the_log_rows_do_not(monkeypatch):
    # What ASHA reads (val_loss) is in every report after the first evaluation; the log rows (and so
    # TensorBoard) hold it only where it was measured.
    sent = []
    monkeypatch.setattr(ray.train, "report", lambda row: sent.append(row))
    report = log_reporter(TrainConfig(steps=100, log_every=10, eval_every=20, report_every=10))
    for step in range(10, 101, 10):
        report({"step": step, "loss": 1.0, **({"val_loss": step / 100} if step % 20 == 0 else {})})
    assert [(r["step"], r.get("val_loss")) for r in sent] == [
        (10, None),
        (20, 0.2),
        (30, 0.2),
        (40, 0.4),
        (50, 0.4),
        (60, 0.6),
        (70, 0.6),
        (80, 0.8),
        (90, 0.8),
    ]
