"""Run folders of ``python -m jaxray.tune``: where a run writes, which run and trial is best, and
which checkpoint a ``--checkpoint`` path means.

Every run writes a new folder, never an earlier one: ``runs/<experiment>/<YYYYmmdd-HHMMSS>/``
(``new_run``) holding ``experiment.yaml`` (the resolved config, ``--resume`` reads it),
``summary.json``/``summary.md`` (one row per trial, checkpoint paths relative to the folder), the
plots, ``train/<trial>/`` (Ray Train's checkpoints), ``tune/<workload>/`` (Tune's state),
``tensorboard/<trial>/`` and ``logs/``. ``runs/<experiment>`` resolves to its newest ``finished``
run with a model of the workload asked for, so a crashed or interrupted run never hides an earlier one."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from jaxray import checkpoint, storage
from jaxray.config import ConfigError
from jaxray.config.experiment import DEFAULT_METRIC, ExperimentConfig, SweepConfig
from jaxray.folders import TRAIN_DIR, RunFolderError

EXPERIMENT_FILE = "experiment.yaml"
EXPERIMENT_HEADER = "# The resolved experiment config of this run, written by python -m jaxray.tune;\n"
SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
THROUGHPUT_PLOT = "throughput_vs_batch.png"
LOSS_PLOT = "loss_curves.png"
FILES = (SUMMARY_JSON, SUMMARY_MD, THROUGHPUT_PLOT, LOSS_PLOT)  # the sweep report's files
LOGS_DIR = "logs"  # one log per python -m jaxray.tune in the folder (Ray's, Tune's, Orbax's output)
# experiment.yaml's line holding the SHA-256 of the config below it (``signed``, ``check_unedited``).
CONFIG_DIGEST = "# SHA-256 of the config below it (--resume refuses an edited config): "
RUN_NAME = re.compile(r"(\d{8}-\d{6})(?:-(\d+))?")  # what ``new_run`` names a run folder
FALLBACK_METRIC = ("test_accuracy", "max")  # ranks a workload no sweep and no default names

Ranking = dict[str, tuple[str, str]]  # workload -> (metric, "min" | "max")


def signed(config: str) -> str:
    """The YAML text ``config`` after a comment line holding its SHA-256 (``check_unedited``)."""
    return f"{CONFIG_DIGEST}{hashlib.sha256(config.encode()).hexdigest()}\n{config}"


def check_unedited(path: Path) -> None:
    """Raise ConfigError when the config file ``path``, written ``signed``, was edited since: a
    resumed run must train its unfinished trials with the config its finished ones had."""
    try:
        _, found, rest = path.read_text(encoding="utf-8").partition(CONFIG_DIGEST)
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} cannot be read: {err}") from err
    recorded, _, config = rest.partition("\n")
    if not found or hashlib.sha256(config.encode()).hexdigest() != recorded.strip():
        raise ConfigError(
            f"{path} was edited after the run started (its content no longer has the SHA-256 "
            f"recorded in it), so a resume would train the unfinished trials with another config "
            f"than the finished ones; undo the edit, or start a new run with --config"
        )


def sweep_ranking(sweeps: Iterable[SweepConfig]) -> Ranking:
    """Each sweep's workload -> (metric, mode) it ranks its trials by."""
    return {s.workload: (s.metric, s.mode) for s in sweeps}


