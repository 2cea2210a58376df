"""Orbax checkpoints of trained params, and the bridge to Ray Train checkpoints.

Layout of a checkpoint directory::

    params/              Orbax StandardCheckpointer: float32 params (a dict of arrays for the MLPs,
                         ``nnx.state(model, nnx.Param)`` for the transformer)
    model_config.json    the ModelConfig, so a restore rebuilds the model without guessing
    trial_config.json    the whole TrialConfig the params were trained with
    opt_state/           (full train state) Orbax: the Optax state
    history.json         (full train state) every log row so far
    train_state.json     (full train state, written last, atomically) step, data position (epoch,
                         batch in epoch, shuffle seed), the init RNG key's raw data, the final
                         checkpoint's summary row (``summary``), the SHA-256 of every other file
                         (``files``) and of the params' and Optax state's arrays (``arrays``): a
                         checkpoint without it is incomplete, one whose files do not match it is
                         damaged (``verify``)
    checksums.json       (params only, ``save``, written last) ``files`` and ``arrays`` of params/

Every read (``restore``: generate, evaluate, export, serve; ``restore_state``: resume) checks each
file against those digests first (``open_for_reading``), and again after the arrays are read
(``failures.unchanged``), and the arrays read are compared with the SHA-256 of the arrays the
save recorded (``trees.array_digest``): a change meanwhile is refused. A params-only checkpoint older than
``checksums.json`` loads unverified, with a warning once per folder. A save or read that fails says
so in words, naming the folder and the cause (``failures``): a full disk is a CheckpointSaveError
"could not save the checkpoint of step 40 in DIR: [Errno 28] No space left on device: FILE".

A ``runs/<experiment>`` directory also resolves to a checkpoint: its ``summary.json`` names one per
trial and ``resolve`` picks the best of a workload, as ``jaxray.runs`` ranks them; when that
checkpoint is damaged, the trial's newest good one is used, with a warning naming the skipped one.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from jaxray import runs
from jaxray.checkpoint.digests import array_digest, check_arrays, check_recorded, file_digests, sha256_all
from jaxray.checkpoint.failures import CheckpointError, reading, saving, unchanged
from jaxray.checkpoint.failures import CheckpointSaveError as CheckpointSaveError  # what a failed save raises
from jaxray.checkpoint.trees import OPTIMISER_ENTRY, abstract, local_copy, restore_tree, save_tree
from jaxray.config import ModelConfig, TrialConfig
from jaxray.models import Model, build

PARAMS_DIR = "params"
MODEL_CONFIG = "model_config.json"
TRIAL_CONFIG = "trial_config.json"
OPT_STATE_DIR = "opt_state"
HISTORY_FILE = "history.json"
TRAIN_STATE = "train_state.json"
CHECKSUMS = "checksums.json"
MANIFESTS = (TRAIN_STATE, CHECKSUMS)  # the files that hold the others' digests
ARRAY_TREES = {TRAIN_STATE: (PARAMS_DIR, OPT_STATE_DIR), CHECKSUMS: (PARAMS_DIR,)}  # what each records
log = logging.getLogger(__name__)
_warned_unverified: set[str] = set()  # folders already named in the "no checksums" warning


def save(directory: str | Path, params: Any, trial: TrialConfig) -> Path:
    """Write ``params`` and the configs under ``directory`` (created; must not hold a checkpoint
    yet), then ``checksums.json`` with every file's SHA-256 (temp file + rename, last).

    Blocks until Orbax has finalised the write, so the directory is complete when this returns.
    In a multi-process JAX program one process calls it (the params are replicated). Raises
    CheckpointSaveError naming the directory and the cause (a full disk: ``[Errno 28] ...``).
    """
    directory = Path(directory).absolute()
    with saving(directory, "the checkpoint"):
        _save_params(directory, params, trial)
        doc = {"arrays": {PARAMS_DIR: array_digest(params)}, "files": file_digests(directory, MANIFESTS)}
        _write_json(directory / CHECKSUMS, doc)
    return directory


def _write_json(path: Path, doc: dict) -> None:
    """``doc`` as JSON at ``path``, through a temp file and a rename: there whole or not at all."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def _save_params(directory: str | Path, params: Any, trial: TrialConfig) -> Path:
    """``params/`` and the two configs under ``directory`` (created); its absolute path."""
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    save_tree(directory / PARAMS_DIR, params)
    (directory / MODEL_CONFIG).write_text(trial.model.model_dump_json(indent=2))
    (directory / TRIAL_CONFIG).write_text(trial.model_dump_json(indent=2))
    return directory


