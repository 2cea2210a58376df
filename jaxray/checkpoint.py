"""Orbax checkpoints of trained params, and the bridge to Ray Train checkpoints.

Layout of a checkpoint directory::

    params/              Orbax StandardCheckpointer: float32 params (a dict of arrays for the MLPs,
                         ``nnx.state(model, nnx.Param)`` for the transformer)
    model_config.json    the ModelConfig, so a restore rebuilds the model without guessing
    trial_config.json    the whole TrialConfig the params were trained with
    opt_state/           (full train state) Orbax: the Optax state
    history.json         (full train state) every log row so far
    train_state.json     (full train state, written last, atomically) step, data position (epoch,
                         batch in epoch, shuffle seed), the init RNG key's raw data, and the
                         SHA-256 of every other file: a checkpoint without it is incomplete, one
                         whose files do not match it is damaged (``verify``)

A ``runs/<experiment>`` directory also resolves to a checkpoint: its ``summary.json`` names one per
trial and ``resolve`` picks the best of a workload, as ``jaxray.runs`` ranks them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Sharding

from jaxray import runs
from jaxray.config import ModelConfig, TrialConfig
from jaxray.models import Model, build

PARAMS_DIR = "params"
MODEL_CONFIG = "model_config.json"
TRIAL_CONFIG = "trial_config.json"
OPT_STATE_DIR = "opt_state"
HISTORY_FILE = "history.json"
TRAIN_STATE = "train_state.json"
log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A path that is not a usable checkpoint; the message says what was expected."""


def save(directory: str | Path, params: Any, trial: TrialConfig) -> Path:
    """Write ``params`` and the configs under ``directory`` (created; must not hold a checkpoint yet).

    Blocks until Orbax has finalised the write, so the directory is complete when this returns.
    In a multi-process JAX program one process calls it (the params are replicated).
    """
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    _save_tree(directory / PARAMS_DIR, params)
    (directory / MODEL_CONFIG).write_text(trial.model.model_dump_json(indent=2))
    (directory / TRIAL_CONFIG).write_text(trial.model_dump_json(indent=2))
    return directory


def _local_copy(tree: Any) -> Any:
    """This process's copy of a replicated PyTree: host arrays in a multi-process program (whose
    global arrays one process cannot read whole), the tree itself otherwise."""
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else x, tree)


def _abstract(tree: Any, sharding: Sharding) -> Any:
    """ShapeDtypeStructs of ``tree``'s leaves carrying ``sharding``: an Orbax restore target."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def _save_tree(path: Path, tree: Any) -> None:
    """One Orbax StandardCheckpointer save of a replicated PyTree, finalised when this returns."""
    options = ocp.options.MultiprocessingOptions()
    if jax.process_count() > 1:
        # One process of a multi-process program saves alone: its local copy of the replicated
        # arrays, with Orbax's barriers limited to itself (the others never call save).
        me = jax.process_index()
        tree = _local_copy(tree)
        options = ocp.options.MultiprocessingOptions(
            primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"jaxray-save-{me}"
        )
    checkpointer = ocp.StandardCheckpointer(multiprocessing_options=options)
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory: Path) -> dict[str, str]:
    return {
        str(f.relative_to(directory)): _sha256(f)
        for f in sorted(directory.rglob("*"))
        if f.is_file() and f.name != TRAIN_STATE
    }


def save_state(
    directory: str | Path,
    state: Any,
    trial: TrialConfig,
    history: list[dict],
    position: dict[str, int],
    before_manifest: Callable[[], None] | None = None,
) -> Path:
    """Write the full train state under ``directory`` (see the module docstring): ``state`` a
    TrainState (params, opt_state, step), ``history`` the log rows so far, ``position`` the data
    position (``{"epoch", "batch_in_epoch"}``, may be empty). ``train_state.json`` is written last
    (temp file + rename), with the checksum of every other file; ``before_manifest`` runs just
    before it (fault injection: a kill there leaves an incomplete checkpoint). Returns the path."""
    directory = save(directory, state.params, trial)
    _save_tree(directory / OPT_STATE_DIR, state.opt_state)
    (directory / HISTORY_FILE).write_text(json.dumps(history))
    if before_manifest is not None:
        before_manifest()
    doc = {
        "step": int(jax.device_get(_local_copy(state.step))),
        "seed": trial.train.seed,
        **position,
        "rng_key_data": np.asarray(jax.random.key_data(jax.random.key(trial.train.seed))).tolist(),
        "files": _files(directory),
    }
    tmp = directory / f".{TRAIN_STATE}.tmp"
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, directory / TRAIN_STATE)
    return directory


def verify(directory: str | Path) -> dict[str, Any]:
    """``train_state.json`` of a complete, undamaged full-state checkpoint. Raises CheckpointError
    naming the checkpoint and the file when it is incomplete (no ``train_state.json``: the save
    never finished), a listed file is missing, or a file's SHA-256 differs (truncated, damaged)."""
    directory = Path(directory)
    path = directory / TRAIN_STATE
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is incomplete: {TRAIN_STATE} is missing (its save did not finish)"
        )
    try:
        doc = json.loads(path.read_text())
        files = doc["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} is damaged: {err}") from None
    for rel, digest in files.items():
        f = directory / rel
        if not f.is_file():
            raise CheckpointError(f"{directory} is damaged: {rel} is missing")
        if _sha256(f) != digest:
            raise CheckpointError(
                f"{directory} is damaged: {rel} does not match its checksum (truncated or overwritten)"
            )
    return doc


