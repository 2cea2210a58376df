"""python -m jaxray.tune --config tune_configs/NAME.yaml: the main job.
python -m jaxray.tune --resume runs/<experiment>: finish its newest unfinished run.

Each sweep of the experiment YAML becomes one Ray Tune grid over global batch, compute dtype, model
width and peak learning rate; each trial is one Ray Train run (``jaxray.raytrain.trainer``). Every
run writes a new folder ``runs/<experiment>/<YYYYmmdd-HHMMSS>/`` (UTC; ``--out`` names the
experiment folder): the resolved config, summary.json / summary.md, plots, TensorBoard event files
and the trials' Orbax checkpoints.
``--resume`` restores each sweep's Tune experiment: finished trials keep their results, unfinished
ones continue from their newest checkpoint. Joins a running cluster (``RAY_ADDRESS`` or a local
``ray start``), otherwise starts a local Ray in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import ray
import yaml

from jaxray.config import ConfigError, TrialConfig
from jaxray.config.experiment import ExperimentConfig, TrialPlan, load_experiment
from jaxray.data.batching import num_samples
from jaxray.data.manifest import ManifestError
from jaxray.data.sources import DataFileError
from jaxray.data.workloads import load_arrays, parquet_folder
from jaxray.folders import TRAIN_DIR, TUNE_DIR, exclusive
from jaxray.parallel.checks import plan_experiment
from jaxray.raytrain.cluster import check_accelerators, check_storage, init_ray
from jaxray.raytrain.sweep import TrialRows, check_saved_state, run_sweep, with_run_storage
from jaxray.raytrain.trainer import check_scaling
from jaxray.reporting import terminal
from jaxray.reporting.sweep import markdown_summary, write_reports
from jaxray.runs import (
    EXPERIMENT_FILE,
    EXPERIMENT_HEADER,
    LOGS_DIR,
    SUMMARY_MD,
    RunFolderError,
    check_unedited,
    crashed,
    finished,
    has_model,
    latest_run,
    new_run,
    run_folders,
    signed,
    sweep_ranking,
)
from jaxray.storage import written_whole

RESUME = "python -m jaxray.tune --resume"
INTERRUPTED = 130  # exit code of an interrupted run (as a shell reports Ctrl+C)
FULL_DISK_BYTES = 64 << 20  # below this much free space, a sweep that stops is said to have filled the disk


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
        help=f"finish the interrupted run in DIR (a run folder, or an experiment folder such as runs/demo: "
        f"its newest unfinished run), with the config saved there ({EXPERIMENT_FILE}); finished trials "
        f"are kept",
    )
    p.add_argument(
        "--out",
        help="experiment folder: each run writes a new <YYYYmmdd-HHMMSS>/ in it (default: runs/<experiment>)",
    )
    p.add_argument(
        "--data-dir", help="folder with the data files (default: $JAXRAY_DATA_DIR, then the cache)"
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help=f"print Ray's, Tune's and Orbax's output here as it comes (default: a progress display "
        f"here, that output in DIR/{LOGS_DIR}/tune-<time>.log)",
    )
    args = p.parse_args(argv)
    if args.resume is not None and args.out is not None:
        p.error(
            "argument --out: not allowed with argument --resume (a resumed run writes into its own folder)"
        )
    return args


def save_experiment(out: Path, exp: ExperimentConfig) -> Path:
    """Write the resolved experiment config to ``out/experiment.yaml`` (what ``--resume`` reads)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / EXPERIMENT_FILE
    config = exp.model_dump(mode="json")  # data folders already absolute (DataConfig)
    text = yaml.safe_dump(config, sort_keys=False)
    with written_whole(path) as partial:  # never a truncated config
        partial.write_text(
            f"{EXPERIMENT_HEADER}# python -m jaxray.tune --resume <this folder> reads it.\n{signed(text)}",
            encoding="utf-8",
        )
    return path


