"""Orbax checkpoints of a trained model, and of the whole train state for resuming.

A folder holds ``params/`` (Orbax), ``model_config.json``, ``trial_config.json``; a full train state
adds ``opt_state/`` and ``history.json``. Every process writes its own shards, in the background
(``trees.start_saves``); after Orbax's commit the primary writes ``train_state.json`` by rename: the
completion marker, with the SHA-256 of every other file, the step, data position and final summary
row. Every read checks those digests once before restoring (``verify``)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding

from jaxray import storage
from jaxray.checkpoint.trees import (
    OPTIMISER_ENTRY,
    CheckpointError,
    CheckpointSaveError,
    abstract,
    finish,
    restore_tree,
    start_saves,
)
from jaxray.config import ModelConfig, TrialConfig
from jaxray.models import Model, build

__all__ = ["CheckpointError", "CheckpointSaveError"]

PARAMS_DIR, OPT_STATE_DIR = "params", "opt_state"
MODEL_CONFIG, TRIAL_CONFIG = "model_config.json", "trial_config.json"
HISTORY_FILE, TRAIN_STATE = "history.json", "train_state.json"
CHECKPOINT_PREFIX = "checkpoint_"  # Ray Train's checkpoint folders: train/<trial>/checkpoint_*
# The metrics a checkpoint records (history rows, final summary) that must be finite (``verify``).
RECORDED_METRICS = (
    *("loss", "grad_norm", "accuracy", "perplexity", "final_train_loss"),
    *("val_loss", "val_accuracy", "val_perplexity", "test_loss", "test_accuracy"),
)
log = logging.getLogger(__name__)
# Of a failed save's cause in CheckpointSaveError (the whole is chained to it): Ray keeps the first and
# last 500 characters of a worker's traceback, and a trial's error row shows its last line whole.
MAX_CAUSE_CHARS = 160
DIGESTS_PREFIX = ".digests.process_"  # a process's digests of its own files, for the primary


def _own_digests(directory: Path) -> dict[str, str]:
    """{path relative to ``directory``: SHA-256} of the files this process wrote: its shards (Orbax's
    ``ocdbt.process_<i>/`` folders); the primary's also every file outside another's shard folder."""
    me, found = jax.process_index(), {}
    for f in sorted(directory.rglob("*")):
        rel = f.relative_to(directory)
        if not f.is_file() or f.name == TRAIN_STATE or f.name.startswith(DIGESTS_PREFIX):
            continue
        owner = next(
            (int(m[1]) for part in rel.parts if (m := re.fullmatch(r"ocdbt\.process_(\d+)", part))), 0
        )
        if owner == me:
            found[rel.as_posix()] = storage.file_sha256(f)
    return found


def _all_digests(directory: Path, before_manifest: Callable[[], None] | None) -> dict[str, str]:
    """Every file's SHA-256, each hashed by the process that wrote it (so no process reads the whole
    state): the others write theirs to ``DIGESTS_PREFIX<i>.json`` and all meet at a barrier; the
    primary then runs ``before_manifest`` and merges them (the others get only their own). Called
    by every process."""
    digests = _own_digests(directory)
    if jax.process_count() > 1:
        if not _primary():
            (directory / f"{DIGESTS_PREFIX}{jax.process_index()}.json").write_text(json.dumps(digests))
        multihost_utils.sync_global_devices(f"jaxray checkpoint digests {directory.name}")
    if not _primary():
        return digests
    if before_manifest is not None:
        before_manifest()
    for i in range(1, jax.process_count()):
        part = directory / f"{DIGESTS_PREFIX}{i}.json"
        digests |= json.loads(part.read_text())
        part.unlink()
    return digests


@contextmanager
def _saving(directory: Path, what: str) -> Iterator[None]:
    """A failure inside becomes CheckpointSaveError naming ``what`` and ``directory``, from the cause
    (Orbax and TensorStore raise ValueErrors or bare Exceptions for a failed write, a full disk too)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - see the docstring
        cause = " ".join(str(err).split())  # one line: a trial's error row shows its last line
        if len(cause) > MAX_CAUSE_CHARS:  # its start and its end (where the errno is)
            cause = f"{cause[: MAX_CAUSE_CHARS // 2]} ... {cause[-MAX_CAUSE_CHARS // 2 :]}"
        raise CheckpointSaveError(f"could not save {what} in {directory}: {cause}") from err


def _primary() -> bool:
    """True in the process that writes a checkpoint's small files (process 0 of the program)."""
    return jax.process_index() == 0