def _names(path: tuple) -> tuple[str, ...]:
    """A PyTree key path as plain names (dict keys, list indices, attributes; NNX's ``value`` dropped),
    so Orbax's metadata tree and an NNX State target compare."""
    names = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return names[:-1] if names and names[-1] == "value" else names


def _check_shapes(path: Path, target: Any) -> None:
    """CheckpointError naming the first parameter whose saved shape differs from ``target``'s."""
    meta = ocp.StandardCheckpointer().metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    saved = {
        _names(k): v
        for k, v in jax.tree_util.tree_flatten_with_path(
            getattr(meta, "tree", meta), is_leaf=lambda x: hasattr(x, "shape")
        )[0]
    }
    for key, want in jax.tree_util.tree_flatten_with_path(target)[0]:
        name = "/".join(_names(key))
        have = saved.get(_names(key))
        if have is None:
            raise CheckpointError(
                f"{path} has no parameter {name} (the model expects shape {tuple(want.shape)})"
            )
        if tuple(have.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{path}: parameter {name} has shape {tuple(have.shape)} in the checkpoint but "
                f"{tuple(want.shape)} in the model (a different model config)"
            )


def restore_state(directory: str | Path, target: Any) -> tuple[Any, dict, list[dict]]:
    """(train state, train_state.json, history) of a full-state checkpoint, restored into
    ``target``: the train state as ``jax.ShapeDtypeStruct`` leaves that carry the shardings wanted
    (``jaxray.train.step.abstract_state``; a NamedTuple with ``params``, ``opt_state`` and
    ``step``, whose type the result has). Orbax places every array as its target says, so a
    checkpoint saved on 1 device restores onto a mesh of 4 and back. Raises CheckpointError when
    the checkpoint is incomplete or damaged (``verify``) or was saved for another model (naming the
    parameter and both shapes)."""
    directory = Path(directory).absolute()
    doc = verify(directory)
    _check_shapes(directory / PARAMS_DIR, target.params)
    checkpointer = ocp.StandardCheckpointer()
    params = checkpointer.restore(directory / PARAMS_DIR, target.params)
    opt_state = checkpointer.restore(directory / OPT_STATE_DIR, target.opt_state)
    step = jax.device_put(np.asarray(doc["step"], target.step.dtype), target.step.sharding)
    history = json.loads((directory / HISTORY_FILE).read_text())
    return target._replace(params=params, opt_state=opt_state, step=step), doc, history


