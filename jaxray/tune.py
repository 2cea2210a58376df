"""python -m jaxray.tune --config tune_configs/NAME.yaml: the main job.
python -m jaxray.tune --resume runs/<experiment>: finish an interrupted one.

Each sweep of the experiment YAML becomes one Ray Tune grid over global batch, compute dtype and
model width; each trial is one Ray Train run (``jaxray.raytrain.trainer``). Results land in
``runs/<experiment>/`` (``--out``): summary.json / summary.md, plots, TensorBoard event files and the
trials' Orbax checkpoints. Joins a running cluster (``RAY_ADDRESS`` or a local ``ray start``),
otherwise starts a local Ray in-process.

A run first saves its resolved experiment config in the output folder (experiment.yaml). After an
interruption (Ctrl+C, a lost driver) ``--resume DIR`` reads it from there and restores each sweep's
Tune experiment (``Tuner.restore``): finished trials keep their results and checkpoints and are not
run again; unfinished and failed ones run again from the start; a sweep that never started runs as
usual. The reports then cover every trial.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import ray
import ray.data
import yaml
from ray import tune

from jaxray.checkpoint import HISTORY_FILE
from jaxray.config import (
    ConfigError,
    ExperimentConfig,
    SweepConfig,
    TrainConfig,
    load_experiment,
    parse_trial,
)
from jaxray.data.batching import num_rows
from jaxray.data.sources import DataFileError

# Ray Data's per-dataset progress bars would flood the log of every trial.
QUIET_ENV = {"RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
RUN_DIRS = ("train", "tune", "tensorboard")  # what a run writes under --out besides the report files
# The resolved experiment config, saved in the output folder before the first trial: what --resume reads.
EXPERIMENT_FILE = "experiment.yaml"
INTERRUPTED = 130  # exit code of an interrupted run (as a shell reports Ctrl+C)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A log row's keys: the final report carries the last one for schedulers; the summary row does not.
LOG_ROW_KEYS = ("step", "examples", "loss", "accuracy", "grad_norm", "tokens", "perplexity")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxray.tune",
        description=__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", help="experiment YAML, e.g. tune_configs/demo.yaml")
    what.add_argument(
        "--resume",
        metavar="DIR",
        help=f"finish the interrupted run whose output folder is DIR (e.g. runs/demo), with the "
        f"config saved there ({EXPERIMENT_FILE}); finished trials are kept, not run again",
    )
    p.add_argument("--out", help="output folder (default: runs/<experiment>)")
    p.add_argument(
        "--data-dir", help="folder with the data files (default: $JAXRAY_DATA_DIR, then the cache)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results of an earlier run in the output folder (default: refuse)",
    )
    args = p.parse_args(argv)
    if args.resume is not None and args.out is not None:
        p.error("argument --out: not allowed with argument --resume (a resumed run writes into DIR)")
    if args.resume is not None and args.overwrite:
        p.error(
            "argument --overwrite: not allowed with argument --resume (resuming keeps everything in DIR; "
            "to start over use --config FILE --out DIR --overwrite)"
        )
    return args


def prepare_out(out: Path, overwrite: bool) -> None:
    """Refuse an output folder that is a file, or that holds an earlier run's results unless
    ``overwrite``; then remove only what jaxray writes there. Raises ConfigError."""
    from jaxray.reporting.sweep import FILES

    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    ours = [out / name for name in (*FILES, *RUN_DIRS, EXPERIMENT_FILE) if (out / name).exists()]
    if ours and not overwrite:
        resume = f", --resume {out} to finish that run" if (out / EXPERIMENT_FILE).is_file() else ""
        raise ConfigError(
            f"{out} already holds the results of an earlier run ({', '.join(p.name for p in ours)}); "
            f"pass --overwrite to replace them{resume}, or choose another --out"
        )
    for path in ours:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def save_experiment(out: Path, exp: ExperimentConfig) -> Path:
    """Write the resolved experiment config to ``out/experiment.yaml`` (what ``--resume`` reads)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / EXPERIMENT_FILE
    config = exp.model_dump(mode="json")
    for key in ("data_dir", "parquet"):  # a relative folder would change meaning with the working directory
        value = config["data"][key]
        if value is not None and "://" not in value:
            config["data"][key] = str(Path(value).absolute())
    text = yaml.safe_dump(config, sort_keys=False)
    path.write_text(
        f"# The resolved experiment config of this run, written by python -m jaxray.tune;\n"
        f"# python -m jaxray.tune --resume {out} reads it.\n{text}",
        encoding="utf-8",
    )
    return path


