"""Orbax checkpoints of trained params, and the bridge to Ray Train checkpoints.

Layout of a checkpoint directory::

    params/              Orbax StandardCheckpointer: float32 params (a dict of arrays for the MLPs,
                         ``nnx.state(model, nnx.Param)`` for the transformer)
    model_config.json    the ModelConfig, so a restore rebuilds the model without guessing
    trial_config.json    the whole TrialConfig the params were trained with

A ``runs/<experiment>`` directory also resolves to a checkpoint: its ``summary.json`` names one per
trial and ``resolve`` picks the best of a workload.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Sharding

from jaxray.config import DEFAULT_METRIC, ModelConfig, TrialConfig
from jaxray.models import Model, build

PARAMS_DIR = "params"
MODEL_CONFIG = "model_config.json"
TRIAL_CONFIG = "trial_config.json"


class CheckpointError(ValueError):
    """A path that is not a usable checkpoint; the message says what was expected."""


def save(directory: str | Path, params: Any, trial: TrialConfig) -> Path:
    """Write ``params`` and the configs under ``directory`` (created; must not hold a checkpoint yet).

    Blocks until Orbax has finalised the write, so the directory is complete when this returns.
    In a multi-process JAX program one process calls it (the params are replicated).
    """
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    options = ocp.options.MultiprocessingOptions()
    if jax.process_count() > 1:
        # One process of a multi-process program saves alone: its local copy of the replicated
        # params, with Orbax's barriers limited to itself (the others never call save).
        me = jax.process_index()
        params = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else x, params)
        options = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                                     barrier_sync_key_prefix=f"jaxray-save-{me}")
    checkpointer = ocp.StandardCheckpointer(multiprocessing_options=options)
    checkpointer.save(directory / PARAMS_DIR, params)
    checkpointer.wait_until_finished()
    (directory / MODEL_CONFIG).write_text(trial.model.model_dump_json(indent=2))
    (directory / TRIAL_CONFIG).write_text(trial.model_dump_json(indent=2))
    return directory


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


def restore(directory: str | Path, sharding: Optional[Sharding] = None) -> tuple[Model, Any]:
    """Rebuild the model from its config and restore params into an abstract target.

    The target is ``jax.eval_shape(model.init)``: ShapeDtypeStructs, each given ``sharding`` (default:
    the first local device), so Orbax places the arrays directly where they are wanted.
    Returns ``(model, params)``. Raises CheckpointError if ``directory`` is not a checkpoint, or if
    its params are damaged or do not fit the model its config describes.
    """
    directory = Path(directory).absolute()
    model = build(load_model_config(directory))
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                          jax.eval_shape(model.init, jax.random.key(0)))
    if not (directory / PARAMS_DIR).is_dir():
        raise CheckpointError(f"{directory} is not a jaxray checkpoint: {PARAMS_DIR}/ is missing")
    try:
        params = ocp.StandardCheckpointer().restore(directory / PARAMS_DIR, target)
    except Exception as err:  # noqa: BLE001 - Orbax raises bare Exceptions for damaged or mismatched data
        reason = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
        raise CheckpointError(f"{directory / PARAMS_DIR} could not be restored into the model that "
                              f"{MODEL_CONFIG} describes (a damaged file, or params of another shape): "
                              f"{reason[:300]}") from None
    return model, params


def resolve(path: str | Path, workload: Optional[str] = None) -> Path:
    """A checkpoint directory from ``path``: a checkpoint itself, a Ray Train run folder (its newest
    ``checkpoint_*``), or a ``runs/<experiment>`` directory
    whose ``summary.json`` gives the best trial of ``workload`` by its ``DEFAULT_METRIC`` (lowest
    val_loss for the transformer, highest test_accuracy for the MLPs; default workload: the
    transformer if the sweep has one).

    Raises CheckpointError naming the path and what was looked for.
    """
    path = Path(path)
    if (path / MODEL_CONFIG).is_file():
        return path
    inside = sorted(p.parent for p in path.glob(f"checkpoint_*/{MODEL_CONFIG}"))
    if inside:  # a Ray Train run folder: its newest checkpoint (names carry a timestamp)
        return inside[-1]
    summary = path / "summary.json"
    if not summary.is_file():
        raise CheckpointError(f"{path} is neither a checkpoint (no {MODEL_CONFIG}) nor an experiment "
                              f"directory (no summary.json)")
    try:
        doc = json.loads(summary.read_text())
    except ValueError as err:
        raise CheckpointError(f"{summary} is damaged: {err}") from None
    if not isinstance(doc, list) or not all(isinstance(r, dict) for r in doc):
        raise CheckpointError(f"{summary} is not a sweep summary (a list of trials from python -m jaxray.tune)")
    rows = [r for r in doc if r.get("checkpoint") and r.get("workload")]
    workloads = {r["workload"] for r in rows}
    workload = workload or ("transformer" if "transformer" in workloads else next(iter(sorted(workloads)), None))
    rows = [r for r in rows if r["workload"] == workload]
    if not rows:
        raise CheckpointError(f"{summary} has no trial with a checkpoint for workload {workload!r}")
    best = min(rows, key=_rank_key)
    return Path(best["checkpoint"])


def _rank_key(row: dict) -> float:
    """Smaller is better: the workload's default ranking metric (``DEFAULT_METRIC``), missing or
    non-finite values last."""
    metric, mode = DEFAULT_METRIC[row["workload"]]
    value = row.get(metric)
    if value is None or not math.isfinite(value):
        return math.inf
    return -value if mode == "max" else value