def restore_latest(candidates: Sequence[Path], restore: Callable[[Path], Any]) -> tuple[Any, Path]:
    """``restore(path)`` of the newest candidate that restores (``candidates`` newest first),
    logging a warning that names the damaged one and the one used instead. Raises CheckpointError
    listing every reason if none restores."""
    errors = []
    for path in candidates:
        try:
            value = restore(path)
        except CheckpointError as err:
            errors.append(str(err))
            continue
        if errors:
            log.warning(
                "checkpoint %s could not be used (%s); resuming from %s instead",
                candidates[0],
                errors[0],
                path,
            )
        return value, path
    raise CheckpointError("no usable checkpoint: " + "; ".join(errors))


def _load_config(directory: str | Path, name: str, cls):
    path = Path(directory) / name
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a jaxray checkpoint: {name} is missing")
    try:
        return cls.model_validate_json(path.read_text())
    except ValueError as err:
        raise CheckpointError(f"{path} is damaged: {err}") from None


def load_model_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig saved beside the params. Raises CheckpointError if missing or invalid."""
    return _load_config(directory, MODEL_CONFIG, ModelConfig)


def load_trial_config(directory: str | Path) -> TrialConfig:
    """The TrialConfig the params were trained with. Raises CheckpointError if missing or invalid."""
    return _load_config(directory, TRIAL_CONFIG, TrialConfig)


def restore(directory: str | Path, sharding: Sharding | None = None) -> tuple[Model, Any]:
    """Rebuild the model from its config and restore params into an abstract target.

    The target is ``jax.eval_shape(model.init)``: ShapeDtypeStructs, each given ``sharding`` (default:
    the first local device), so Orbax places the arrays directly where they are wanted.
    Returns ``(model, params)``. Raises CheckpointError if ``directory`` is not a checkpoint, or if
    its params are damaged or do not fit the model its config describes.
    """
    directory = Path(directory).absolute()
    model = build(load_model_config(directory))
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = _abstract(jax.eval_shape(model.init, jax.random.key(0)), sharding)
    if not (directory / PARAMS_DIR).is_dir():
        raise CheckpointError(f"{directory} is not a jaxray checkpoint: {PARAMS_DIR}/ is missing")
    try:
        _check_shapes(directory / PARAMS_DIR, target)  # names the parameter, unlike Orbax's own error
        params = ocp.StandardCheckpointer().restore(directory / PARAMS_DIR, target)
    except Exception as err:  # noqa: BLE001 - Orbax raises bare Exceptions for damaged or mismatched data
        reason = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
        raise CheckpointError(
            f"{directory / PARAMS_DIR} could not be restored into the model that "
            f"{MODEL_CONFIG} describes (a damaged file, or params of another shape): "
            f"{reason[:300]}"
        ) from None
    return model, params


def resolve(path: str | Path, workload: str | None = None) -> Path:
    """A checkpoint directory from ``path``: a checkpoint itself, a Ray Train run folder (its newest
    ``checkpoint_*``), or a ``runs/<experiment>`` run folder: the checkpoint of its best trial of
    ``workload`` (``jaxray.runs.best_checkpoint``: the trial ``summary.md`` names, ranked by the
    metric the sweep saved; default workload: the transformer if the sweep has one).

    Raises CheckpointError naming the path and what was looked for.
    """
    path = Path(path)
    if (path / MODEL_CONFIG).is_file():
        return path
    inside = sorted(p.parent for p in path.glob(f"checkpoint_*/{MODEL_CONFIG}"))
    if inside:  # a Ray Train run folder: its newest checkpoint (names carry a timestamp)
        return inside[-1]
    if not (path / runs.SUMMARY_JSON).is_file():
        raise CheckpointError(
            f"{path} is neither a checkpoint (no {MODEL_CONFIG}) nor an experiment "
            f"directory (no {runs.SUMMARY_JSON})"
        )
    try:
        return runs.best_checkpoint(path, workload)
    except runs.RunFolderError as err:
        raise CheckpointError(str(err)) from None
