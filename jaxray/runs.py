"""The run folder of a sweep, ``runs/<experiment>`` (``python -m jaxray.tune --out``): what lives
where, who wrote a summary, and which trial is best.

Layout::

    experiment.yaml          the resolved experiment config, written before the first trial
                             (``--resume`` reads it; so does the best-trial ranking)
    summary.json             one row per trial (``jaxray.reporting.sweep``); its checkpoint paths
                             are relative to the folder (``record_path``)
    summary.md               the same table and the best trial per workload
    throughput_vs_batch.png  throughput against global batch
    loss_curves.png          training loss against examples or tokens
    train/<trial>/           the trial's Ray Train run: its checkpoints and compile.json
    tune/<workload>/         the sweep's Tune experiment state (``Tuner.restore``)
    tensorboard/<trial>/     the trial's TensorBoard event files
    .jaxray.lock             while a run writes into the folder: held by it (``exclusive``)

The best trial of a workload is ranked by the metric its sweep saved in ``experiment.yaml``
(``metric`` and ``mode``, default ``DEFAULT_METRIC``), so ``summary.md`` and a ``--checkpoint
runs/<experiment>`` that loads the best trial (``jaxray.checkpoint.resolve``) agree.

A run folder is relocatable: what it records about its own files is relative to it, so a copy on
another path or machine reads its own checkpoints. A recorded path is never followed outside the
folder (``folder_path``): an absolute one from a folder written before paths were relative is read
as the same path under this folder, from its ``train/`` part on, with a warning naming it; a
symlink inside the folder that leads out of it (``train/`` on scratch storage) is followed, with a
warning naming its target.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import filelock
import yaml
from pydantic import ValidationError

from jaxray.config import ConfigError
from jaxray.config.experiment import DEFAULT_METRIC, ExperimentConfig, SweepConfig

EXPERIMENT_FILE = "experiment.yaml"
EXPERIMENT_HEADER = "# The resolved experiment config of this run, written by python -m jaxray.tune;\n"
SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
THROUGHPUT_PLOT = "throughput_vs_batch.png"
LOSS_PLOT = "loss_curves.png"
FILES = (SUMMARY_JSON, SUMMARY_MD, THROUGHPUT_PLOT, LOSS_PLOT)  # the sweep report's files
TRAIN_DIR, TUNE_DIR, TENSORBOARD_DIR = "train", "tune", "tensorboard"
RUN_DIRS = (TRAIN_DIR, TUNE_DIR, TENSORBOARD_DIR)  # what a run writes besides the files above
LOCK_FILE = ".jaxray.lock"  # held by the one command writing into the folder (``exclusive``)
# One log per python -m jaxray.tune in the folder (Ray's, Tune's, Orbax's output); kept by --overwrite.
LOGS_DIR = "logs"
# experiment.yaml's line holding the SHA-256 of the config below it (``signed``, ``check_unedited``).
CONFIG_DIGEST = "# SHA-256 of the config below it (--resume refuses an edited config): "
COMPILE_FILE = "compile.json"  # in train/<trial>/: what XLA knows about the trial's compiled step
# Ranks a workload that no sweep and no default names (a hand-written row).
FALLBACK_METRIC = ("test_accuracy", "max")

Ranking = dict[str, tuple[str, str]]  # workload -> (metric, "min" | "max")
log = logging.getLogger(__name__)


class RunFolderError(ValueError):
    """A run folder, or one of its files, that cannot be read; the message names the file."""


@contextmanager
def exclusive(run_dir: str | Path, command: str = "python -m jaxray.tune") -> Iterator[Path]:
    """Hold the folder ``run_dir`` (created if missing) for one run of ``command``, the one that
    writes into it (a sweep, an evaluation): an OS lock on ``run_dir/.jaxray.lock`` (``filelock``),
    which the system releases when the process ends, however it ends. A second run into the same
    folder (for a sweep: ``--config``, ``--overwrite`` or ``--resume``) is refused at once, before
    it reads or moves anything, instead of interleaving its files with the first one's. The lock
    file is removed when the run ends, and so are the folders created here that are still empty
    then (the run's checks failed).

    Raises RunFolderError naming the folder when another run holds it or it cannot be created."""
    run_dir = Path(run_dir).absolute()
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderError(f"--out {run_dir} is a file, not a folder")
    created = _first_missing(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(run_dir / LOCK_FILE, timeout=0)
        lock.acquire()
    except filelock.Timeout:
        raise RunFolderError(
            f"another {command} is writing into {run_dir} (it holds {run_dir / LOCK_FILE}); wait for "
            f"it to end, or choose another --out (nothing was changed)"
        ) from None
    except OSError as err:
        _remove_empty(run_dir, created)
        raise RunFolderError(f"--out {run_dir} cannot be written: {err}") from None
    try:
        yield run_dir
    finally:
        # Removed while still held, so the folder is left as the run left it.
        (run_dir / LOCK_FILE).unlink(missing_ok=True)
        lock.release()
        _remove_empty(run_dir, created)


@contextmanager
def written_whole(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` for the block to write; renamed over ``path`` when the block
    ends, removed when it fails: ``path`` is never left part-written (a full disk leaves the earlier
    file, or none)."""
    path = Path(path)
    tmp = path.with_name(f".partial-{path.name}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def removed_if_failed(out: str | Path) -> Iterator[Path]:
    """``out`` (absolute) for a command that writes into it: when the block raises, the folders of
    ``out`` (``out`` included) that did not exist on entry and are empty then are removed, so a
    failed evaluation or export leaves no empty folder behind; the exception goes on."""
    out = Path(out).absolute()
    created = _first_missing(out)
    try:
        yield out
    except BaseException:
        _remove_empty(out, created)
        raise


def _first_missing(out: Path) -> Path | None:
    """The topmost folder of ``out`` (``out`` included) that does not exist yet; None if it exists."""
    return next((p for p in (*reversed(out.parents), out) if not p.exists()), None)


def _remove_empty(out: Path, created: Path | None) -> None:
    """Remove the empty folders from ``out`` up to ``created`` (the topmost one made for it)."""
    for folder in (out, *out.parents) if created is not None else ():
        if folder.is_dir():
            if any(folder.iterdir()):
                return
            folder.rmdir()
        if folder == created:
            return


def written_by_a_run(path: Path) -> bool:
    """True when ``path`` is an experiment.yaml that ``python -m jaxray.tune`` wrote (it starts with
    ``EXPERIMENT_HEADER``), not a config of the user's that happens to have the name."""
    try:
        with path.open("rb") as f:
            return f.read(len(EXPERIMENT_HEADER)) == EXPERIMENT_HEADER.encode()
    except OSError:
        return False


def check_not_nested(out: Path, replaced: Iterable[Path] = ()) -> None:
    """Raise RunFolderError when the run folder ``out`` lies inside another run folder (one above
    it holds experiment.yaml), or when one of the ``replaced`` folders (what ``--overwrite`` sets
    aside, then deletes) holds another run: a run written into another's ``train/`` is deleted with
    it, and a read of the outer folder's checkpoints takes no notice of it (a fresh user saw both)."""
    # Through a symlink too: the folder it leads to is the one written into.
    above = dict.fromkeys((*out.parents, *out.resolve().parents))
    outer = next((p for p in above if written_by_a_run(p / EXPERIMENT_FILE)), None)
    if outer is not None:
        raise RunFolderError(
            f"--out {out} lies in the run folder {outer}: a run there would be deleted with that "
            f"run's results by its next --overwrite; choose a folder outside it (nothing was changed)"
        )
    for folder in replaced:
        inner = next((f for f in folder.rglob(EXPERIMENT_FILE) if written_by_a_run(f)), None)
        if inner is not None:
            raise RunFolderError(
                f"{inner.parent} is another run's folder inside {folder}, which --overwrite would "
                f"delete with the earlier results; move it out of {out} first (nothing was changed)"
            )


def check_overwrite(out_dir: str | Path, writer: str, name: str = SUMMARY_JSON) -> None:
    """Refuse to replace a ``summary.json`` (or ``name``) in ``out_dir`` that ``writer`` (e.g.
    "jaxray.bench") did not write (its ``written_by``), so pointing ``--out`` at a sweep's folder
    cannot destroy its results. Raises ValueError naming the file; a missing file, or one from the
    same writer, passes."""
    path = Path(out_dir) / name
    if not path.exists():
        return
    try:
        owner = json.loads(path.read_text()).get("written_by")
    except (ValueError, AttributeError, OSError):
        owner = None
    if owner != writer:
        raise ValueError(
            f"{path} exists and was not written by {writer}; choose another --out (nothing was changed)"
        )


def signed(config: str) -> str:
    """The YAML text ``config`` after a comment line holding its SHA-256 (``check_unedited``)."""
    return f"{CONFIG_DIGEST}{hashlib.sha256(config.encode()).hexdigest()}\n{config}"


def check_unedited(path: Path) -> None:
    """Raise ConfigError when the config file ``path``, written ``signed``, was edited since: what
    follows its digest line no longer has that SHA-256. A resumed run must train its unfinished
    trials with the config its finished ones had, or one summary would mix two configs. A file
    without the line (written before it existed) passes."""
    try:
        _, found, rest = path.read_text(encoding="utf-8").partition(CONFIG_DIGEST)
    except (OSError, UnicodeDecodeError):  # the config's loader says what is wrong with the file
        return
    if not found:
        return
    recorded, _, config = rest.partition("\n")
    if hashlib.sha256(config.encode()).hexdigest() != recorded.strip():
        raise ConfigError(
            f"{path} was edited after the run started (its content no longer has the SHA-256 "
            f"recorded in it), so a resume would train the unfinished trials with another config "
            f"than the finished ones; undo the edit, or start a new run with --config (nothing was "
            f"changed)"
        )


def sweep_ranking(sweeps: Iterable[SweepConfig]) -> Ranking:
    """Each sweep's workload -> (metric, mode) it ranks its trials by."""
    return {s.workload: (s.metric, s.mode) for s in sweeps}


def saved_ranking(run_dir: str | Path) -> Ranking:
    """The ranking the sweeps of ``run_dir`` saved in its ``experiment.yaml``; empty (every workload
    ranked by ``DEFAULT_METRIC``) when the folder has none. Raises RunFolderError naming the file
    when it is not a valid experiment config."""
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
    """The best of ``rows`` whose ``workload`` it is, by ``ranking_metric(workload, ranking)``: the
    highest or lowest finite value, the first of equal ones. None when no such row has a finite
    value. The one ranking every report and checkpoint look-up uses."""
    metric, mode = ranking_metric(workload, ranking)
    scored = [
        (v, r)
        for r in rows
        if r.get("workload", "?") == workload and (v := metric_value(r, metric)) is not None
    ]
    if not scored:
        return None
    pick = max if mode == "max" else min
    return pick(scored, key=lambda pair: pair[0])[1]


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


def best_checkpoint(run_dir: str | Path, workload: str | None = None) -> Path:
    """The checkpoint of the best trial of ``workload`` in the run folder ``run_dir``: the trial
    ``summary.md`` names (``best_row``). The path is inside ``run_dir`` (``folder_path``). Raises
    RunFolderError as ``best_row`` does, or when the recorded path leads outside the folder."""
    return checkpoint_of(run_dir, best_row(run_dir, workload))


def checkpoint_of(run_dir: str | Path, row: dict[str, Any]) -> Path:
    """The checkpoint the summary ``row`` of the run folder ``run_dir`` names (``folder_path``)."""
    return folder_path(run_dir, row["checkpoint"], f"the checkpoint of trial {row.get('trial')!r}")


def best_row(run_dir: str | Path, workload: str | None = None) -> dict[str, Any]:
    """The summary row of the best trial of ``workload`` in the run folder ``run_dir``: the trial
    ``summary.md`` names (``best_trial`` by the sweep's saved ranking), among those with a
    checkpoint; the first of them when none has a finite value. Default workload: the transformer
    if the sweep has one, else the first by name. Raises RunFolderError naming the file when
    ``summary.json`` or ``experiment.yaml`` cannot be read or no trial of ``workload`` has a
    checkpoint."""
    rows = [r for r in read_summary(run_dir) if r.get("checkpoint") and r.get("workload")]
    workloads = sorted({r["workload"] for r in rows})
    workload = workload or ("transformer" if "transformer" in workloads else next(iter(workloads), None))
    rows = [r for r in rows if r["workload"] == workload]
    if not rows:
        which = f" of workload {workload!r}" if workload else ""
        raise RunFolderError(
            f"{Path(run_dir) / SUMMARY_JSON} has no finished trial with a checkpoint{which}; a failed "
            f"trial's own checkpoints are under {Path(run_dir) / TRAIN_DIR}/<trial>: pass that folder"
        )
    return best_trial(rows, workload, saved_ranking(run_dir)) or rows[0]


def record_path(run_dir: str | Path, path: str | Path) -> str:
    """``path`` as a file of the run folder ``run_dir`` records it: relative to the folder (POSIX
    separators), so the folder can be copied or moved; a path outside the folder stays absolute
    (and ``folder_path`` refuses it)."""
    run_dir, path = Path(run_dir).absolute(), Path(path).absolute()
    for base, target in ((run_dir, path), (run_dir.resolve(), path.resolve())):
        if target.is_relative_to(base):
            return target.relative_to(base).as_posix()
    return str(path)


def in_moved_folder(run_dir: str | Path, path: str | Path) -> Path | None:
    """The path under ``run_dir`` that an absolute ``path`` the run recorded before its folder was
    moved or copied names: ``path`` from its ``train/`` part on, joined to the folder (the first such
    part whose path exists, else the last); None when ``path`` has no ``train/`` part."""
    run_dir, path = Path(run_dir), Path(path)
    tails = [path.parts[i:] for i, part in enumerate(path.parts) if part == TRAIN_DIR]
    if not tails:
        return None
    found = next((run_dir.joinpath(*t) for t in tails if run_dir.joinpath(*t).exists()), None)
    return found or run_dir.joinpath(*tails[-1])


def folder_path(run_dir: str | Path, recorded: str, what: str = "a path") -> Path:
    """The path inside ``run_dir`` that ``recorded`` (a path a file of the folder records, ``what``
    it is) names: a relative one joined to the folder; an absolute one inside the folder as it is;
    an absolute one outside it (a folder written before paths were relative, since copied or
    moved) read as the same path under this folder from its ``train/`` part on (the first that
    exists, else the last), with a warning naming both. Never a path outside the folder, but a
    symlink in it that leads out is followed, with a warning naming its target.

    Raises RunFolderError naming ``summary.json``, ``what`` and the recorded path when it leads out
    of the folder (``..``) or is absolute, outside it and has no ``train/`` part."""
    if not isinstance(recorded, str):  # a hand-edited summary.json: "checkpoint": 5
        raise RunFolderError(f"{Path(run_dir) / SUMMARY_JSON} names {what} as {recorded!r}, not a path")
    run_dir, path = Path(run_dir), Path(recorded)
    refusal = (
        f"{run_dir / SUMMARY_JSON} names {what} as {recorded}, outside the run folder {run_dir}; a "
        f"path outside it is never followed (copy the checkpoint into the folder, or pass it itself)"
    )
    if not path.is_absolute():
        if os.path.normpath(path).split(os.sep)[0] == "..":
            raise RunFolderError(refusal)
        return _named_if_linked_out(run_dir, run_dir / path, what)
    base = run_dir.absolute()
    if path.is_relative_to(base) or path.is_relative_to(base.resolve()):
        return _named_if_linked_out(run_dir, path, what)
    mapped = in_moved_folder(run_dir, path)
    if mapped is None:
        raise RunFolderError(refusal)
    log.warning(
        "%s names %s as %s, outside the run folder (written before run folders were relocatable); "
        "reading it as %s, inside the folder",
        run_dir / SUMMARY_JSON,
        what,
        recorded,
        mapped,
    )
    return _named_if_linked_out(run_dir, mapped, what)


def _named_if_linked_out(run_dir: Path, path: Path, what: str) -> Path:
    """``path``, with a warning naming where it leads when a symlink on it leads out of the run
    folder (train/ linked to scratch storage, say: a copy of the folder would read the original's)."""
    target = path.resolve()
    if not target.is_relative_to(run_dir.resolve()):
        log.warning("%s of %s is %s, a symlink to %s outside the run folder", what, run_dir, path, target)
    return path