class NothingToResume(Exception):
    """``--resume`` found no unfinished run: the message says which runs finished (exit 0, no Ray)."""


def resume_target(path: Path) -> Path:
    """The run folder ``--resume path`` finishes: ``path`` itself when it is a run, else the newest
    unfinished run of the experiment folder ``path``, naming on stderr every unfinished run found
    and the one taken. Raises ConfigError when ``path`` holds no run, NothingToResume when the run
    (or every run) finished."""
    if (path / EXPERIMENT_FILE).is_file():
        if finished(path):
            raise NothingToResume(
                f"--resume {path}: the run finished ({path / SUMMARY_MD}), nothing to resume; a new "
                f"run starts with --config"
            )
        return path
    found = run_folders(path)
    if not found:
        what = "no run of python -m jaxray.tune there" if path.exists() else "no such folder"
        raise ConfigError(f"--resume {path}: {what} (a run folder holds {EXPERIMENT_FILE})")
    todo = [run for run in found if not finished(run)]
    if not todo:
        raise NothingToResume(
            f"--resume {path}: its {len(found)} run(s) all finished (newest {found[0].name}), nothing "
            f"to resume; a new run starts with --config"
        )
    others = (
        f"; {len(todo) - 1} older unfinished run(s) stay as they are: "
        f"{', '.join(r.name for r in todo[1:])} (finish one with --resume {path}/<run>)"
        if len(todo) > 1
        else ""
    )
    print(f"--resume {path}: resuming the unfinished run {todo[0].name}{others}", file=sys.stderr)
    return todo[0]


def load_resume(path: Path, overrides: dict[str, Any] | None = None) -> tuple[ExperimentConfig, Path]:
    """(the experiment config saved in the run, its run folder) for ``--resume path``
    (``resume_target``). Raises as ``resume_target``, or ConfigError when the saved config was
    edited or no longer validates."""
    run = resume_target(path)
    check_unedited(run / EXPERIMENT_FILE)
    return load_experiment(run / EXPERIMENT_FILE, overrides), run


def check_batches(exp: ExperimentConfig, firsts: dict[str, TrialConfig], arrays: dict[str, tuple]) -> None:
    """Every grid point's global batch must fit in its sweep's training rows (``arrays``' train split,
    else the Parquet folder's manifest), or no worker would see a full batch. Raises ConfigError
    naming the sweep and the sizes, or ``data.parquet`` when a folder is missing, damaged (each file
    against its SHA-256, here, once per sweep), holds another dataset or another seq_len."""
    for i, sweep in enumerate(exp.sweeps):
        try:
            rows = (
                parquet_folder(firsts[sweep.workload], verify_checksums=True)[1].samples("train")
                if exp.data.parquet
                else num_samples(arrays[sweep.workload][0])
            )
        except ManifestError as err:
            raise ConfigError(f"data.parquet: {err}") from None
        for batch in sweep.axes()["global_batch"]:
            if batch > rows:
                raise ConfigError(
                    f"sweeps.{i}.search_space.global_batch: {batch} is larger than the "
                    f"{rows} training samples of {sweep.workload}"
                )


def first_trials(plans: list[TrialPlan]) -> dict[str, TrialConfig]:
    """Each sweep's first grid point, by workload (the data settings every point of a sweep shares)."""
    found: dict[str, TrialConfig] = {}
    for _, trial in plans:
        found.setdefault(trial.model.workload, trial)
    return found