def _write_small(directory: Path, trial: TrialConfig, history: list[dict] | None = None) -> None:
    """The configs (and ``history.json``), from the primary process."""
    if _primary():
        (directory / MODEL_CONFIG).write_text(trial.model.model_dump_json(indent=2))
        (directory / TRIAL_CONFIG).write_text(trial.model_dump_json(indent=2))
        if history is not None:
            (directory / HISTORY_FILE).write_text(json.dumps(history))


def _write_manifest(directory: Path, doc: dict[str, Any], digests: dict[str, str]) -> Path:
    """``train_state.json`` (primary process only): ``doc`` and every other file's SHA-256
    (``digests``), through a temp file and a rename, last: the checkpoint is complete once it exists."""
    if _primary():
        tmp = directory / f".{TRAIN_STATE}.tmp"
        tmp.write_text(json.dumps({**doc, "files": digests}, indent=1))
        os.replace(tmp, directory / TRAIN_STATE)
    return directory


class PendingSave:
    """A full train state being written (``start_save_state``); ``commit()`` completes it."""

    def __init__(self, directory: Path, step: int, checkpointers: list, doc: dict, before_manifest=None):
        self.directory, self.step, self.doc = directory, step, doc
        self._checkpointers, self._before_manifest = checkpointers, before_manifest

    def commit(self, manifest: bool = True) -> Path:
        """Wait for every process's writes and Orbax's commit, then (``manifest``) write
        ``train_state.json`` with every file's digest (``_all_digests``: each process hashes its own),
        ``before_manifest`` on the primary just before it. Returns the folder. Raises
        CheckpointSaveError naming the folder and step; what was written stays incomplete."""
        with _saving(self.directory, f"the checkpoint of step {self.step}"):
            finish(self._checkpointers)
            if not manifest:
                return self.directory
            digests = _all_digests(self.directory, self._before_manifest)
            return _write_manifest(self.directory, self.doc, digests)


def start_save_state(
    directory: str | Path,
    state: Any,
    trial: TrialConfig,
    history: list[dict],
    position: dict[str, int],
    before_manifest: Callable[[], None] | None = None,
    summary: dict[str, Any] | None = None,
) -> PendingSave:
    """Start writing the full train state under ``directory``, called by every process with the same
    arguments: ``state`` a TrainState (params, opt_state, step), ``history`` the log rows so far,
    ``position`` the data position (``{"epoch", "batch_in_epoch"}``, may be empty), ``summary`` the
    final checkpoint's summary row. Returns once the arrays are in host memory (training may go on
    and donate them); ``commit()`` of the result completes it. Raises CheckpointSaveError naming the
    folder and the step."""
    directory = Path(directory).absolute()
    step = state.step.addressable_data(0) if isinstance(state.step, jax.Array) else state.step
    step = int(np.asarray(step))  # replicated: every process holds it
    with _saving(directory, f"the checkpoint of step {step}"):
        directory.mkdir(parents=True, exist_ok=True)
        _write_small(directory, trial, history)  # first: a full disk stops the save before the arrays
        checkpointers = start_saves(
            {directory / PARAMS_DIR: state.params, directory / OPT_STATE_DIR: state.opt_state}
        )
    key = np.asarray(jax.random.key_data(jax.random.key(trial.train.seed))).tolist()
    doc = {"step": step, "seed": trial.train.seed, **position, "rng_key_data": key}
    doc |= {"summary": summary} if summary is not None else {}
    return PendingSave(directory, step, checkpointers, doc, before_manifest)


def save_state(*args: Any, **kwargs: Any) -> Path:
    """``start_save_state(*args, **kwargs).commit()``: the full train state written and committed by
    the time this returns; its folder. Raises CheckpointSaveError naming the folder and the step."""
    return start_save_state(*args, **kwargs).commit()


