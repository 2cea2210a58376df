"""The Tune driver: each sweep of the experiment becomes one Ray Tune grid over global batch,
compute dtype and model width, and each trial one Ray Train run (``make_trainer``) whose reports
reach Tune through ``TuneReportCallback``.

Trial and run names derive from the grid point and the workload only (``trial_name``), so the
folders of an interrupted sweep are found again by name (``Tuner.restore``). ``run_sweep`` returns
one summary row per trial: what the trial's workers reported last, without Tune's own fields.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import ray
from ray import cloudpickle, tune
from ray.tune import result as tune_result
from ray.tune.experiment import Trial
from ray.tune.integration.ray_train import CHECKPOINT_PATH_KEY, TuneReportCallback
from ray.tune.schedulers import ASHAScheduler

from jaxray.checkpoint import HISTORY_FILE
from jaxray.config import ConfigError, TrainConfig, grid_point_name, parse_trial
from jaxray.config.experiment import ExperimentConfig, SweepConfig
from jaxray.data.ray_data import to_dataset
from jaxray.raytrain import progress
from jaxray.raytrain.progress import TrialProgress
from jaxray.raytrain.trainer import make_trainer
from jaxray.reporting import terminal
from jaxray.runs import TENSORBOARD_DIR, TRAIN_DIR, TUNE_DIR

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A log row's keys: the final report carries the last one for schedulers; the summary row does not.
LOG_ROW_KEYS = ("step", "examples", "loss", "accuracy", "grad_norm", "tokens", "perplexity", "lr")
# What Tune adds to every result of a trial beside what its workers reported: its auto-filled
# metrics (ray.tune.result), the config (whole and flattened as config/<key>), the trial's tag.
TUNE_KEYS = frozenset(
    (
        *tune_result.AUTO_RESULT_KEYS,
        *tune_result.DEBUG_METRICS,
        tune_result.DONE,
        tune_result.TRIAL_ID,
        tune_result.EXPERIMENT_TAG,
    )
)
MAX_ERROR_CHARS = 2000  # of a failed trial's ``error`` in its summary row
# (summary row, history rows) of one trial; a failed trial's row carries ``error``.
TrialRows = tuple[dict[str, Any], list[dict]]
TUNER_FILE = "tuner.pkl"  # what Tuner.restore reads first; Tune writes it when the sweep starts
# The other files Tuner.restore reads (Tune 2.60), with how: the search state is a pickle.
STATE_FILES = (("experiment_state-*.json", json.loads), ("basic-variant-state-*.json", cloudpickle.loads))


def grid(sweep: SweepConfig) -> dict[str, Any]:
    """Tune's param space: every searchable axis as a grid (a single default value if not searched)."""
    return {axis: tune.grid_search(values) for axis, values in sweep.axes().items()}


def trial_name(workload: str, config: dict[str, Any]) -> str:
    """``<workload>_b<global_batch>_<dtype>_w<width>`` of a grid point, ``_lr<rate>`` added when the
    sweep searches the learning rate."""
    name = grid_point_name(workload, config["global_batch"], config["dtype"], config["width"])
    return f"{name}_lr{config['learning_rate']:g}" if config.get("learning_rate") is not None else name


def run_trial(
    config: dict[str, Any], sweep: dict, base: dict, datasets: dict, out: str, xla_flags: str | None = None
) -> None:
    """Tune function trainable: one Ray Train run whose reports reach Tune via TuneReportCallback.
    ``config``: the grid point; ``sweep``: the SweepConfig dict; ``base``: the experiment's trial
    dict; ``out``: the output folder (the run under ``train/``, events under ``tensorboard/``);
    ``xla_flags``: the driver's XLA_FLAGS, kept by the workers (``trainer.worker_env``)."""
    sweep_cfg = SweepConfig.model_validate(sweep)
    point = {axis: config[axis] for axis in sweep_cfg.axes()}
    trial = parse_trial(sweep_cfg.trial_dict(base, **point))
    name = trial_name(sweep_cfg.workload, config)
    make_trainer(
        trial,
        datasets,
        storage_path=Path(out) / TRAIN_DIR,
        name=name,
        tensorboard_dir=Path(out) / TENSORBOARD_DIR / name,
        callbacks=[TuneReportCallback()],
        xla_flags=xla_flags,
    ).fit()