def prepare(
    args: argparse.Namespace, stack: contextlib.ExitStack
) -> tuple[ExperimentConfig, Path, dict[str, tuple], list[TrialPlan]]:
    """(the experiment, its run folder, each sweep's (train, held-out) arrays, its plans) once every
    check that can fail on the user's input has passed, all before Ray starts; a new run's folder is
    created (with its experiment.yaml) only then. Ray is up when it returns; the run folder is held
    (``folders.exclusive``) until ``stack`` closes. Raises ConfigError, DataFileError or RunFolderError."""
    overrides = {"data.data_dir": args.data_dir} if args.data_dir else None  # made absolute by DataConfig
    if args.resume is not None:
        exp, out = load_resume(Path(args.resume).absolute(), overrides)
        source = str(out / EXPERIMENT_FILE)
    else:
        exp, out, source = load_experiment(args.config, overrides), None, args.config
    plans = plan_experiment(exp, source)  # handed on: Tune's trials and the workers parse nothing
    check_scaling(exp.workers)
    check_storage(exp)
    firsts = first_trials(plans)
    arrays = {} if exp.data.parquet else {w: load_arrays(trial) for w, trial in firsts.items()}
    check_batches(exp, firsts, arrays)
    if out is None:
        out = new_run(Path(args.out or Path("runs") / exp.experiment))
        exp = with_run_storage(exp, out)
        save_experiment(out, exp)
    stack.enter_context(exclusive(out))
    for sweep in exp.sweeps if args.resume is not None else ():
        check_saved_state(out, sweep.workload)
    if not args.verbose:
        quiet_terminal(out, stack)
    joined, dashboard = init_ray(exp)
    print(header(exp, out, joined, dashboard), file=terminal.err(), flush=True)
    check_accelerators(exp, joined)
    return exp, out, arrays, plans


def quiet_terminal(out: Path, stack: contextlib.ExitStack) -> None:
    """From here until ``stack`` closes, everything but jaxray's own lines goes to the run's log,
    ``out/logs/tune-<time>.log``; a log that cannot be created (a full disk) leaves the terminal as
    it is, with a warning."""
    log = out / LOGS_DIR / f"tune-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.log"  # UTC, as run folders
    try:
        stack.enter_context(terminal.quiet(log))
    except OSError as err:
        print(f"warning: cannot write the log {log} ({err}); Ray's output follows here", file=sys.stderr)
        return
    stack.callback(ray.shutdown)  # before the log is closed: Ray's last words go there too


def header(exp: ExperimentConfig, out: Path, joined: bool, dashboard: str | None) -> str:
    """The run's first lines on the terminal: what runs, where results and the log go, the cluster."""
    trials = [s.grid_size() for s in exp.sweeps]
    sweeps = ", ".join(f"{s.workload} ({n} trial{'s' * (n != 1)})" for s, n in zip(exp.sweeps, trials))
    cluster = "the joined cluster's" if joined else "a local Ray started for this run"
    lines = [
        f"jaxray.tune: experiment {exp.experiment}, {sum(trials)} trial(s) in {len(exp.sweeps)} "
        f"sweep(s): {sweeps}",
        f"results: {out}" + (f"; checkpoints: {exp.storage}" if exp.storage else ""),
        f"dashboard: {dashboard or 'none'} ({cluster})",
    ]
    if terminal.log_file():
        lines.insert(2, f"log: {terminal.log_file()} (Ray, Tune and Orbax output; --verbose prints it here)")
    return "\n".join(lines)


def report(out: Path, exp: ExperimentConfig, results: list[TrialRows]) -> int:
    """Write the reports of every trial under ``out``, print the summary table; the exit code: 1 if
    a trial failed, else 0."""
    rows = [row for row, _ in results]
    ranking = sweep_ranking(exp.sweeps)
    write_reports(out, rows, {row["trial"]: history for row, history in results}, ranking)
    print(markdown_summary(rows, ranking), file=terminal.out())
    print(f"results in {out}", file=terminal.out())
    failed = [r["trial"] for r in rows if r.get("error")]
    newest = None
    if not failed:  # with a failed trial the hints name this run's folder: no look-up needed
        with contextlib.suppress(RunFolderError):
            newest = latest_run(out.parent)
    hints = next_steps(out if newest != out else out.parent, rows)
    if hints:
        print(hints, file=terminal.out())
    if failed:
        traced = any(map(crashed, rows))  # a diverged trial leaves no error.txt
        tracebacks = f", tracebacks in {out / TUNE_DIR}/<workload>/<trial>/error.txt" if traced else ""
        # --resume trains those again from their newest complete checkpoints (a lost node, a crash).
        again = f"; to run them again from their newest checkpoints: {RESUME} {out}" if traced else ""
        print(
            f"error: {len(failed)} trial(s) failed: {', '.join(failed)} (their errors are in "
            f"{out / SUMMARY_MD}{tracebacks}{terminal.log_hint()}){again}",
            file=terminal.err(),
        )
        return 1
    return 0


