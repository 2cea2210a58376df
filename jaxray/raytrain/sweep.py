"""The Tune driver: each sweep is one Ray Tune grid (global batch, dtype, width, peak learning rate),
each trial one Ray Train run (``jaxray.raytrain.trainable.run_trial``); then each trial's summary
row from its result, checkpoints and compile report."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import uuid
from pathlib import Path
from typing import Any

import ray
from ray import cloudpickle, tune
from ray.tune.experiment import Trial
from ray.tune.integration.ray_train import CHECKPOINT_PATH_KEY
from ray.tune.result import AUTO_RESULT_KEYS, CONFIG_PREFIX, DEBUG_METRICS, DONE, EXPERIMENT_TAG, TRIAL_ID
from ray.tune.schedulers import ASHAScheduler

from jaxray import checkpoint, storage
from jaxray.checkpoint import HISTORY_FILE, remove_unfinished
from jaxray.config import ConfigError, TrainConfig, TrialConfig
from jaxray.config.experiment import ExperimentConfig, SweepConfig
from jaxray.folders import COMPILE_FILE, TRAIN_DIR, TUNE_DIR
from jaxray.parallel.mesh import MESH_AXES, describe
from jaxray.raytrain import progress
from jaxray.raytrain.failures import ATTEMPT_KEY, SCORE_KEY
from jaxray.raytrain.progress import TrialProgress
from jaxray.raytrain.trainable import error_text, run_trial, trial_name
from jaxray.reporting import terminal
from jaxray.reporting.format import DIVERGED_KEYS, diverged_error, step_rates

# A log row's keys: the final report carries the last one for schedulers; the summary row does not.
LOG_ROW_KEYS = ("step", "examples", "loss", "accuracy", "grad_norm", "tokens", "perplexity", "lr")
# What Tune adds to every result beside what the workers reported.
TUNE_KEYS = frozenset((*AUTO_RESULT_KEYS, *DEBUG_METRICS, DONE, TRIAL_ID, EXPERIMENT_TAG))
# (summary row, history rows) of one trial; a failed trial's row carries ``error``.
TrialRows = tuple[dict[str, Any], list[dict]]
# The files Tuner.restore reads (Tune 2.60), with how; first tuner.pkl, written when the sweep starts.
STATE_FILES = (
    ("tuner.pkl", cloudpickle.loads),
    ("experiment_state-*.json", json.loads),
    ("basic-variant-state-*.json", cloudpickle.loads),
)


def concurrent_trials(exp: ExperimentConfig, resources: dict[str, float]) -> int:
    """``max_concurrent_trials`` when set; else as many trials as the cluster's GPUs or TPU chips hold
    (at least one), or one on CPU (trials sharing cores would skew each other's timings)."""
    if exp.max_concurrent_trials is not None:
        return exp.max_concurrent_trials
    if exp.workers.accelerator == "cpu":
        return 1
    return max(1, int(resources.get(exp.workers.accelerator.upper(), 0)) // exp.workers.total_devices)


def sweep_steps(sweep: SweepConfig) -> int:
    """Each trial's ``train.steps`` in ``sweep`` (the TrainConfig default where it sets none)."""
    return sweep.train.get("steps", TrainConfig().steps)


def early_stopping(sweep: SweepConfig) -> ASHAScheduler | None:
    """The sweep's ASHA scheduler (rungs in steps, up to ``train.steps``), or None."""
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
    index: int,
    trials: dict[str, TrialConfig],
    arrays: tuple | None,
    out: Path,
    resume: bool = False,
) -> tuple[list[TrialRows], int]:
    """Fit sweep ``index`` of ``exp`` (``trials``: ``{name: TrialConfig}`` in grid order) on its (train,
    held-out) arrays (None with ``data.parquet``); with ``resume`` restore ``out/tune/<workload>``,
    rerunning unfinished and failed trials. Returns ((summary row, history rows) per trial, trials
    left unfinished by an interruption)."""
    sweep = exp.sweeps[index]
    trainable = tune.with_parameters(
        run_trial,
        workload=sweep.workload,
        trials=trials,
        data=arrays or None,
        out=str(out),
        # The driver's: the trial runs in a Tune actor, whose environment is the cluster's.
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        invocation=uuid.uuid4().hex,  # tells Tune's restart of a failed trial from --resume
        storage_uri=exp.storage,
    )
    path = out / TUNE_DIR / sweep.workload
    if resume and tune.Tuner.can_restore(path):
        print(f"resuming the {sweep.workload} sweep from {path}", file=terminal.err())
        tuner = tune.Tuner.restore(str(path), trainable, resume_unfinished=True, resume_errored=True)
        return _fit(sweep, tuner, out, exp.storage, list(trials))
    name = functools.partial(trial_name, sweep.workload)
    tuner = tune.Tuner(
        trainable,
        # Every searchable axis as a grid (a single default value if not searched).
        param_space={axis: tune.grid_search(values) for axis, values in sweep.axes().items()},
        tune_config=tune.TuneConfig(
            max_concurrent_trials=concurrent_trials(exp, ray.cluster_resources()),
            scheduler=early_stopping(sweep),
            trial_name_creator=lambda t: name(t.config),
            trial_dirname_creator=lambda t: name(t.config),
        ),
        run_config=tune.RunConfig(
            name=sweep.workload,
            storage_path=str(out / TUNE_DIR),
            verbose=1,  # Tune's status tables: on the terminal with --verbose, else in the run's log
            callbacks=[TrialProgress(name)],
            failure_config=tune.FailureConfig(max_failures=exp.workers.max_driver_failures),
        ),
    )
    return _fit(sweep, tuner, out, exp.storage, list(trials))


def check_saved_state(out: Path, workload: str) -> None:
    """For ``--resume``: ConfigError naming a damaged or missing file of the saved Tune state in
    ``out/tune/<workload>`` (if any) and how to run the sweep again."""
    path = out / TUNE_DIR / workload
    if not path.is_dir():
        return
    for pattern, loads in STATE_FILES:
        # Tune reads the newest of each (names start with the sweep's start time).
        file = max(path.glob(pattern), default=path / pattern)
        try:
            loads(file.read_bytes())
            continue
        except FileNotFoundError:
            cause = "is missing"
        except Exception as err:  # whatever a damaged pickle or JSON file raises: all mean damaged
            cause = f"cannot be read ({type(err).__name__}: {err})"
        raise ConfigError(
            f"--resume {out}: {file}, part of the saved Tune state of the {workload} sweep, {cause}, "
            f"so Tune cannot restore that sweep. Nothing was changed. To run its trials again (each "
            f"continues from its newest checkpoint in {out / TRAIN_DIR}; a finished one keeps its "
            f"results), move {path} out of the run folder, then --resume again"
        )


def with_run_storage(exp: ExperimentConfig, out: Path) -> ExperimentConfig:
    """``exp`` with its ``storage`` resolved to ``<storage>/<experiment>/<out's name>-<8 hex digits>``:
    the random part keeps it the run's own (a new run must never resume from another's checkpoints)."""
    if exp.storage is None:
        return exp
    folder = f"{out.name}-{uuid.uuid4().hex[:8]}"
    return exp.model_copy(update={"storage": storage.join(exp.storage, exp.experiment, folder)})


def _fit(
    sweep: SweepConfig, tuner: tune.Tuner, out: Path, storage_uri: str | None, names: list[str]
) -> tuple[list[TrialRows], int]:
    title = f"{sweep.workload} sweep: {sweep.grid_size()} trial(s)"
    with progress.showing(title, sweep_steps(sweep)):
        results = tuner.fit()
    for trial_dir in (out / TRAIN_DIR).glob(f"{sweep.workload}_*"):  # stopped trials' saves in flight
        try:
            remove_unfinished(trial_dir)
        except checkpoint.CheckpointError as err:  # unlistable: the results are still summarised
            print(f"warning: {err}", file=terminal.err())
    # After Ctrl+C fit() returns as if done; only the saved state shows the unfinished trials.
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
    rule = sweep.early_stopping
    rows = [trial_rows(sweep.workload, r, out, rule.metric if rule else None, storage_uri) for r in results]
    # In the grid's order (``names``), however Tune returned them (a restored sweep lists them otherwise).
    order = {name: i for i, name in enumerate(names)}
    rows.sort(key=lambda r: order.get(r[0]["trial"], len(order)))
    return rows, unfinished


def reported(metrics: dict[str, Any]) -> dict[str, Any]:
    """What a trial's workers reported in its final Tune result, without Tune's fields and the log row."""
    dropped = {"final", SCORE_KEY, ATTEMPT_KEY, CHECKPOINT_PATH_KEY, *LOG_ROW_KEYS, *TUNE_KEYS}
    prefix = f"{CONFIG_PREFIX}/"
    return {k: v for k, v in metrics.items() if k not in dropped and not k.startswith(prefix)}


def trial_rows(
    workload: str,
    result: tune.Result,
    out: Path,
    early_stopping: str | None = None,
    storage_uri: str | None = None,
) -> TrialRows:
    """(summary row, history rows) of one trial from its Tune ``result``; a failed trial's row carries
    ``error`` and no history. ``early_stopping``: the metric the sweep's ASHA reads; a trial it stopped
    (no final report) has ``stopped_at_step``, ``stopped_metric``, ``stopped_value``, no ranking
    metric, its ``stopped_figures`` and its newest committed checkpoint."""
    # A trial that errored can come back without its config; its folder still carries its name.
    config = result.config or {}
    name = trial_name(workload, config) if config else Path(result.path or "unknown-trial").name
    row: dict[str, Any] = {"trial": name, "workload": workload, **config}
    if result.error is not None:
        row["error"] = error_text(result.error)
        return row, []
    metrics = result.metrics or {}
    if not metrics.get("final") and early_stopping and metrics.get("step") is not None:
        value = metrics.get(early_stopping)
        row.update(stopped_at_step=metrics["step"], stopped_metric=early_stopping, stopped_value=value)
        local = str(out / TRAIN_DIR / name)  # its compile.json, whatever the checkpoints' storage
        folder = storage.join(storage_uri, name) if storage_uri else local
        row.update(stopped_figures(metrics, local))
        try:
            newest = next(iter(checkpoint.checkpoints(folder)), None)
        except checkpoint.CheckpointError as err:
            print(f"warning: {name}: {err}", file=terminal.err())
            newest = None
        row, history = with_checkpoint(row, newest)
        last = history[-1].get("step", -1) if history else -1  # its reports reach past its newest save
        return row, history + [r for r in reported_rows(result) if r.get("step", -1) > last]
    if not metrics.get("final"):
        row["error"] = "trial ended without its final report"
        return row, []
    if metrics.get("diverged_step") is not None:  # stopped by the worker (jaxray.train.run.Diverged)
        found = {k: metrics.get(k) for k in DIVERGED_KEYS}
        row.update(found, error=diverged_error(found))
        return row, []
    recorded = metrics.get(CHECKPOINT_PATH_KEY)
    if recorded and storage_uri:  # <trial>/<checkpoint> in the run's folder on object storage
        recorded = storage.join(storage_uri, Path(recorded).parent.name, Path(recorded).name)
    elif recorded:  # train/<trial>/<checkpoint> of this folder, also where Tune recorded another (moved)
        recorded = str(out / TRAIN_DIR / Path(recorded).parent.name / Path(recorded).name)
    row.update(reported(metrics), trial=name)
    return with_checkpoint(row, checkpoint.best_of(row, recorded), history_from=recorded)


def stopped_figures(metrics: dict[str, Any], folder: str) -> dict[str, Any]:
    """What a trial ASHA stopped keeps: its compile report's figures (``compile.json`` in ``folder``:
    devices, mesh, per-device batch, compile time, peak memory, attention), the last reported train
    loss and ``ms_per_step`` (since the row before, hooks included) with the throughput it makes."""
    found: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):  # missing or damaged: none
        report = json.loads(storage.read_text(storage.join(folder, COMPILE_FILE)))
        found = {k: report.get(k) for k in ("compile_s", "attention", "attention_note", "compile_from_cache")}
        found["peak_bytes_per_device"] = (report.get("memory") or {}).get("peak_bytes")
        config = report.get("config") or {}
        found.update({k: config.get(k) for k in ("devices", "per_device_batch")})
        if axes := {axis: config[axis] for axis in MESH_AXES if axis in config}:
            found["mesh"] = describe(axes)
    found = {k: v for k, v in found.items() if v is not None}
    if metrics.get("loss") is not None:
        found["final_train_loss"] = metrics["loss"]
    if rates := step_rates(metrics):
        found.update(ms_per_step=metrics["ms_per_step"], **rates)
    return found