def save_state(
    directory: str | Path,
    state: Any,
    trial: TrialConfig,
    history: list[dict],
    position: dict[str, int],
    before_manifest: Callable[[], None] | None = None,
    summary: dict[str, Any] | None = None,
) -> Path:
    """Write the full train state under ``directory`` (see the module docstring): ``state`` a
    TrainState (params, opt_state, step), ``history`` the log rows so far, ``position`` the data
    position (``{"epoch", "batch_in_epoch"}``, may be empty), ``summary`` the final checkpoint's
    summary row (so that a run resumed from it reports what was measured, not an empty timing:
    ``jaxray.train.run.train``). ``train_state.json`` is written last
    (temp file + rename), with the checksum of every other file; ``before_manifest`` runs just
    before it (fault injection: a kill there leaves an incomplete checkpoint). Returns the path.
    Raises CheckpointSaveError naming the directory, the step and the cause (a full disk:
    ``[Errno 28] No space left on device: FILE``); what was written stays incomplete (no manifest)."""
    directory, step = Path(directory).absolute(), int(jax.device_get(local_copy(state.step)))
    with saving(directory, f"the checkpoint of step {step}"):
        _save_params(directory, state.params, trial)
        save_tree(directory / OPT_STATE_DIR, state.opt_state)
        (directory / HISTORY_FILE).write_text(json.dumps(history))
        if before_manifest is not None:
            before_manifest()
        doc = {
            "step": step,
            "seed": trial.train.seed,
            **position,
            "rng_key_data": np.asarray(jax.random.key_data(jax.random.key(trial.train.seed))).tolist(),
            **({"summary": summary} if summary is not None else {}),
            "arrays": {PARAMS_DIR: array_digest(state.params), OPT_STATE_DIR: array_digest(state.opt_state)},
            "files": file_digests(directory, MANIFESTS),
        }
        _write_json(directory / TRAIN_STATE, doc)
    return directory


def _manifest(directory: Path, full_state: bool) -> tuple[str | None, dict[str, Any]]:
    """(the digest manifest's name, its document) of ``directory``; (None, {}) for a params-only
    checkpoint saved before checksums were recorded. CheckpointError when it is incomplete."""
    name = next((n for n in MANIFESTS if (directory / n).is_file()), None)
    full_state = full_state or any((directory / n).exists() for n in (OPT_STATE_DIR, HISTORY_FILE))
    if full_state and name != TRAIN_STATE:
        raise CheckpointError(
            f"{directory} is incomplete: {TRAIN_STATE} is missing (its save did not finish)"
        )
    if name is None:
        return None, {}
    path = directory / name
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc["files"], dict):
            raise TypeError(f"its files are a {type(doc['files']).__name__}, not an object")
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} is damaged: {err}") from None
    check_recorded(path, doc, ARRAY_TREES[name])
    return name, doc


