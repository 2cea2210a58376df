"""The worker's checkpoint saver without a Ray cluster (Ray Train's own StorageContext on a real small
tmpfs): every process writes into the run's storage in the background, the save is committed and
reported at the next one; on a full disk it raises CheckpointSaveError naming the step, the folder
and the OS error, removes what it wrote and leaves the earlier checkpoint as it was; a failed
trial's summary row keeps that message (``error_text``)."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import pytest
import ray.train
from full_disk import fill, small_tmpfs
from ray.train import CheckpointUploadMode
from ray.train.v2._internal.execution.storage import StorageContext

from jaxray import checkpoint, runs
from jaxray.checkpoint import checkpoint_name
from jaxray.config import TrainConfig, parse_trial
from jaxray.models import build
from jaxray.raytrain.failures import SCORE_KEY, WORST_SCORE
from jaxray.raytrain.reports import Reports
from jaxray.raytrain.trainable import MAX_ERROR_CHARS, error_text
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


class FakeContext:
    """What ``ray.train.get_context()`` gives the saver: the run's storage."""

    def __init__(self, storage: StorageContext):
        self.storage = storage

    def get_storage(self) -> StorageContext:
        return self.storage


@pytest.fixture
def storage_run(tmp_path, monkeypatch):
    """(storage root, the reports ``ray.train.report`` received): Ray Train's own StorageContext on a
    small real tmpfs, no cluster."""
    reports = []
    with small_tmpfs(tmp_path / "storage", 8) as disk:
        storage = StorageContext(storage_path=str(disk), experiment_dir_name="run")
        monkeypatch.setattr(ray.train, "get_context", lambda: FakeContext(storage))
        monkeypatch.setattr(ray.train, "report", lambda metrics, **kw: reports.append((metrics, kw)))
        yield disk, reports


# Reports every 10 steps (report_every), logs every 10, 100 steps.
LOGGED = TRIAL.model_copy(update={"train": TrainConfig(steps=100, log_every=10, report_every=10)})


def test_a_save_goes_on_in_the_background_and_is_reported_with_the_next_report(storage_run, state):
    disk, reports = storage_run
    worker = Reports(LOGGED, rank=0, attempt=1, batches_per_epoch=None)
    first, final = (disk / "run" / checkpoint_name(step, 1) for step in (20, 100))
    worker.save(20, at_step(state, 20), [{"step": 20, "loss": 1.0}])
    assert reports == [] and not (first / checkpoint.TRAIN_STATE).exists()  # under way, not complete
    worker.log({"step": 30, "loss": 0.9})  # the next report carries it: the stream stays in step order
    worker.save(100, at_step(state, 100), [{"step": 30, "loss": 0.9}], row={"step": 100, "final": True})
    assert [metrics["step"] for metrics, _ in reports] == [30, 100]  # the final one at once
    for (_, kw), folder in zip(reports, (first, final), strict=True):
        assert kw["checkpoint"].path == str(folder) and kw["checkpoint_dir_name"] == folder.name
        assert kw["checkpoint_upload_mode"] == CheckpointUploadMode.NO_UPLOAD  # written in place
    assert checkpoint.verify(first)["step"] == 20 and checkpoint.verify(final)["summary"]["final"]


def test_an_abandoned_save_is_removed_unreported(storage_run, state):
    disk, reports = storage_run
    worker = Reports(LOGGED, rank=0, attempt=1, batches_per_epoch=None)
    worker.save(20, at_step(state, 20), [{"step": 20}])
    worker.abandon()  # a diverged run: the params under way may be broken
    worker.log({"step": 30, "loss": 0.9})
    assert [kw["checkpoint"] for _, kw in reports] == [None]
    assert not (disk / "run" / checkpoint_name(20, 1)).exists()


def test_a_save_into_full_storage_names_it_removes_it_and_keeps_the_earlier(storage_run, state):
    disk, reports = storage_run
    worker = Reports(LOGGED, rank=0, attempt=1, batches_per_epoch=None)
    run = disk / "run"
    earlier, failed = (run / checkpoint_name(step, 1) for step in (20, 40))
    worker.save(20, at_step(state, 20), [{"step": 20}])
    worker.log({"step": 30})
    fill(disk, leave=100 << 10)  # room for part of the arrays
    with pytest.raises(checkpoint.CheckpointSaveError) as err:
        worker.save(40, at_step(state, 40), [{"step": 30}])
        worker.log({"step": 50})
    message = str(err.value)
    assert message.startswith(f"could not save the checkpoint of step 40 in {failed}: "), message
    assert NO_SPACE in message and "the partial folder is removed" in message
    assert not failed.exists() and len(reports) == 1
    assert checkpoint.verify(earlier)["step"] == 20
    assert runs.open_checkpoint(run).path == earlier


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
    monkeypatch.setattr(ray.train, "report", lambda row, **_: sent.append(row))
    train = TrainConfig(steps=100, log_every=10, eval_every=20, report_every=10)
    worker = Reports(TRIAL.model_copy(update={"train": train}), rank=0, attempt=1, batches_per_epoch=None)
    for step in range(10, 101, 10):
        worker.log({"step": step, "loss": 1.0, **({"val_loss": step / 100} if step % 20 == 0 else {})})
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


@pytest.mark.parametrize("metric", ["val_loss", "val_accuracy"])
def test_a_checkpoint_not_yet_scored_or_scored_nan_ranks_worst_and_finite(storage_run, state, metric):
    # Ray keeps its record of reported checkpoints as JSON, inf and NaN turned to null; a run resumed
    # from that record then fails ranking them, so the worst score is the largest finite float.
    _, reports = storage_run
    train = TrainConfig(steps=100, log_every=10, eval_every=20, checkpoint_score=metric)
    worker = Reports(TRIAL.model_copy(update={"train": train}), rank=0, attempt=1, batches_per_epoch=None)
    for step, measured in ((10, {}), (20, {metric: math.nan}), (40, {metric: 0.5})):
        worker.log({"step": step, "loss": 1.0, **measured})  # at 10: before the first evaluation
        worker.save(step, at_step(state, step), [], row={"step": step, "final": True} if step == 40 else None)
    scores = [metrics[SCORE_KEY] for metrics, kw in reports if kw["checkpoint"]]
    worst = WORST_SCORE if metric == "val_loss" else -WORST_SCORE
    assert scores == [worst, worst, 0.5], scores
    json.dumps(scores, allow_nan=False)