def reported_rows(result: tune.Result) -> list[dict[str, Any]]:
    """The log rows a trial reported to Tune (``step``, ``examples``, ``tokens``, ``loss``) by step,
    from ``Result.metrics_dataframe``; [] without one. The frame holds every attempt's reports: a
    restart's rows replace those at and past the step it resumed from."""
    frame = result.metrics_dataframe
    if frame is None or "loss" not in frame or "step" not in frame:
        return []
    keys = [k for k in ("step", "examples", "tokens", "loss") if k in frame]
    rows: list[dict[str, Any]] = []
    for row in frame[keys].dropna(subset=["step", "loss"]).to_dict("records"):
        while rows and rows[-1]["step"] >= row["step"]:
            rows.pop()
        rows.append(row)
    return rows


def with_checkpoint(row: dict[str, Any], recorded: str | None, history_from: str | None = None) -> TrialRows:
    """``row`` with its trial's ``checkpoint`` (None: none) and, when there is one, the count and MiB of
    the kept checkpoints beside it (after Ray's retention), and the history rows of ``history_from``
    (default: that checkpoint; the newest holds every row)."""
    row["checkpoint"] = recorded
    if not recorded:
        return row, []
    try:
        row["checkpoints_kept"], row["checkpoints_mib"] = checkpoint.disk_use(recorded.rpartition("/")[0])
        history = storage.read_text(storage.join(history_from or recorded, HISTORY_FILE))
    except OSError as err:  # the summary is written without them
        print(f"warning: {row['trial']}: its checkpoints cannot be read: {err}", file=terminal.err())
        history = None
    return row, json.loads(history) if history else []