def open_for_reading(directory: str | Path, full_state: bool = False, again: bool = False) -> dict[str, Any]:
    """The one way a checkpoint is opened for reading: the SHA-256 of every file its save listed is
    checked against that list (``train_state.json``, or ``checksums.json`` of a params-only
    ``save``) before any array is read. Returns the manifest's document (``{}`` for a params-only
    checkpoint older than checksums: loaded unverified, with a warning once per folder). With
    ``again`` (the check after a read, ``failures.unchanged``) the files of a folder whose arrays'
    SHA-256 the manifest records are left out: ``check_arrays`` compares what was read of them.

    Raises CheckpointError naming the checkpoint and the file when it is no folder, is incomplete
    (opt_state/ or history.json without ``train_state.json``: the save never finished; with
    ``full_state`` any checkpoint without it), its manifest is unreadable, a listed file is missing
    or cannot be read (the OS error in words), or a file's SHA-256 differs (the message gives the
    expected and the found digest).
    """
    directory = Path(directory)
    with reading(directory):
        return _check_digests(directory, full_state, again)


def _require_folder(directory: Path) -> None:
    if not directory.is_dir():
        what = "it is a file" if directory.exists() else "no such folder"
        raise CheckpointError(f"{directory} is not a checkpoint: {what}")


def _check_digests(directory: Path, full_state: bool, again: bool) -> dict[str, Any]:
    """``open_for_reading`` less the translation of OS errors into CheckpointError."""
    _require_folder(directory)
    name, doc = _manifest(directory, full_state)
    if name is None:
        if str(directory) not in _warned_unverified:
            _warned_unverified.add(str(directory))
            log.warning(
                "%s has no checksums.json (saved before jaxray wrote one): loaded unverified", directory
            )
        return doc
    listed = [(rel, directory / rel, digest) for rel, digest in doc["files"].items()]
    if again and isinstance(doc.get("arrays"), dict):  # after a read: the arrays' digests cover theirs
        listed = [entry for entry in listed if entry[0].split("/")[0] not in doc["arrays"]]
    missing = next((rel for rel, f, _ in listed if not f.is_file()), None)
    if missing is not None:
        raise CheckpointError(f"{directory} is damaged: {missing} is missing")
    found = sha256_all([f for _, f, _ in listed])
    for (rel, _, expected), got in zip(listed, found, strict=True):
        if got != expected:
            raise CheckpointError(
                f"{directory} is damaged: {rel} does not match its checksum (truncated or "
                f"overwritten): {name} records SHA-256 {expected}, the file has {got}"
            )
    return doc


def verify(directory: str | Path) -> dict[str, Any]:
    """``train_state.json`` of a complete, undamaged full-state checkpoint (``open_for_reading``
    with ``full_state``). Raises CheckpointError naming the checkpoint and the file when it is
    incomplete (no ``train_state.json``: the save never finished), a listed file is missing, or a
    file's SHA-256 differs (truncated, damaged; both digests given)."""
    return open_for_reading(directory, full_state=True)


def check_outside(out: str | Path) -> None:
    """Refuse a results folder ``out`` (evaluate's, export's, tune's) that is a checkpoint folder or
    lies in one (the nearest of it and its parents holding a digest manifest): its files would be
    mixed into the checkpoint's, and deleted with it when Ray Train rotates checkpoints; or that lies
    in a run folder's train/, tune/ or tensorboard/, which its next ``--overwrite`` deletes whole
    (through symlinks too). Raises CheckpointError naming both folders."""
    here = Path(out).absolute()
    above = dict.fromkeys((here, *here.parents, here.resolve(), *here.resolve().parents))
    inside = next((d for d in above if any((d / m).is_file() for m in MANIFESTS)), None)
    if inside is not None:
        raise CheckpointError(
            f"--out {here} {'is' if inside == here else 'lies in'} the checkpoint folder {inside}: "
            f"results there would be mixed into the checkpoint (and deleted with it when Ray Train "
            f"rotates checkpoints); choose another --out (nothing was changed)"
        )
    run = next(
        (
            d
            for d in above
            if d.name in runs.RUN_DIRS and runs.written_by_a_run(d.parent / runs.EXPERIMENT_FILE)
        ),
        None,
    )
    if run is not None:
        raise CheckpointError(
            f"--out {here} lies in {run.name}/ of the run folder {run.parent}, which the next "
            f"--overwrite of that run deletes whole; choose another --out (nothing was changed)"
        )


