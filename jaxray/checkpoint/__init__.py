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
checkpoint is damaged, the trial's newest good one is used, with a warning naming the skipped one
(``resolution``; its ``describe`` words the line a command prints for the checkpoint it resolved).
The file names, the digest check every read begins with and the saved configs are ``layout``'s;
the package re-exports the public names of both, so callers import them from here.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from jaxray import runs
from jaxray.checkpoint.digests import array_digest, check_arrays, file_digests
from jaxray.checkpoint.failures import CheckpointError, reading, saving, unchanged
from jaxray.checkpoint.failures import CheckpointSaveError as CheckpointSaveError  # what a failed save raises
from jaxray.checkpoint.layout import ARRAY_TREES as ARRAY_TREES
from jaxray.checkpoint.layout import (
    CHECKSUMS,
    HISTORY_FILE,
    MANIFESTS,
    MODEL_CONFIG,
    OPT_STATE_DIR,
    PARAMS_DIR,
    TRAIN_STATE,
    TRIAL_CONFIG,
    load_model_config,
    open_for_reading,
    require_checkpoint,
    verify,
)
from jaxray.checkpoint.layout import load_trial_config as load_trial_config
from jaxray.checkpoint.layout import manifest_sha256 as manifest_sha256
from jaxray.checkpoint.resolution import describe as describe
from jaxray.checkpoint.resolution import resolve as resolve
from jaxray.checkpoint.resolution import restore_latest as restore_latest
from jaxray.checkpoint.resolution import trial_checkpoints as trial_checkpoints
from jaxray.checkpoint.trees import OPTIMISER_ENTRY, abstract, local_copy, restore_tree, save_tree
from jaxray.config import TrialConfig
from jaxray.models import Model, build

log = logging.getLogger(__name__)


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


def check_outside(out: str | Path, run: bool = False) -> None:
    """Refuse a results folder ``out`` (evaluate's, export's, tune's: ``run``) that is a checkpoint
    folder or lies in one (the nearest of it and its parents holding a digest manifest): its files
    would be mixed into the checkpoint's, and deleted with it when Ray Train rotates checkpoints; or
    that lies in a run folder's train/, tune/ or tensorboard/, which its next ``--overwrite``
    deletes whole (through symlinks too); or, unless it is for a ``run``, that is a run folder,
    whose next ``--resume`` or ``--overwrite`` replaces its summary.json. Raises CheckpointError
    naming both folders."""
    here = Path(out).absolute()
    if not run and runs.written_by_a_run(here / runs.EXPERIMENT_FILE):
        raise CheckpointError(
            f"--out {here} is the run folder of a python -m jaxray.tune run, whose next --resume or "
            f"--overwrite replaces what is written there; choose another --out (nothing was changed)"
        )
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
    require_checkpoint(directory)
    with unchanged(directory, lambda: open_for_reading(directory, again=True)):
        doc = open_for_reading(directory)
        model = build(load_model_config(directory))
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = abstract(jax.eval_shape(model.init, jax.random.key(0)), sharding)
        params = restore_tree(directory / PARAMS_DIR, target, f"the model that {MODEL_CONFIG} describes")
        check_arrays(directory, doc, {PARAMS_DIR: params})
    return model, params