def verify(directory: str | Path, full_state: bool = False, digests: bool = True) -> dict[str, Any]:
    """``train_state.json`` of ``directory`` once every file it lists matches its SHA-256 (unless not
    ``digests``: where the caller has just checked them as it wrote the files). With
    ``full_state`` it must be a full train state (with a step). Raises CheckpointError naming the
    folder: not a folder, incomplete (no ``train_state.json``: the save never finished), params
    only where a full state is needed, a listed file missing or unreadable, or a file's SHA-256
    differs (naming the file and both digests), or a recorded metric is NaN or inf (naming it)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a checkpoint: no such folder")
    manifest = directory / TRAIN_STATE
    if not manifest.is_file():
        what = "" if (directory / PARAMS_DIR).exists() else f" ({MODEL_CONFIG} and {PARAMS_DIR}/ expected)"
        raise CheckpointError(f"{directory} is incomplete: {TRAIN_STATE} is missing{what}")
    try:
        doc = json.loads(manifest.read_text())
        files = dict(doc["files"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest} is damaged: {err}") from err
    if full_state and "step" not in doc:
        raise CheckpointError(f"{directory} holds params only, not a train state to resume from")
    for rel, expected in files.items() if digests else ():
        try:
            found = storage.file_sha256(directory / rel)
        except OSError as err:
            raise CheckpointError(f"{directory} is damaged: {rel} cannot be read: {err}") from err
        if found != expected:
            raise CheckpointError(
                f"{directory} is damaged: {rel} does not match its checksum (truncated or "
                f"overwritten): {TRAIN_STATE} records SHA-256 {expected}, the file has {found}"
            )
    _check_finite(directory, doc, HISTORY_FILE in files)
    return doc


@dataclass(frozen=True)
class Verified:
    """A checkpoint folder whose files matched their SHA-256 digests once (``open``, a fetch that
    checked them as they arrived, or ``trusted``): ``restore``/``restore_state`` take it and hash
    nothing again. ``state``: its ``train_state.json``."""

    path: Path
    state: dict[str, Any]

    def require(self, workload: str | None, purpose: str = "used") -> ModelConfig:
        """Its model config, once it is of ``workload`` (None: any). Raises CheckpointError naming
        the folder, both workloads and ``purpose`` (what the command does: served, sampled...)."""
        cfg = load_model_config(self.path)
        if workload is not None and cfg.workload != workload:
            raise CheckpointError(
                f"{self.path} holds a {cfg.workload} checkpoint, not a {workload} one: it cannot be {purpose}"
            )
        return cfg


def open(ref: str | Path | Verified, full_state: bool = False) -> Verified:  # noqa: A001 - checkpoint.open
    """``ref`` verified (``verify``), or as it is when it already was (``full_state`` checked). Raises
    CheckpointError as ``verify`` does."""
    if isinstance(ref, Verified):
        if full_state and "step" not in ref.state:
            raise CheckpointError(f"{ref.path} holds params only, not a train state to resume from")
        return ref
    path = Path(ref).absolute()
    return Verified(path, verify(path, full_state))


def trusted(path: str | Path, manifest_sha256: str) -> Verified:
    """The checkpoint at ``path`` that another process verified, unless its ``train_state.json`` no
    longer has that process's ``manifest_sha256`` (then it is verified here). Serving's replicas take
    the folder their driver checked this way."""
    path = Path(path).absolute()
    try:
        manifest = (path / TRAIN_STATE).read_bytes()
    except OSError:
        return open(path)
    if hashlib.sha256(manifest).hexdigest() != manifest_sha256:
        return open(path)
    return Verified(path, json.loads(manifest))


def _check_finite(directory: Path, doc: dict[str, Any], has_history: bool) -> None:
    """Raise CheckpointError naming ``directory``, the metric, its value and step when a metric it
    records (the final summary row, the logged rows of ``history.json``) is NaN or inf: the model
    diverged, and its params are no model to sample, evaluate, export, serve or resume."""
    rows = [(doc.get("step"), doc["summary"])] if isinstance(doc.get("summary"), dict) else []
    if has_history:
        try:
            history = json.loads((directory / HISTORY_FILE).read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{directory / HISTORY_FILE} is damaged: {err}") from err
        rows += [(r.get("step"), r) for r in history if isinstance(r, dict)]
    for step, row in rows:
        bad = next((k for k in RECORDED_METRICS if _number(row.get(k)) and not np.isfinite(row[k])), None)
        if bad is not None:
            raise CheckpointError(
                f"{directory} records {bad} {row[bad]} at step {step}: its training diverged, so its "
                f"params are not a usable model; use an earlier checkpoint of the trial or another trial"
            )


def _load_config(directory: str | Path, name: str, cls):
    path = Path(directory) / name
    try:
        return cls.model_validate_json(path.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{directory} is not a jaxray checkpoint: {name} is missing") from err
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is damaged: {err}") from err


def load_model_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig saved beside the params. Raises CheckpointError if missing or invalid."""
    return _load_config(directory, MODEL_CONFIG, ModelConfig)


def load_trial_config(directory: str | Path) -> TrialConfig:
    """The TrialConfig the params were trained with. Raises CheckpointError if missing or invalid."""
    return _load_config(directory, TRIAL_CONFIG, TrialConfig)