def restore_state(directory: str | Path, target: Any) -> tuple[Any, dict, list[dict]]:
    """(train state, train_state.json, history) of a full-state checkpoint, restored into
    ``target``: the train state as ``jax.ShapeDtypeStruct`` leaves that carry the shardings wanted
    (``jaxray.train.step.abstract_state``; a NamedTuple with ``params``, ``opt_state`` and
    ``step``, whose type the result has). Orbax places every array as its target says, so a
    checkpoint saved on 1 device restores onto a mesh of 4 and back. Raises CheckpointError when
    the checkpoint is incomplete or damaged (``verify``: naming the file and both digests), cannot
    be read (the cause in words) or was saved for another model or optimiser (naming the entry and
    both shapes)."""
    directory = Path(directory).absolute()
    with unchanged(directory, lambda: open_for_reading(directory, full_state=True, again=True)):
        state, doc, history = _read_state(directory, target, verify(directory))
        check_arrays(directory, doc, {PARAMS_DIR: state.params, OPT_STATE_DIR: state.opt_state})
    return state, doc, history


def _read_state(directory: Path, target: Any, doc: dict) -> tuple[Any, dict, list[dict]]:
    """``restore_state`` once ``doc`` (train_state.json) is verified; alone only in ``jaxray.bench
    checkpoint``, which times what verifying adds."""
    params = restore_tree(directory / PARAMS_DIR, target.params, "the model")
    opt_state = restore_tree(directory / OPT_STATE_DIR, target.opt_state, "the optimiser", OPTIMISER_ENTRY)
    step = jax.device_put(np.asarray(doc["step"], target.step.dtype), target.step.sharding)
    with reading(directory):
        text = (directory / HISTORY_FILE).read_text()
    try:
        history = json.loads(text)
    except ValueError as err:
        raise CheckpointError(f"{directory / HISTORY_FILE} is damaged: {err}") from None
    return target._replace(params=params, opt_state=opt_state, step=step), doc, history


def restore_latest(candidates: Sequence[Path], restore: Callable[[Path], Any]) -> tuple[Any, Path]:
    """``restore(path)`` of the newest candidate that restores (``candidates`` newest first),
    logging a warning that names each one skipped, why, and the one used instead. Raises
    CheckpointError listing every reason if none restores."""
    errors = []
    for path in candidates:
        try:
            value = restore(path)
        except CheckpointError as err:
            errors.append(str(err))  # each names its checkpoint
            continue
        if errors:
            log.warning("checkpoint skipped: %s; using %s instead", "; ".join(errors), path)
        return value, path
    raise CheckpointError(
        f"no usable checkpoint of the {len(errors)} tried, newest first: " + "; ".join(errors)
    )


def _load_config(directory: str | Path, name: str, cls):
    path = Path(directory) / name
    with reading(Path(directory)):  # a file that cannot be opened: the OS error in words
        if not path.is_file():
            raise CheckpointError(f"{directory} is not a jaxray checkpoint: {name} is missing")
        text = path.read_text()
    try:
        return cls.model_validate_json(text)
    except ValueError as err:
        raise CheckpointError(f"{path} is damaged: {err}") from None


