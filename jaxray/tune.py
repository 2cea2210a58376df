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
run again; unfinished and failed ones run again, from their newest checkpoint when
train.checkpoint_every is set, else from step 0; a sweep that never started runs as usual. The
reports then cover every trial.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import ray
import yaml

import jaxray.raytrain.interrupts as interrupts  # first of jaxray's: records a Ctrl-C during the imports
from jaxray.config import ConfigError, parse_trial
from jaxray.config.experiment import ExperimentConfig, load_experiment
from jaxray.data.batching import num_rows
from jaxray.data.manifest import ManifestError
from jaxray.data.sources import DataFileError
from jaxray.data.workloads import load_arrays, parquet_folder
from jaxray.overwrite import ASIDE_DIR, check_out, finished, full_disk, resume_hint, set_aside, settle_aside
from jaxray.parallel.checks import check_experiment
from jaxray.raytrain.cluster import check_gpus, init_ray
from jaxray.raytrain.sweep import TrialRows, check_saved_state, run_sweep
from jaxray.reporting import terminal
from jaxray.reporting.sweep import markdown_summary, write_reports
from jaxray.runs import (
    EXPERIMENT_FILE,
    EXPERIMENT_HEADER,
    LOGS_DIR,
    SUMMARY_MD,
    TENSORBOARD_DIR,
    TUNE_DIR,
    RunFolderError,
    check_unedited,
    exclusive,
    signed,
    sweep_ranking,
    written_whole,
)

