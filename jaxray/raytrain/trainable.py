"""The Tune trainable (``run_trial``): one Ray Train run per grid point, named from the grid point only
(``trial_name``), so ``Tuner.restore`` finds an interrupted sweep's folders again. Tune's trial
process unpickles it by reference: this module imports no JAX, Flax or Orbax."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

from ray.tune.integration.ray_train import TuneReportCallback

from jaxray import storage
from jaxray.config import TrialConfig
from jaxray.config import trial_name as name_of
from jaxray.config.experiment import SEARCHABLE
from jaxray.data.batching import num_samples
from jaxray.data.ray_data import to_dataset, train_dataset
from jaxray.folders import TENSORBOARD_DIR, TRAIN_DIR
from jaxray.raytrain.failures import read_record, record_driver_lost
from jaxray.raytrain.trainer import make_trainer, run_files

ANSI = re.compile(r"\x1b\[[0-9;]*m")
MAX_ERROR_CHARS = 2000  # of a failed trial's ``error`` in its summary row
# Beside a trial's storage folder: the jaxray.tune run that last started it, and its error if it failed.
INVOCATION_SUFFIX = ".invocation.json"


class TrialFailed(RuntimeError):
    """A trial that failed earlier in the same ``jaxray.tune`` run, restarted by Tune (whose restarts
    are meant for a lost driver): it fails again at once with that error."""


def trial_name(workload: str, config: dict[str, Any]) -> str:
    """The name (``jaxray.config.trial_name``) of the grid point ``config``."""
    return name_of(workload, **{axis: config[axis] for axis in SEARCHABLE})


def run_trial(
    config: dict[str, Any],
    workload: str,
    trials: dict[str, TrialConfig],
    data: tuple | None,
    out: str,
    xla_flags: str | None = None,
    invocation: str = "",
    storage_uri: str | None = None,
) -> None:
    """Tune trainable: one Ray Train run for the grid point ``config`` (its TrialConfig in ``trials``)
    on ``data`` ((training source, held-out arrays); None with ``data.parquet``), written under
    ``out`` (``train/``, ``tensorboard/``; checkpoints at ``storage_uri`` when given).
    Each start records ``invocation`` (this ``jaxray.tune`` run's id) in ``<name>.invocation.json``,
    with the error if the run raises. Restarted by Tune in the same invocation, a trial that raised
    raises ``TrialFailed`` with that error at once (only ``--resume`` trains it again); one that did not
    lost its driver ("driver lost"); one begun by an earlier invocation was "interrupted"."""
    name = trial_name(workload, config)
    trial = trials[name]
    train_dir = Path(out) / TRAIN_DIR
    started = train_dir / f"{name}{INVOCATION_SUFFIX}"
    record = read_record(started)
    attempts, failures = run_files(train_dir, name, storage_uri)
    if invocation and record.get("invocation") == invocation:
        if "error" in record:
            raise TrialFailed(record["error"])
        record_driver_lost(failures, attempts)
    elif record.get("invocation"):  # begun by an earlier jaxray.tune run, gone on with by --resume
        record_driver_lost(failures, attempts, "interrupted")
    # On a full disk nothing is recorded: Tune's restart then trains the trial again, to fail again.
    with contextlib.suppress(OSError):
        storage.write_text(started, json.dumps({"invocation": invocation}))
    try:
        make_trainer(
            trial,
            trial_datasets(trial, data),
            storage_path=train_dir,
            name=name,
            tensorboard_dir=Path(out) / TENSORBOARD_DIR / name,
            callbacks=[TuneReportCallback()],
            xla_flags=xla_flags,
            storage_uri=storage_uri,
            train_samples=num_samples(data[0]) if data else None,
        ).fit()
    except Exception as err:
        with contextlib.suppress(OSError):
            storage.write_text(started, json.dumps({"invocation": invocation, "error": error_text(err)}))
        raise


def trial_datasets(trial: TrialConfig, data: tuple | None) -> dict:
    """``{"train": the trial's batches (``train_dataset``), "eval": the held-out arrays}`` of ``data``
    ((training source, held-out arrays)); {} for None (``data.parquet``: the workers read it)."""
    if data is None:
        return {}
    t = trial.train
    return {"train": train_dataset(data[0], t.global_batch, t.seed, t.steps), "eval": to_dataset(data[1])}


def error_text(error: BaseException) -> str:
    """A failed trial's ``error``: type and message, no ANSI colours, at most ``MAX_ERROR_CHARS``
    (first line and end kept: a worker's traceback ends with the exception that failed it)."""
    text = ANSI.sub("", f"{type(error).__name__}: {error}").strip()
    if len(text) <= MAX_ERROR_CHARS:
        return text
    first = text.splitlines()[0][:200]
    return f"{first}\n...\n{text[len(first) + 5 - MAX_ERROR_CHARS :]}"