def load_model_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig saved beside the params. Raises CheckpointError if missing or invalid."""
    return _load_config(directory, MODEL_CONFIG, ModelConfig)


def load_trial_config(directory: str | Path) -> TrialConfig:
    """The TrialConfig the params were trained with. Raises CheckpointError if missing or invalid."""
    return _load_config(directory, TRIAL_CONFIG, TrialConfig)


def _require_checkpoint(directory: Path) -> None:
    """CheckpointError naming what is missing when ``directory`` is not a jaxray checkpoint."""
    with reading(directory):
        _require_folder(directory)
        for name in (MODEL_CONFIG, PARAMS_DIR):
            if not (directory / name).exists():
                shown = name if name == MODEL_CONFIG else f"{name}/"
                raise CheckpointError(f"{directory} is not a jaxray checkpoint: {shown} is missing")


def restore(directory: str | Path, sharding: Sharding | None = None) -> tuple[Model, Any]:
    """Rebuild the model from its config and restore params into an abstract target, after every
    file is checked against its recorded SHA-256 (``open_for_reading``).

    The target is ``jax.eval_shape(model.init)``: ShapeDtypeStructs, each given ``sharding`` (default:
    the first local device), so Orbax places the arrays directly where they are wanted.
    Returns ``(model, params)``. Raises CheckpointError if ``directory`` is not a checkpoint, is
    incomplete, if a file's SHA-256 differs from the recorded one (naming the file and both
    digests), cannot be read (the OS error in words), or if its params are damaged or do not fit
    the model its config describes (naming the parameter and both shapes).
    """
    directory = Path(directory).absolute()
    _require_checkpoint(directory)
    with unchanged(directory, lambda: open_for_reading(directory, again=True)):
        doc = open_for_reading(directory)
        model = build(load_model_config(directory))
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = abstract(jax.eval_shape(model.init, jax.random.key(0)), sharding)
        params = restore_tree(directory / PARAMS_DIR, target, f"the model that {MODEL_CONFIG} describes")
        check_arrays(directory, doc, {PARAMS_DIR: params})
    return model, params


def _usable(directory: Path) -> Path:  # a checkpoint whose files match their digests
    _require_checkpoint(directory)
    open_for_reading(directory)
    return directory


def trial_checkpoints(named: Path) -> list[Path]:
    """``named``, then the older ``checkpoint_*`` folders beside it (its trial's), newest first; not
    Ray Train's files there (``checkpoint_manager_snapshot.json``), which are no checkpoints."""
    older = sorted(
        (c for c in named.parent.glob("checkpoint_*") if c.name < named.name and c.is_dir()), reverse=True
    )
    return [named, *older]


def resolve(path: str | Path, workload: str | None = None) -> Path:
    """A checkpoint directory from ``path``: a checkpoint itself (as it is: ``restore`` refuses it
    if damaged), a Ray Train run folder (its newest good ``checkpoint_*``), or a
    ``runs/<experiment>`` run folder: the checkpoint of its best trial of ``workload``
    (``jaxray.runs.best_checkpoint``: the trial ``summary.md`` names, ranked by the metric the
    sweep saved; default workload: the transformer if the sweep has one). From a run folder, a
    damaged checkpoint is skipped for the trial's next older good one, with a warning naming it.

    Raises CheckpointError naming the path and what was looked for, or every skipped checkpoint
    and why when none of the trial's is good.
    """
    path = Path(path)
    with reading(path):  # a folder on the way that cannot be opened: the OS error in words
        return _resolve(path, workload)


def _resolve(path: Path, workload: str | None) -> Path:  # ``resolve`` less its OS errors in words
    if (path / MODEL_CONFIG).is_file():
        return path
    inside = sorted(p.parent for p in path.glob(f"checkpoint_*/{MODEL_CONFIG}"))
    if inside:  # a Ray Train run folder: its newest good checkpoint (names sort by step or time)
        return restore_latest(inside[::-1], _usable)[1]
    if not (path / runs.SUMMARY_JSON).is_file():
        raise CheckpointError(
            f"{path} is neither a checkpoint (no {MODEL_CONFIG}) nor an experiment "
            f"directory (no {runs.SUMMARY_JSON})"
        )
    try:
        named = runs.best_checkpoint(path, workload)
    except runs.RunFolderError as err:
        raise CheckpointError(str(err)) from None
    return restore_latest(trial_checkpoints(named), _usable)[1]