def next_steps(out: Path, rows: list[dict]) -> str:
    """The commands that use the run's results (``out``: its folder, or the experiment folder that
    resolves to it): each workload's best trial's (the transformer's: generate and serve too);
    empty when no trial finished."""
    here = Path.cwd()
    folder = shlex.quote(str(out.relative_to(here) if out.is_relative_to(here) else out))
    done = {r["workload"] for r in rows if has_model(r)}
    if not done:
        return ""
    lines = ["next:"]
    if "transformer" in done:
        lines += [
            f'  python -m jaxray.generate --checkpoint {folder} --prompt "ROMEO:"',
            f"  python -m jaxray.serve --checkpoint {folder}",
        ]
    lines += [f"  python -m jaxray.evaluate --checkpoint {folder} --workload {w}" for w in sorted(done)]
    return "\n".join(lines)


def run_sweeps(exp: ExperimentConfig, plans: list[TrialPlan], out: Path, arrays: dict, resume: bool) -> int:
    """Run every sweep, then write the reports; the exit code (INTERRUPTED when a sweep was
    interrupted: no later sweep starts and no report is written)."""
    results: list[TrialRows] = []
    for i, sweep in enumerate(exp.sweeps):
        trials = {plan.name: plan.trial for plan in plans if plan.sweep == i}
        rows, unfinished = run_sweep(exp, i, trials, arrays.get(sweep.workload), out, resume)
        results += rows
        if unfinished:
            print(
                f"error: the {sweep.workload} sweep stopped with {unfinished} trial(s) unfinished "
                f"(interrupted, or a trial's driver lost with its node); the state is saved. Resume "
                f"with: {RESUME} {out}",
                file=terminal.err(),
            )
            return INTERRUPTED
    return report(out, exp, results)


def full_disk(out: Path, err: Exception) -> str | None:
    """The message for a sweep stopped by ``err`` while the disk holding ``out`` is full (less than
    ``FULL_DISK_BYTES`` free), else None: Ray Tune and Train fail in ways of their own then, so the
    cause is told from the disk."""
    try:
        free = shutil.disk_usage(out).free
    except OSError:
        return None
    if free >= FULL_DISK_BYTES:
        return None
    return (
        f"the sweep stopped ({type(err).__name__}: {err}) with the disk holding {out} full ({free} bytes "
        f"free); the checkpoints saved before are kept in {out / TRAIN_DIR}. Free space, then "
        f"--resume {out}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        try:
            exp, out, arrays, plans = prepare(args, stack)
        except NothingToResume as err:
            print(err, file=terminal.err())
            return 0
        except (ConfigError, DataFileError, RunFolderError) as err:
            print(f"error: {err}", file=terminal.err())
            ray.shutdown()
            return 2
        except KeyboardInterrupt:
            print("error: interrupted before the run started", file=terminal.err())
            ray.shutdown()
            return INTERRUPTED
        try:
            return run_sweeps(exp, plans, out, arrays, args.resume is not None)
        except KeyboardInterrupt:
            print(f"error: interrupted; the state is saved. Resume with: {RESUME} {out}", file=terminal.err())
            return INTERRUPTED
        except Exception as err:
            message = full_disk(out, err)
            if message is None:
                raise
            print(f"error: {message}", file=terminal.err())
            return 1


if __name__ == "__main__":
    sys.exit(main())