def restore_state(directory: str | Path | Verified, target: Any) -> tuple[Any, dict, list[dict]]:
    """(train state, train_state.json, history) of a full-state checkpoint, restored into
    ``target``: the train state as ``jax.ShapeDtypeStruct`` leaves that carry the shardings wanted
    (``jaxray.train.step.abstract_state``; a NamedTuple with ``params``, ``opt_state`` and ``step``).
    Orbax places every array as its target says, so a checkpoint saved on 1 device restores onto a
    mesh of 4 and back. ``directory`` is verified unless a ``Verified``. Raises CheckpointError as
    ``verify`` does, or naming the entry and both shapes for a save of another model or optimiser."""
    opened = open(directory, full_state=True)
    directory, doc = opened.path, opened.state
    params = restore_tree(directory / PARAMS_DIR, target.params, "the model")
    opt_state = restore_tree(directory / OPT_STATE_DIR, target.opt_state, "the optimiser", OPTIMISER_ENTRY)
    step = jax.device_put(np.asarray(doc["step"], target.step.dtype), target.step.sharding)
    history = json.loads((directory / HISTORY_FILE).read_text())  # verified above
    return target._replace(params=params, opt_state=opt_state, step=step), doc, history


def restore(directory: str | Path | Verified, sharding: Sharding | None = None) -> tuple[Model, Any]:
    """(model, params): the model rebuilt from its config, the params restored (``directory``
    verified unless a ``Verified``) into ``jax.eval_shape(model.init)`` targets carrying ``sharding``
    (default: the first local device). Raises CheckpointError as ``verify`` does, or naming the
    parameter and both shapes when the params do not fit the model its config describes."""
    directory = open(directory).path
    cfg = load_model_config(directory)
    # The attention is how a step runs, not what it holds: a kernel requested for the training device
    # (splash on TPU, cuDNN) is chosen afresh for this one.
    model = build(cfg, attention="auto" if cfg.attention in ("splash", "cudnn") else None)
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = abstract(jax.eval_shape(model.init, jax.random.key(0)), sharding)
    return model, restore_tree(directory / PARAMS_DIR, target, f"the model that {MODEL_CONFIG} describes")


def checkpoint_name(step: int, attempt: int) -> str:
    """Folder name of the checkpoint at ``step`` saved by ``attempt``; sorts by step, then attempt.
    The attempt keeps names unique across restarts (Ray Train's rotation must never see one twice)."""
    return f"checkpoint_step_{step:08d}_attempt{attempt}"


def remove_unfinished(trial_dir: Path, but_attempt: int | None = None) -> list[str]:
    """Remove the checkpoint folders in ``trial_dir`` that were begun and never committed (no
    ``train_state.json``: their workers died or were stopped while writing them, and no process is
    left to finish them), except those of attempt ``but_attempt``; their names."""
    keep = f"_attempt{but_attempt}" if but_attempt is not None else None
    gone = []
    for folder in sorted(trial_dir.glob(f"{CHECKPOINT_PREFIX}*")):
        if (keep is None or not folder.name.endswith(keep)) and not (folder / TRAIN_STATE).exists():
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder.name)
    return gone


def checkpoint_order(path: Path | str) -> tuple[int, ...]:
    """The numbers in a checkpoint folder's name, in order (``checkpoint_step_00000020_attempt10``:
    (20, 10)): its place among its trial's checkpoints by step, then attempt (attempt 10 after 9,
    which the names' own order would not give). ``path`` a folder, a URI or a name."""
    return tuple(int(n) for n in re.findall(r"\d+", PurePosixPath(str(path).rstrip("/")).name))


def trial_checkpoints(named: Path) -> list[Path]:
    """``named``, then the older ``checkpoint_*`` folders beside it (its trial's Ray Train folder),
    newest first (``checkpoint_order``): the order a damaged checkpoint is fallen back from."""
    newest = checkpoint_order(named)
    older = [
        c for c in named.parent.glob(f"{CHECKPOINT_PREFIX}*") if checkpoint_order(c) < newest and c.is_dir()
    ]
    return [named, *sorted(older, key=checkpoint_order, reverse=True)]


def restore_latest(candidates: Iterable[Any], restore: Callable[[Any], Any]) -> tuple[Any, Any]:
    """``restore(path)`` of the first of ``candidates`` (folders or URIs, newest first) that does not raise
    CheckpointError, with a warning naming each one skipped and why. Raises CheckpointError listing
    every reason if none restores."""
    errors = []
    for path in candidates:
        try:
            value = restore(path)
        except CheckpointError as err:
            errors.append(str(err))
            continue
        if errors:
            log.warning("checkpoint skipped: %s; using %s instead", "; ".join(errors), path)
        return value, path
    raise CheckpointError(
        f"no usable checkpoint of the {len(errors)} tried, newest first: " + "; ".join(errors)
    )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
