"""Orbax checkpoints of a trained model, and of the whole train state for resuming.

A folder holds ``params/`` (Orbax), ``model_config.json``, ``trial_config.json``; a full train state
adds ``opt_state/`` and ``history.json``. Every process writes and hashes its own files; the primary
then writes ``train_state.json`` by rename, last: the completion marker, with every other file's
SHA-256, the step, data position and final summary row. Every read checks those digests once.
``open`` reads a folder or a URI (``remote`` fetches it); ``folder`` checks and lists the files."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding

from jaxray import storage
from jaxray.checkpoint import remote
from jaxray.checkpoint.folder import (
    CHECKPOINT_PREFIX,
    HISTORY_FILE,
    MODEL_CONFIG,
    OPT_STATE_DIR,
    PARAMS_DIR,
    TRAIN_STATE,
    TRIAL_CONFIG,
    Verified,
    checkpoint_order,
    checkpoints,
    load_model_config,
    load_trial_config,
    verify,
)
from jaxray.checkpoint.remote import (
    StorageError,
    best_of,
    disk_use,
    manifest_sha256,
    ranked_checkpoints,
    source,
)
from jaxray.checkpoint.trees import CheckpointError, CheckpointSaveError, finish, restore_tree, start_saves
from jaxray.config import TrialConfig
from jaxray.models import Model, build

__all__ = [  # re-exported: what the package's users name
    "CHECKPOINT_PREFIX",
    "CheckpointError",
    "CheckpointSaveError",
    "StorageError",
    "best_of",
    "disk_use",
    "load_trial_config",
    "manifest_sha256",
    "ranked_checkpoints",
    "source",
]

log = logging.getLogger(__name__)
# Of a failed save's cause in CheckpointSaveError (the whole is chained to it): Ray keeps the first and
# last 500 characters of a worker's traceback, and a trial's error row shows its last line whole.
MAX_CAUSE_CHARS = 160
DIGESTS_PREFIX = ".digests.process_"  # a process's digests of its own files, for the primary


@contextmanager
def _saving(directory: Path, step: int) -> Iterator[None]:
    """A failure inside becomes CheckpointSaveError naming ``directory`` and ``step``, from the cause
    (Orbax and TensorStore raise ValueErrors or bare Exceptions for a failed write, a full disk too)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - see the docstring
        cause = " ".join(str(err).split())  # one line: a trial's error row shows its last line
        if len(cause) > MAX_CAUSE_CHARS:  # its start and its end (where the errno is)
            cause = f"{cause[: MAX_CAUSE_CHARS // 2]} ... {cause[-MAX_CAUSE_CHARS // 2 :]}"
        raise CheckpointSaveError(
            f"could not save the checkpoint of step {step} in {directory}: {cause}"
        ) from err


@dataclass
class PendingSave:
    """A full train state being written (``start_save_state``); ``commit()`` completes it."""

    directory: Path
    step: int
    checkpointers: list
    doc: dict
    before_manifest: Callable[[], None] | None = None

    def commit(self, manifest: bool = True) -> Path:
        """Wait for every process's writes, then (``manifest``) the primary runs ``before_manifest`` and
        writes ``train_state.json`` (the others send their digests in ``DIGESTS_PREFIX<i>.json``).
        Returns the folder. Raises CheckpointSaveError naming it and the step (the save stays incomplete)."""
        directory, me = self.directory, jax.process_index()
        with _saving(directory, self.step):
            finish(self.checkpointers)
            if not manifest:
                return directory
            digests = {}
            for f in sorted(directory.rglob("*")):
                rel = f.relative_to(directory)
                if not f.is_file() or f.name == TRAIN_STATE or f.name.startswith(DIGESTS_PREFIX):
                    continue
                shard = (re.fullmatch(r"ocdbt\.process_(\d+)", part) for part in rel.parts)
                if next((int(m[1]) for m in shard if m), 0) == me:
                    digests[rel.as_posix()] = storage.file_sha256(f)
            if jax.process_count() > 1:
                if me:
                    (directory / f"{DIGESTS_PREFIX}{me}.json").write_text(json.dumps(digests))
                multihost_utils.sync_global_devices(f"jaxray checkpoint digests {directory.name}")
            if me:
                return directory
            if self.before_manifest is not None:
                self.before_manifest()
            for i in range(1, jax.process_count()):
                part = directory / f"{DIGESTS_PREFIX}{i}.json"
                digests |= json.loads(part.read_text())
                part.unlink()
            tmp = directory / f".{TRAIN_STATE}.tmp"
            tmp.write_text(json.dumps({**self.doc, "files": digests}, indent=1))
            os.replace(tmp, directory / TRAIN_STATE)
            return directory


def start_save_state(
    directory: str | Path,
    state: Any,
    trial: TrialConfig,
    history: list[dict],
    position: dict[str, int],
    before_manifest: Callable[[], None] | None = None,
    summary: dict[str, Any] | None = None,
) -> PendingSave:
    """Start writing ``state`` (params, opt_state, step) under ``directory``, on every process alike;
    ``position``: ``{"epoch", "batch_in_epoch"}`` or {}; ``summary``: the final row. Returns once the
    arrays are in host memory (training may donate them). Raises CheckpointSaveError naming the
    folder and the step."""
    directory = Path(directory).absolute()
    step = state.step.addressable_data(0) if isinstance(state.step, jax.Array) else state.step
    step = int(np.asarray(step))  # replicated: every process holds it
    with _saving(directory, step):
        directory.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:  # the small files first: a full disk stops the save before the arrays
            (directory / MODEL_CONFIG).write_text(trial.model.model_dump_json(indent=2))
            (directory / TRIAL_CONFIG).write_text(trial.model_dump_json(indent=2))
            (directory / HISTORY_FILE).write_text(json.dumps(history))
        checkpointers = start_saves(
            {directory / PARAMS_DIR: state.params, directory / OPT_STATE_DIR: state.opt_state}
        )
    key = np.asarray(jax.random.key_data(jax.random.key(trial.train.seed))).tolist()
    doc = {"step": step, "seed": trial.train.seed, **position, "rng_key_data": key}
    doc |= {"summary": summary} if summary is not None else {}
    return PendingSave(directory, step, checkpointers, doc, before_manifest)