def load_resume(out: Path, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """The experiment config saved in the output folder ``out`` of an earlier run. Raises
    ConfigError naming the path when ``out`` is missing, not a folder, or not a jaxray.tune output
    folder (no experiment.yaml), or when the saved config no longer validates."""
    if not out.exists():
        raise ConfigError(f"--resume {out}: no such folder")
    if not out.is_dir():
        raise ConfigError(f"--resume {out} is a file, not a folder")
    saved = out / EXPERIMENT_FILE
    if not saved.is_file():
        raise ConfigError(
            f"--resume {out}: {saved} is missing, so this is not the output folder of a "
            f"python -m jaxray.tune run that can be resumed (a run saves it before its first "
            f"trial)"
        )
    return load_experiment(saved, overrides)


def check_batches(exp: ExperimentConfig, rows: dict[str, int]) -> None:
    """Every grid point's global batch must fit in the training rows (``rows``: per workload);
    otherwise no worker would ever see a full batch. Raises ConfigError naming the sweep and the sizes."""
    for i, sweep in enumerate(exp.sweeps):
        for batch in sweep.axes()["global_batch"]:
            if batch > rows[sweep.workload]:
                raise ConfigError(
                    f"sweeps.{i}.search_space.global_batch: {batch} is larger than the "
                    f"{rows[sweep.workload]} training rows of {sweep.workload}"
                )


def parquet_rows(exp: ExperimentConfig) -> dict[str, int]:
    """Each sweep's training rows from its prepared Parquet folder's manifest (``data.parquet``).
    Raises ConfigError naming ``data.parquet`` when a folder is missing, damaged, holds another
    dataset or another seq_len."""
    from jaxray.data.manifest import ManifestError
    from jaxray.data.workloads import parquet_folder

    rows = {}
    for sweep in exp.sweeps:
        trial = parse_trial(sweep.trial_dicts(exp.base())[0])
        try:
            rows[sweep.workload] = parquet_folder(trial)[1].split("train").rows
        except ManifestError as err:
            raise ConfigError(f"data.parquet: {err}") from None
    return rows


def grid(sweep: SweepConfig) -> dict[str, Any]:
    """Tune's param space: every searchable axis as a grid (a single default value if not searched)."""
    return {axis: tune.grid_search(values) for axis, values in sweep.axes().items()}


def trial_name(workload: str, config: dict[str, Any]) -> str:
    return f"{workload}_b{config['global_batch']}_{config['dtype']}_w{config['width']}"


def run_trial(config: dict[str, Any], sweep: dict, base: dict, datasets: dict, out: str) -> None:
    """Tune function trainable: one Ray Train run whose reports reach Tune via TuneReportCallback."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from jaxray.raytrain.trainer import make_trainer

    sweep_cfg = SweepConfig.model_validate(sweep)
    trial = parse_trial(sweep_cfg.trial_dict(base, config["global_batch"], config["dtype"], config["width"]))
    name = trial_name(sweep_cfg.workload, config)
    make_trainer(
        trial,
        datasets,
        storage_path=Path(out) / "train",
        name=name,
        tensorboard_dir=Path(out) / "tensorboard" / name,
        callbacks=[TuneReportCallback()],
    ).fit()


def load_sweep_arrays(exp: ExperimentConfig) -> dict[str, tuple]:
    """Each sweep's (train, held-out) arrays, loaded and verified once, before Ray starts.

    Raises DataFileError naming the file when one is missing or damaged.
    """
    from jaxray.data.workloads import load_arrays

    return {s.workload: load_arrays(parse_trial(s.trial_dicts(exp.base())[0])) for s in exp.sweeps}


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


def early_stopping(sweep: SweepConfig):
    """The sweep's ASHA scheduler (``sweep.early_stopping``), or None (every trial runs all its
    steps). Trials report ``step`` and the training metrics every ``train.report_interval`` steps;
    ASHA's rungs are in steps, up to the sweep's ``train.steps``."""
    rule = sweep.early_stopping
    if rule is None:
        return None
    from ray.tune.schedulers import ASHAScheduler

    steps = sweep.train.get("steps", TrainConfig().steps)
    return ASHAScheduler(
        time_attr="step",
        metric=rule.metric,
        mode=rule.mode,
        max_t=steps,
        grace_period=min(rule.grace_period, steps),
        reduction_factor=rule.reduction_factor,
    )


def run_sweep(
    exp: ExperimentConfig, sweep: SweepConfig, arrays: tuple | None, out: Path, resume: bool = False
) -> tuple[list[tuple[dict, list[dict]]], int]:
    """Fit one sweep on its (train, held-out) arrays, fed to the workers as Ray Datasets, or (None,
    with ``data.parquet``) on its prepared Parquet folder. With ``resume`` a sweep whose Tune
    experiment exists under ``out/tune/<workload>`` is restored (``Tuner.restore``): its finished
    trials are kept as they are, its unfinished and failed ones run again.

    Returns ((summary row, history rows) per trial, how many trials did not finish because the run
    was interrupted); a failed trial's row carries ``error``.
    """
    from jaxray.data.ray_data import to_dataset

    base = exp.base()
    # With data.parquet each worker streams its rows itself (jaxray.data.parquet): no dataset to pass.
    datasets = {"train": to_dataset(arrays[0]), "eval": to_dataset(arrays[1])} if arrays else {}
    trainable = tune.with_parameters(
        run_trial, sweep=sweep.model_dump(), base=base, datasets=datasets, out=str(out)
    )
    path = out / "tune" / sweep.workload
    if resume and tune.Tuner.can_restore(path):
        # Names, scheduler and concurrency come back from the saved experiment; the trainable (with
        # this session's datasets) is given again. Finished trials are not run again.
        print(f"resuming the {sweep.workload} sweep from {path}", file=sys.stderr)
        tuner = tune.Tuner.restore(str(path), trainable, resume_unfinished=True, resume_errored=True)
        return _fit(sweep, tuner)
    # Trial and run names derive from the grid point and the workload only, so the folders of an
    # interrupted sweep are found again by name (Tuner.restore).
    tuner = tune.Tuner(
        trainable,
        param_space=grid(sweep),
        tune_config=tune.TuneConfig(
            max_concurrent_trials=concurrent_trials(exp, ray.cluster_resources()),
            scheduler=early_stopping(sweep),
            trial_name_creator=lambda t: trial_name(sweep.workload, t.config),
            trial_dirname_creator=lambda t: trial_name(sweep.workload, t.config),
        ),
        run_config=tune.RunConfig(name=sweep.workload, storage_path=str(out / "tune"), verbose=1),
    )
    return _fit(sweep, tuner)


def _fit(sweep: SweepConfig, tuner: tune.Tuner) -> tuple[list[tuple[dict, list[dict]]], int]:
    grid = tuner.fit()
    # On Ctrl+C (SIGINT) Tune saves the experiment's state, then stops the running trials, marking
    # them terminated in memory, and fit() returns as if the sweep had ended. The saved state (what
    # Tuner.restore resumes from) still has them running or pending.
    try:
        saved = tune.ExperimentAnalysis(grid.experiment_path).trials
    except Exception as err:  # Tune already logged why its state was not saved; report what there is
        print(
            f"warning: could not read the saved state of the {sweep.workload} sweep ({err}); "
            f"taking it as complete",
            file=sys.stderr,
        )
        saved = []
    unfinished = sum(t.status not in ("TERMINATED", "ERROR") for t in saved)
    return [_collect(sweep, r) for r in grid], unfinished


def _collect(sweep: SweepConfig, result) -> tuple[dict, list[dict]]:
    # A trial that errored can come back without its config; its folder still carries its name.
    config = result.config or {}
    name = trial_name(sweep.workload, config) if config else Path(result.path or "unknown-trial").name
    row: dict[str, Any] = {"trial": name, "workload": sweep.workload, **config}
    if result.error is not None:
        row["error"] = ANSI.sub("", f"{type(result.error).__name__}: {result.error}").strip()[:2000]
        return row, []
    metrics = result.metrics or {}
    if not metrics.get("final"):
        row["error"] = "trial ended without its final report"
        return row, []
    keep = {
        k: v
        for k, v in metrics.items()
        if k not in ("final", "checkpoint_path", *LOG_ROW_KEYS) and not _tune_key(k)
    }
    checkpoint = metrics.get("checkpoint_path")
    row.update(keep, trial=name, checkpoint=checkpoint)
    history_file = Path(checkpoint or "") / HISTORY_FILE
    return row, json.loads(history_file.read_text()) if history_file.is_file() else []


def _tune_key(key: str) -> bool:
    return key in (
        "timestamp",
        "time_this_iter_s",
        "time_total_s",
        "training_iteration",
        "trial_id",
        "date",
        "pid",
        "hostname",
        "node_ip",
        "time_since_restore",
        "iterations_since_restore",
        "done",
        "config",
        "checkpoint_dir_name",
        "experiment_tag",
    ) or key.startswith("config/")


def running_local_cluster() -> str | None:
    """The address of a live cluster started on this machine with ``ray start``, or None.

    Ray's ``address="auto"`` trusts the address file a ``ray start`` left behind and waits minutes
    for a cluster that was killed; a one-second TCP probe of its GCS port tells live from stale.
    """
    from ray._private.services import canonicalize_bootstrap_address

    try:
        address = canonicalize_bootstrap_address("auto")
    except Exception:  # no address file, or one Ray cannot parse: nothing to join
        return None
    if not address:
        return None
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except (OSError, ValueError):
        return None
    return address


def init_ray(exp: ExperimentConfig) -> bool:
    """Join ``RAY_ADDRESS`` or a live ``ray start`` cluster on this machine; otherwise (or with
    ``RAY_ADDRESS=local``) start a local Ray sized for the sweep. Returns True if it joined a cluster."""
    os.environ.update(QUIET_ENV)
    ray.data.DataContext.get_current().enable_progress_bars = False
    runtime_env = {"env_vars": QUIET_ENV}
    address = os.environ.get("RAY_ADDRESS")
    if (
        not address
        and (address := running_local_cluster())
        and (Path.home() / ".ray" / "auth_token").is_file()
    ):
        # A `ray start` cluster of Ray 2.60 uses token auth; this user's token is the key to it.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    if address and address != "local":
        try:
            ray.init(address=address, runtime_env=runtime_env)
        except Exception as err:  # Ray raises ConnectionError, RuntimeError or its own auth errors
            raise ConfigError(
                f"could not join the Ray cluster at {address}: {type(err).__name__}: {err}\n"
                f"With token auth set RAY_AUTH_MODE=token; to start a private local Ray "
                f"instead set RAY_ADDRESS=local"
            ) from None
        return True
    # One CPU for each trial driver and each worker; Tune queues what does not fit.
    need = (exp.max_concurrent_trials or 1) * (1 + exp.workers.num_workers) + 1
    ray.init(address="local", num_cpus=max(need, os.cpu_count() or 1), runtime_env=runtime_env)
    return False


def check_gpus(exp: ExperimentConfig, joined: bool) -> None:
    """With ``use_gpu`` the workers wait for GPUs; on a cluster that has too few (and, when started
    here, never will) Tune would wait forever, so say so now. A joined cluster may autoscale: warn."""
    w = exp.workers
    if not w.use_gpu:
        return
    have = int(ray.cluster_resources().get("GPU", 0))
    if have >= w.devices_per_worker:
        return
    message = (
        f"workers.use_gpu is true and each worker needs {w.devices_per_worker} GPU(s), but the Ray "
        f"cluster has {have}; set workers.use_gpu: false to train on CPU"
    )
    if not joined:
        raise ConfigError(message)
    print(f"warning: {message}; waiting for the cluster to add GPU nodes", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    resume = args.resume is not None
    overrides = {"data.data_dir": str(Path(args.data_dir).absolute())} if args.data_dir else None
    try:  # every check that can fail on the user's input, before the first trial starts
        if resume:  # nothing in the folder is removed: prepare_out does not run
            out = Path(args.resume).absolute()
            exp = load_resume(out, overrides)
        else:
            exp = load_experiment(args.config, overrides)
            out = Path(args.out or Path("runs") / exp.experiment).absolute()
        arrays = {} if exp.data.parquet else load_sweep_arrays(exp)
        check_batches(
            exp,
            parquet_rows(exp)
            if exp.data.parquet
            else {w: num_rows(train) for w, (train, _) in arrays.items()},
        )
        if not resume:
            prepare_out(out, args.overwrite)
        check_gpus(exp, init_ray(exp))
    except (ConfigError, DataFileError) as err:
        print(f"error: {err}", file=sys.stderr)
        ray.shutdown()
        return 2
    if not resume:
        save_experiment(out, exp)
    results = []
    for sweep in exp.sweeps:
        rows, unfinished = run_sweep(exp, sweep, arrays.get(sweep.workload), out, resume)
        results += rows
        if unfinished:  # interrupted: no later sweep starts and no report is written
            print(
                f"error: interrupted with {unfinished} trial(s) of the {sweep.workload} sweep unfinished; "
                f"the state is saved. Resume with: python -m jaxray.tune --resume {out}",
                file=sys.stderr,
            )
            return INTERRUPTED
    from jaxray.reporting.sweep import markdown_summary, write_reports

    rows = [row for row, _ in results]
    ranking = {s.workload: (s.metric, s.mode) for s in exp.sweeps}
    write_reports(out, rows, {row["trial"]: history for row, history in results}, ranking)
    print(markdown_summary(rows, ranking))
    print(f"\nresults in {out}")
    failed = [r["trial"] for r in rows if r.get("error")]
    if failed:
        print(f"error: {len(failed)} trial(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