def saved_ranking(run_dir: str | Path) -> Ranking:
    """The ranking saved in ``run_dir/experiment.yaml``; empty (``DEFAULT_METRIC``) without one.
    Raises RunFolderError naming the file when it is not a valid experiment config."""
    path = Path(run_dir) / EXPERIMENT_FILE
    if not path.is_file():
        return {}
    try:
        exp = ExperimentConfig.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValidationError) as err:
        reason = next((ln for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
        raise RunFolderError(
            f"{path} is damaged, so the sweep's ranking metric is unknown: {reason}"
        ) from None
    return sweep_ranking(exp.sweeps)


def ranking_metric(workload: str, ranking: Ranking | None = None) -> tuple[str, str]:
    """(metric, "min" | "max") that ranks ``workload``: ``ranking``'s, else ``DEFAULT_METRIC``'s."""
    return {**DEFAULT_METRIC, **(ranking or {})}.get(workload, FALLBACK_METRIC)


def metric_value(row: dict, metric: str) -> float | None:
    """The row's ``metric`` as a float when it is a finite number; None when missing, not a number,
    NaN or inf (a trial that failed or diverged)."""
    value = row.get(metric)
    if value is None or isinstance(value, (bool, str)):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def best_trial(rows: Iterable[dict], workload: str, ranking: Ranking | None = None) -> dict | None:
    """The row of ``workload`` with the highest or lowest finite ``ranking_metric(workload, ranking)``,
    the first of equal ones; None when none has a finite value. Every report and look-up ranks so."""
    metric, mode = ranking_metric(workload, ranking)
    mine = [r for r in rows if r.get("workload", "?") == workload]
    scored = [(v, r) for r in mine if (v := metric_value(r, metric)) is not None]
    pick = max if mode == "max" else min
    return pick(scored, key=lambda pair: pair[0])[1] if scored else None


def read_summary(run_dir: str | Path) -> list[dict[str, Any]]:
    """The trial rows of ``run_dir/summary.json``. Raises RunFolderError when it is damaged or is
    not a sweep summary (a benchmark's or an evaluation's ``summary.json`` is an object)."""
    path = Path(run_dir) / SUMMARY_JSON
    try:
        doc = json.loads(path.read_text())
    except ValueError as err:
        raise RunFolderError(f"{path} is damaged: {err}") from None
    if not isinstance(doc, list) or not all(isinstance(r, dict) for r in doc):
        raise RunFolderError(f"{path} is not a sweep summary (a list of trials from python -m jaxray.tune)")
    return doc


def checkpoint_of(run_dir: str | Path, row: dict[str, Any]) -> Path | str:
    """The checkpoint the summary ``row`` of ``run_dir`` names: a path relative to the folder (so a
    copied or moved folder reads its own), or a URI (``storage``). Raises RunFolderError otherwise."""
    recorded = row.get("checkpoint")
    if isinstance(recorded, str) and storage.is_uri(recorded):
        return recorded
    path = Path(recorded) if isinstance(recorded, str) else None
    if path is None or path.is_absolute() or ".." in path.parts:
        raise RunFolderError(
            f"{Path(run_dir) / SUMMARY_JSON} names the checkpoint of trial {row.get('trial')!r} as "
            f"{recorded!r}, not a path inside the run folder"
        )
    return Path(run_dir) / path


def record_path(run_dir: str | Path, path: str | Path) -> str:
    """``path`` as ``summary.json`` records it: relative to ``run_dir`` (POSIX separators); one
    outside it, or a URI, stays as it is (and ``checkpoint_of`` refuses the first)."""
    if storage.is_uri(path):
        return str(path)
    path, run_dir = Path(path).absolute(), Path(run_dir).absolute()
    return path.relative_to(run_dir).as_posix() if path.is_relative_to(run_dir) else str(path)


def best_row(run_dir: str | Path, workload: str | None = None) -> dict[str, Any]:
    """The summary row of the best trial of ``workload`` with a checkpoint in ``run_dir`` (``best_trial``
    by the saved ranking, as ``summary.md`` names it). Default workload: the transformer if the sweep
    has one, else the first by name. Raises RunFolderError naming the file when ``summary.json`` or
    ``experiment.yaml`` cannot be read, or no trial of ``workload`` has a checkpoint and a finite metric."""
    every = read_summary(run_dir)
    rows = [r for r in every if has_model(r)]
    workloads = sorted({r["workload"] for r in rows})
    workload = workload or ("transformer" if "transformer" in workloads else next(iter(workloads), None))
    rows = [r for r in rows if r["workload"] == workload]
    if workload and workload not in (trained := sorted({str(r.get("workload")) for r in every})):
        raise RunFolderError(f"{Path(run_dir) / SUMMARY_JSON} has no {workload} trial (trained: {trained})")
    if not rows:
        which = f" of workload {workload!r}" if workload else ""
        raise RunFolderError(
            f"{Path(run_dir) / SUMMARY_JSON} has no finished trial with a checkpoint{which}; a failed "
            f"trial's own checkpoints are under {Path(run_dir) / TRAIN_DIR}/<trial>: pass that folder"
        )
    ranking = saved_ranking(run_dir)
    best = best_trial(rows, workload, ranking)
    if best is None:
        metric = ranking_metric(workload, ranking)[0]
        raise RunFolderError(
            f"{Path(run_dir) / SUMMARY_JSON}: no trial of workload {workload!r} finished with a finite "
            f"{metric} (every one failed or diverged), so none is the best"
        )
    return best


def new_run(experiment_dir: str | Path) -> Path:
    """A new, empty run folder ``experiment_dir/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``... when a run
    started the same second), created with its parents. Raises RunFolderError when ``experiment_dir``
    is a run folder itself (its runs go beside it) or cannot be written."""
    experiment_dir = Path(experiment_dir).absolute()
    if (experiment_dir / EXPERIMENT_FILE).is_file():
        raise RunFolderError(
            f"--out {experiment_dir} is the folder of one run; pass its experiment folder "
            f"{experiment_dir.parent}, where every run gets a folder of its own"
        )
    inside = next(
        (p for p in (experiment_dir, *experiment_dir.parents) if (p / checkpoint.TRAIN_STATE).is_file()), None
    )
    if inside is not None:
        raise RunFolderError(
            f"--out {experiment_dir} lies in the checkpoint folder {inside}; choose another --out"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())  # UTC: names sort in time order
    for n in range(1, 100):
        run = experiment_dir / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            run.mkdir(parents=True)
            return run
        except FileExistsError:
            continue
        except OSError as err:
            raise RunFolderError(f"--out {experiment_dir} cannot be written: {err}") from err
    raise RunFolderError(f"--out {experiment_dir}: too many runs started at {stamp}")


def run_folders(experiment_dir: str | Path) -> list[Path]:
    """The folders of ``experiment_dir`` named as ``new_run`` names them and holding ``experiment.yaml``,
    newest first (a copy kept there under another name is not a run)."""
    found = [
        (m.group(1), int(m.group(2) or 1), p.parent)
        for p in Path(experiment_dir).glob(f"*/{EXPERIMENT_FILE}")
        if (m := RUN_NAME.fullmatch(p.parent.name))
    ]
    return [p for *_, p in sorted(found, reverse=True)]


def crashed(row: dict) -> bool:
    """Whether the summary ``row`` is of a trial that failed other than by diverging (an exception, a
    lost node, no final report): ``--resume`` trains it again."""
    return bool(row.get("error")) and row.get("diverged_step") is None


def finished(run_dir: str | Path) -> bool:
    """Whether the run wrote its summary and no trial crashed (``--resume``, ``--checkpoint``, reports).
    A diverged trial is finished without a model; one ASHA stopped, with the checkpoint it had."""
    try:
        rows = read_summary(run_dir)
    except (OSError, RunFolderError):
        return False
    return not any(map(crashed, rows))


def has_model(row: dict) -> bool:
    """Whether the summary ``row``'s trial left a model to use: a checkpoint, and no error."""
    return bool(row.get("checkpoint")) and bool(row.get("workload")) and not row.get("error")


def latest_run(path: str | Path, workload: str | None = None) -> Path:
    """The newest ``finished`` run of the experiment folder ``path`` with a model of ``workload``
    (``best_row``'s default), or ``path`` itself when it holds no runs but a ``summary.json``. Raises
    RunFolderError naming the folder and what it holds when there is none."""
    return _latest(Path(path), workload)[0]


def _latest(path: Path, workload: str | None) -> tuple[Path, dict | None]:
    """``latest_run`` and, where it took a run for its model, that run's ``best_row`` (else None)."""
    runs = run_folders(path)
    if not runs and (path / SUMMARY_JSON).is_file():
        return path, None
    for run in runs:
        if finished(run):
            with contextlib.suppress(RunFolderError):
                return run, best_row(run, workload)
    if runs:
        which = f" {workload}" if workload else ""
        raise RunFolderError(
            f"{path} has no finished run with a{which} model: of its {len(runs)} run(s), the newest, "
            f"{runs[0].name}, {unusable(runs[0], workload)}; finish a run with python -m jaxray.tune "
            f"--resume {runs[0]}, or pass one of its trials (a folder under {runs[0] / TRAIN_DIR})"
        )
    if (path / EXPERIMENT_FILE).is_file():
        raise RunFolderError(
            f"the run {path} has not finished (no {SUMMARY_JSON}: interrupted, or still running); finish "
            f"it with python -m jaxray.tune --resume {path}, or pass one of its trials (a folder under "
            f"{path / TRAIN_DIR})"
        )
    if not path.exists():
        raise RunFolderError(f"{path} does not exist")
    if path.parent.name == TRAIN_DIR and (path.parent.parent / EXPERIMENT_FILE).is_file():
        raise RunFolderError(trial_without_checkpoint(path))
    raise RunFolderError(
        f"{path} is neither a checkpoint (no {checkpoint.MODEL_CONFIG}), a run folder (no {SUMMARY_JSON}) "
        f"nor an experiment folder holding runs"
    )


def unusable(run: Path, workload: str | None) -> str:
    """Why the run folder ``run`` has no model of ``workload`` to use, in words."""
    try:
        rows = read_summary(run)
    except FileNotFoundError:
        return f"has no {SUMMARY_JSON} (interrupted, or still running)"
    except (OSError, RunFolderError) as err:
        return f"cannot be read ({err})"
    if broken := [r.get("trial", "?") for r in rows if crashed(r)]:
        return f"has trials that crashed ({', '.join(broken)})"
    try:
        best_row(run, workload)
    except RunFolderError as err:
        return str(err).removeprefix(f"{run / SUMMARY_JSON}").lstrip(": ")
    return "holds one"  # not reached: latest_run took it


def trial_without_checkpoint(folder: Path) -> str:
    """What a trial's Ray Train ``folder`` holding no checkpoint is, from its run's summary row."""
    run = folder.parent.parent
    try:
        row = next((r for r in read_summary(run) if r.get("trial") == folder.name), None)
    except (OSError, RunFolderError):
        row = None
    where = f"{folder} is trial {folder.name}'s folder and holds no checkpoint"
    if row is None:
        return f"{where}: the run has no summary row of it (interrupted, or still running)"
    if row.get("diverged_step") is not None:
        return f"{where}: it diverged at step {row['diverged_step']}, before its first save"
    if crashed(row):
        return f"{where}: it failed ({row['error']}); train it again: python -m jaxray.tune --resume {run}"
    return f"{where} (its checkpoints were removed)"


def open_checkpoint(
    path: str | Path | checkpoint.Verified, workload: str | None = None
) -> checkpoint.Verified:
    """The checkpoint ``--checkpoint path`` names, verified once (``checkpoint.open``): a checkpoint
    itself; a trial's folder (Ray Train's or a local run's): its best good ``checkpoint_*`` (lowest
    recorded ``val_loss``; newest without one), else the newest good; a run or experiment folder
    (``latest_run``): its best ``workload`` trial's checkpoint (``best_row``), or, with a warning when
    that is damaged, the trial's newest good older one; a URI: its local copy, checked while fetched.
    Raises CheckpointError naming the path and why."""
    if isinstance(path, checkpoint.Verified) or storage.is_uri(path):
        return checkpoint.open(path)
    path = Path(path)
    if (path / checkpoint.MODEL_CONFIG).is_file():
        return checkpoint.open(path)
    if any(path.glob(f"{checkpoint.CHECKPOINT_PREFIX}*/{checkpoint.MODEL_CONFIG}")):
        # A trial's folder (Ray Train's, or a local run's): its best, then the rest newest first.
        ranked = [Path(c) for c in checkpoint.ranked_checkpoints(str(path))]
        return checkpoint.restore_latest(ranked, checkpoint.open)[0]
    try:
        run, row = _latest(path, workload)
        named = checkpoint_of(run, row or best_row(run, workload))
    except RunFolderError as err:
        raise checkpoint.CheckpointError(str(err)) from err
    # On storage (``storage``) fetched; a damaged one: the trial's newest good older one.
    return checkpoint.restore_latest(checkpoint.trial_checkpoints(named), checkpoint.open)[0]