def save_state(*args: Any, **kwargs: Any) -> Path:
    """``start_save_state(*args, **kwargs).commit()``: the committed folder. Raises CheckpointSaveError."""
    return start_save_state(*args, **kwargs).commit()


def open(  # noqa: A001 - checkpoint.open
    ref: str | Path | Verified, full_state: bool = False, pinned: str | None = None
) -> Verified:
    """``ref`` verified, or as it is if it was (``full_state`` checked): a folder, or a URI whose
    local copy is fetched into the cache, each file checked as it arrives (``remote.fetch``).
    ``pinned``: the SHA-256 its ``train_state.json`` had when another process checked it (serving's
    driver, for its replicas): a folder unchanged since is not hashed again (a changed one is verified
    here), a changed URI is refused. Raises as ``verify`` and ``fetch`` do."""
    if not isinstance(ref, Verified):
        ref = _verified(ref, pinned)
    if full_state and "step" not in ref.state:
        raise CheckpointError(f"{ref.path} holds params only, not a train state to resume from")
    return ref


def _verified(ref: str | Path, pinned: str | None) -> Verified:
    """``open``'s folder or URI, verified (a folder whose ``train_state.json`` is ``pinned``: read)."""
    if storage.is_uri(ref):
        entry = remote.fetch(str(ref), pinned)
        return Verified(entry, json.loads((entry / TRAIN_STATE).read_text()))
    path = Path(ref).absolute()
    if pinned:
        with contextlib.suppress(OSError):  # unreadable: verified below, to say why
            manifest = (path / TRAIN_STATE).read_bytes()
            if hashlib.sha256(manifest).hexdigest() == pinned:  # parsed from the bytes it hashed
                return Verified(path, json.loads(manifest))
    return Verified(path, verify(path))


def restore_state(directory: str | Path | Verified, target: Any) -> tuple[Any, dict, list[dict]]:
    """(train state, train_state.json, history), restored into ``target``: ``ShapeDtypeStruct`` leaves
    with the shardings wanted (``jaxray.train.step.abstract_state``). Raises CheckpointError as
    ``verify`` does, or naming the entry and both shapes (another model or optimiser)."""
    opened = open(directory, full_state=True)
    directory, doc = opened.path, opened.state
    params = restore_tree(directory / PARAMS_DIR, target.params, "the model")
    opt_state = restore_tree(directory / OPT_STATE_DIR, target.opt_state, "the optimiser", "optimiser")
    step = jax.device_put(np.asarray(doc["step"], target.step.dtype), target.step.sharding)
    history = json.loads((directory / HISTORY_FILE).read_text())  # verified above
    return target._replace(params=params, opt_state=opt_state, step=step), doc, history


def restore(directory: str | Path | Verified, sharding: Sharding | None = None) -> tuple[Model, Any]:
    """(model, params): the model rebuilt from its config, the params placed by ``sharding`` (default:
    the first local device). Raises CheckpointError as ``verify`` does, or naming the parameter and
    both shapes when they do not fit the model."""
    directory = open(directory).path
    cfg = load_model_config(directory)
    # The attention is how a step runs, not what it holds: a kernel requested for the training device
    # (splash on TPU, cuDNN) is chosen afresh for this one.
    model = build(cfg, attention="auto" if cfg.attention in ("splash", "cudnn") else None)
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes)
    return model, restore_tree(directory / PARAMS_DIR, target, f"the model that {MODEL_CONFIG} describes")


def checkpoint_name(step: int, attempt: int) -> str:
    """Folder name of the checkpoint at ``step`` saved by ``attempt``, unique across restarts (Ray
    Train's rotation must never see one twice)."""
    return f"checkpoint_step_{step:08d}_attempt{attempt}"


def remove_unfinished(trial_dir: Path, but_attempt: int | None = None) -> list[str]:
    """Remove the checkpoint folders in ``trial_dir`` never committed (no ``train_state.json``), except
    those of attempt ``but_attempt``; returns their names."""
    keep = f"_attempt{but_attempt}" if but_attempt is not None else None
    gone = [f for f in checkpoints(trial_dir, complete=False) if keep is None or not f.name.endswith(keep)]
    for folder in gone:
        shutil.rmtree(folder, ignore_errors=True)
    return [folder.name for folder in gone]


def trial_checkpoints(named: Path | str) -> Iterator[Path | str]:
    """``named`` (a folder, or a URI), then the older complete checkpoints beside it, newest first: the
    order a damaged checkpoint is fallen back from. Listed only once ``named`` is passed over (a reader
    allowed to read objects but not to list still reads it)."""
    yield named
    beside = named.parent if isinstance(named, Path) else named.rstrip("/").rpartition("/")[0]
    newest = checkpoint_order(named)
    try:
        older = checkpoints(beside)
    except CheckpointError as err:  # unlistable: ``named``'s own error says why it was passed over
        log.warning("%s", err)
        return
    yield from (c for c in older if checkpoint_order(c) < newest)


def restore_latest(candidates: Iterable[Any], restore: Callable[[Any], Any]) -> tuple[Any, Any]:
    """(``restore(path)``, path) of the first of ``candidates`` (newest first) that does not raise
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