INTERRUPTED = 130  # exit code of an interrupted run (as a shell reports Ctrl+C)


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
        "--verbose",
        action="store_true",
        help=f"print Ray's, Tune's and Orbax's output here as it comes (default: a progress display "
        f"here, that output in DIR/{LOGS_DIR}/tune-<time>.log)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help=f"replace the results of an earlier run in the output folder, kept in DIR/{ASIDE_DIR} until a "
        "trial of the new run has finished (default: refuse)",
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
    with written_whole(path) as partial:  # never a truncated config
        partial.write_text(
            f"{EXPERIMENT_HEADER}# python -m jaxray.tune --resume <this folder> reads it.\n{signed(text)}",
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
    check_unedited(saved)
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
    rows = {}
    for sweep in exp.sweeps:
        trial = parse_trial(sweep.trial_dicts(exp.base())[0])
        try:
            rows[sweep.workload] = parquet_folder(trial)[1].split("train").rows
        except ManifestError as err:
            raise ConfigError(f"data.parquet: {err}") from None
    return rows


def load_sweep_arrays(exp: ExperimentConfig) -> dict[str, tuple]:
    """Each sweep's (train, held-out) arrays, loaded and verified once, before Ray starts.

    Raises DataFileError naming the file when one is missing or damaged.
    """
    return {s.workload: load_arrays(parse_trial(s.trial_dicts(exp.base())[0])) for s in exp.sweeps}


def prepare(
    args: argparse.Namespace, stack: contextlib.ExitStack
) -> tuple[ExperimentConfig, Path, dict[str, tuple], list[Path]]:
    """(the experiment, the output folder, each sweep's arrays, the earlier run's results there that
    ``--overwrite`` replaces) after every check that can fail on the user's input, before the first
    trial starts; Ray is up when it returns. Nothing is moved or written here: the caller sets the
    earlier results aside (``set_aside``) once every check, the cluster's included, has passed. The
    output folder is held (``runs.exclusive``) until ``stack`` closes. Raises ConfigError,
    DataFileError or RunFolderError (another run holds the folder)."""
    resume = args.resume is not None
    overrides = {"data.data_dir": str(Path(args.data_dir).absolute())} if args.data_dir else None
    if resume:  # nothing in the folder is moved or removed
        out = Path(args.resume).absolute()
        exp = load_resume(out, overrides)
        if (out / ASIDE_DIR).is_dir():
            print(
                f"note: {out / ASIDE_DIR} holds the results of an earlier run that an interrupted "
                f"--overwrite set aside; the resume keeps them there (delete the folder once you "
                f"do not need them)",
                file=terminal.err(),
            )
    else:
        exp = load_experiment(args.config, overrides)
        out = Path(args.out or Path("runs") / exp.experiment).absolute()
    check_experiment(exp, str(out / EXPERIMENT_FILE if resume else Path(args.config)))
    stack.enter_context(exclusive(out))
    ours = [] if resume else check_out(out, args.overwrite)
    for sweep in exp.sweeps if resume else ():
        check_saved_state(out, sweep.workload)
    arrays = {} if exp.data.parquet else load_sweep_arrays(exp)
    check_batches(
        exp,
        parquet_rows(exp) if exp.data.parquet else {w: num_rows(train) for w, (train, _) in arrays.items()},
    )
    if not args.verbose:
        quiet_terminal(out, stack)
    joined, dashboard = init_ray(exp)
    print(header(exp, out, joined, dashboard), file=terminal.err(), flush=True)
    check_gpus(exp, joined)
    return exp, out, arrays, ours


def quiet_terminal(out: Path, stack: contextlib.ExitStack) -> None:
    """From here until ``stack`` closes, everything but jaxray's own lines goes to the run's log,
    ``out/logs/tune-<time>.log``; a log that cannot be created (a full disk) leaves the terminal as
    it is, with a warning."""
    log = out / LOGS_DIR / f"tune-{time.strftime('%Y%m%d-%H%M%S')}.log"
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
        f"results: {out}",
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
    print(next_steps(out, rows), file=terminal.out())
    failed = [r["trial"] for r in rows if r.get("error")]
    if failed:
        print(
            f"error: {len(failed)} trial(s) failed: {', '.join(failed)} (their errors are in "
            f"{out / SUMMARY_MD}, tracebacks in {out / TUNE_DIR}/<workload>/<trial>/error.txt"
            f"{terminal.log_hint()})",
            file=terminal.err(),
        )
        return 1
    return 0


def next_steps(out: Path, rows: list[dict]) -> str:
    """The commands that use the run's results: each best trial's (the transformer's: generate and
    serve), and TensorBoard on the event files."""
    here = Path.cwd()
    folder = shlex.quote(str(out.relative_to(here) if out.is_relative_to(here) else out))
    done = {r["workload"] for r in rows if not r.get("error")}
    lines = ["next:"]
    if "transformer" in done:
        lines += [
            f'  python -m jaxray.generate --checkpoint {folder} --prompt "ROMEO:"',
            f"  python -m jaxray.serve --checkpoint {folder}",
        ]
    lines += [f"  python -m jaxray.evaluate --checkpoint {folder} --workload {w}" for w in sorted(done)]
    lines.append(f"  tensorboard --logdir {folder}/{TENSORBOARD_DIR}")
    return "\n".join(lines)


def run_sweeps(exp: ExperimentConfig, out: Path, arrays: dict, resume: bool, results: list[TrialRows]) -> int:
    """Run every sweep, appending each trial's rows to ``results``; the exit code (INTERRUPTED when
    a sweep was interrupted: no later sweep starts and no report is written)."""
    for sweep in exp.sweeps:
        rows, unfinished = run_sweep(exp, sweep, arrays.get(sweep.workload), out, resume)
        results += rows
        if unfinished:
            # With earlier results set aside and no trial finished, settle_aside puts them back.
            print(
                f"error: interrupted with {unfinished} trial(s) of the {sweep.workload} sweep "
                f"unfinished{resume_hint(out, resume, results)}",
                file=terminal.err(),
            )
            return INTERRUPTED
    return report(out, exp, results)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with interrupts.recording():
        stack = contextlib.ExitStack()
        try:
            return _run(args, stack)
        finally:
            with interrupts.shielded():  # a late Ctrl-C while the folder's lock is released
                stack.close()


def _run(args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    """``main`` with the output folder held until ``stack`` closes."""
    resume = args.resume is not None
    try:
        interrupts.stop_if_interrupted()  # a Ctrl-C during the imports was only recorded
        exp, out, arrays, ours = prepare(args, stack)
    except (ConfigError, DataFileError, RunFolderError) as err:
        print(f"error: {err}", file=terminal.err())
        ray.shutdown()
        return 2
    except KeyboardInterrupt:
        print("error: interrupted before the run started; nothing was changed", file=terminal.err())
        ray.shutdown()
        return INTERRUPTED
    results: list[TrialRows] = []
    aside, code = None, None
    try:
        with interrupts.deferred():  # the renames are never left half-done
            aside = set_aside(out, ours)
        if not resume:
            save_experiment(out, exp)
        code = run_sweeps(exp, out, arrays, resume, results)
        if aside is not None and not aside.is_dir():
            print(
                f"error: {out} was moved while the run wrote into it, so it holds part of the new run "
                f"at most; the earlier run's results are in the {ASIDE_DIR}/ of the folder it became",
                file=terminal.err(),
            )
            code = 1
        return code
    except KeyboardInterrupt:  # before Tune took over Ctrl-C: settle_aside decides, as after Tune's
        print(f"error: interrupted{resume_hint(out, resume, results)}", file=terminal.err())
        return INTERRUPTED
    except BaseException as err:
        # A full disk is a failure like a failed trial (settle_aside decides); anything else is a
        # crash, and nothing is decided for the user.
        keeps_new = aside is None or finished(results)
        message = full_disk(out, err, keeps_new) if isinstance(err, Exception) else None
        if message:
            print(f"error: {message}", file=terminal.err())
            return 1
        if aside is not None:
            print(f"error: the earlier run's results are kept in {aside}", file=terminal.err())
            aside = None
        raise
    finally:
        with interrupts.shielded():  # a second Ctrl-C never leaves the put-back or deletion half-done
            settle_aside(out, aside, results, complete=code == 0)


if __name__ == "__main__":
    sys.exit(main())