def concurrent_trials(exp: ExperimentConfig, resources: dict[str, float]) -> int:
    """``max_concurrent_trials`` when set; else with ``use_gpu`` as many trials as the cluster's GPUs
    hold (``resources``: ``ray.cluster_resources()``; each trial takes num_workers x
    devices_per_worker GPUs), at least one; on CPU one (trials sharing cores would slow and time
    each other)."""
    if exp.max_concurrent_trials is not None:
        return exp.max_concurrent_trials
    if not exp.workers.use_gpu:
        return 1
    return max(1, int(resources.get("GPU", 0)) // exp.workers.total_devices)


def sweep_steps(sweep: SweepConfig) -> int:
    """Each trial's ``train.steps`` in ``sweep`` (the TrainConfig default where it sets none)."""
    return sweep.train.get("steps", TrainConfig().steps)


def early_stopping(sweep: SweepConfig) -> ASHAScheduler | None:
    """The sweep's ASHA scheduler (``sweep.early_stopping``), or None (every trial runs all its
    steps). Trials report ``step`` and the training metrics every ``train.report_interval`` steps;
    ASHA's rungs are in steps, up to the sweep's ``train.steps``."""
    rule = sweep.early_stopping
    if rule is None:
        return None
    steps = sweep_steps(sweep)
    return ASHAScheduler(
        time_attr="step",
        metric=rule.metric,
        mode=rule.mode,
        max_t=steps,
        grace_period=min(rule.grace_period, steps),
        reduction_factor=rule.reduction_factor,
    )


def run_sweep(
    exp: ExperimentConfig,
    sweep: SweepConfig,
    arrays: tuple | None,
    out: Path,
    resume: bool = False,
) -> tuple[list[TrialRows], int]:
    """Fit one sweep on its (train, held-out) arrays, fed to the workers as Ray Datasets, or (None,
    with ``data.parquet``) on its prepared Parquet folder. With ``resume`` a sweep whose Tune
    experiment exists under ``out/tune/<workload>`` is restored (``Tuner.restore``): its finished
    trials are kept as they are, its unfinished and failed ones run again.

    Returns ((summary row, history rows) per trial, how many trials did not finish because the run
    was interrupted); a failed trial's row carries ``error``.
    """
    # With data.parquet each worker streams its rows itself (jaxray.data.parquet): no dataset to pass.
    datasets = {"train": to_dataset(arrays[0]), "eval": to_dataset(arrays[1])} if arrays else {}
    # The driver's XLA_FLAGS: the trial runs in a Tune actor, whose environment is the cluster's.
    xla_flags = os.environ.get("XLA_FLAGS", "")
    trainable = tune.with_parameters(
        run_trial,
        sweep=sweep.model_dump(),
        base=exp.base(),
        datasets=datasets,
        out=str(out),
        xla_flags=xla_flags,
    )
    path = out / TUNE_DIR / sweep.workload
    if resume and tune.Tuner.can_restore(path):
        # Names, scheduler and concurrency come back from the saved experiment; the trainable (with
        # this session's datasets) is given again. Finished trials are not run again.
        print(f"resuming the {sweep.workload} sweep from {path}", file=terminal.err())
        tuner = tune.Tuner.restore(str(path), trainable, resume_unfinished=True, resume_errored=True)
        return _fit(sweep, tuner, out)
    tuner = tune.Tuner(
        trainable,
        param_space=grid(sweep),
        tune_config=tune.TuneConfig(
            max_concurrent_trials=concurrent_trials(exp, ray.cluster_resources()),
            scheduler=early_stopping(sweep),
            trial_name_creator=lambda t: trial_name(sweep.workload, t.config),
            trial_dirname_creator=lambda t: trial_name(sweep.workload, t.config),
        ),
        run_config=tune.RunConfig(
            name=sweep.workload,
            storage_path=str(out / TUNE_DIR),
            verbose=1,  # Tune's status tables: on the terminal with --verbose, else in the run's log
            callbacks=[TrialProgress(functools.partial(trial_name, sweep.workload))],
        ),
    )
    return _fit(sweep, tuner, out)


def check_saved_state(out: Path, workload: str) -> None:
    """For ``--resume``: the saved Tune experiment of the ``workload`` sweep, ``out/tune/<workload>``
    (when there is one), must be readable where ``Tuner.restore`` reads it: ``tuner.pkl`` and the
    newest ``basic-variant-state-*.json`` unpickle, the newest ``experiment_state-*.json`` parses.
    A damaged one either fails deep inside Tune or is logged and skipped, and the restored sweep then
    creates trials without their config. Raises ConfigError naming the file, the cause and how to
    run the sweep again (its trials keep their checkpoints)."""
    path = out / TUNE_DIR / workload
    if not path.is_dir():
        return
    for pattern, loads in ((TUNER_FILE, cloudpickle.loads), *STATE_FILES):
        # Tune reads the newest of each (by name, which starts with the sweep's start time).
        file = max(path.glob(pattern), default=path / pattern)
        try:
            loads(file.read_bytes())
        except FileNotFoundError:
            cause = "is missing"
        except Exception as err:  # whatever a damaged pickle or JSON file raises: all mean damaged
            cause = f"cannot be read ({type(err).__name__}: {err})"
        else:
            continue
        raise ConfigError(
            f"--resume {out}: {file}, part of the saved Tune state of the {workload} sweep, {cause}, "
            f"so Tune cannot restore that sweep. Nothing was changed. To run its trials again (each "
            f"continues from its newest checkpoint in {out / TRAIN_DIR}; a finished one keeps its "
            f"results), move {path} out of the run folder, then --resume again"
        )


def _fit(sweep: SweepConfig, tuner: tune.Tuner, out: Path) -> tuple[list[TrialRows], int]:
    title = f"{sweep.workload} sweep: {sweep.grid_size()} trial(s)"
    with progress.showing(title, sweep_steps(sweep)):
        results = tuner.fit()
    # On Ctrl+C (SIGINT) Tune saves the experiment's state, then stops the running trials, marking
    # them terminated in memory, and fit() returns as if the sweep had ended. The saved state (what
    # Tuner.restore resumes from) still has them running or pending.
    try:
        saved = tune.ExperimentAnalysis(results.experiment_path).trials
    except Exception as err:  # Tune already logged why its state was not saved; report what there is
        print(
            f"warning: could not read the saved state of the {sweep.workload} sweep ({err}); "
            f"taking it as complete",
            file=terminal.err(),
        )
        saved = []
    unfinished = sum(t.status not in (Trial.TERMINATED, Trial.ERROR) for t in saved)
    return [trial_rows(sweep.workload, r, out) for r in results], unfinished


def reported(metrics: dict[str, Any]) -> dict[str, Any]:
    """The trial summary in a trial's final Tune result: what its workers reported, without Tune's
    fields (``TUNE_KEYS``, ``config/...``), the final log row, the ``final`` flag and the
    checkpoint path TuneReportCallback adds."""
    dropped = {"final", CHECKPOINT_PATH_KEY, *LOG_ROW_KEYS, *TUNE_KEYS}
    prefix = f"{tune_result.CONFIG_PREFIX}/"
    return {k: v for k, v in metrics.items() if k not in dropped and not k.startswith(prefix)}


def error_text(error: BaseException) -> str:
    """A failed trial's ``error`` for its summary row: type and message, without ANSI colours, at
    most ``MAX_ERROR_CHARS``. A longer one keeps its first line and its end: Ray's message for a
    worker's failure is the worker's traceback, which ends with the exception that failed the trial
    (a CheckpointSaveError naming the folder and the OS error, say)."""
    text = ANSI.sub("", f"{type(error).__name__}: {error}").strip()
    if len(text) <= MAX_ERROR_CHARS:
        return text
    first = text.splitlines()[0][:200]
    return f"{first}\n...\n{text[len(first) + 5 - MAX_ERROR_CHARS :]}"


def trial_rows(workload: str, result: tune.Result, out: Path) -> TrialRows:
    """(summary row, history rows) of one trial of the run in ``out`` from its Tune ``result``: the
    grid point, the summary its workers reported, the final checkpoint's path and its
    ``history.json``; a failed trial's row carries ``error`` (``error_text``) and no history."""
    # A trial that errored can come back without its config; its folder still carries its name.
    config = result.config or {}
    name = trial_name(workload, config) if config else Path(result.path or "unknown-trial").name
    row: dict[str, Any] = {"trial": name, "workload": workload, **config}
    if result.error is not None:
        row["error"] = error_text(result.error)
        return row, []
    metrics = result.metrics or {}
    if not metrics.get("final"):
        row["error"] = "trial ended without its final report"
        return row, []
    checkpoint = metrics.get(CHECKPOINT_PATH_KEY)
    if checkpoint:  # train/<trial>/<checkpoint> of this folder, also where Tune recorded another (moved)
        checkpoint = str(out / TRAIN_DIR / Path(checkpoint).parent.name / Path(checkpoint).name)
    row.update(reported(metrics), trial=name, checkpoint=checkpoint)
    history_file = Path(checkpoint or "") / HISTORY_FILE
    return row, json.loads(history_file.read_text()) if history_file.is_file() else []
