"""The ``JaxTrainer`` of one trial: ``make_trainer`` wires the worker (``jaxray.raytrain.worker``),
its datasets, resources and environment, fault tolerance and checkpoint rotation."""

from __future__ import annotations

import os
from pathlib import Path

from pyarrow.fs import LocalFileSystem
from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.v2.jax import JaxTrainer

from jaxray import storage
from jaxray.argtypes import cpu_xla_flags
from jaxray.config import ConfigError, TrialConfig, WorkersConfig
from jaxray.folders import COMPILE_FILE
from jaxray.raytrain.entry import train_loop_per_worker
from jaxray.raytrain.failures import SCORE_KEY, FailureLog
from jaxray.reporting.terminal import QUIET_ENV


def worker_env(workers: WorkersConfig, xla_flags: str | None = None) -> dict[str, str]:
    """Environment of the worker processes (set before JAX is imported there): ``xla_flags`` (None:
    this process's), on CPU with the forced device count. No JAX_PLATFORMS on TPU: Ray's JAX backend
    sets ``tpu`` itself."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    env = dict(QUIET_ENV)
    if workers.accelerator == "cpu":
        return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(workers.devices_per_worker, flags)}
    if workers.accelerator == "gpu":
        # Several JAX processes may share a GPU in small tests; preallocation would starve them.
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return {**env, "XLA_FLAGS": flags} if flags.strip() else env


def scaling_config(w: WorkersConfig) -> ScalingConfig:
    """Per worker one CPU, or ``devices_per_worker`` GPUs or TPU chips (a TPU slice with its topology
    and type)."""
    resources = {"cpu": {"CPU": 1}, "gpu": {"GPU": w.devices_per_worker}}.get(w.accelerator)
    tpu = {"use_tpu": True, "topology": w.topology, "accelerator_type": w.accelerator_type}
    return ScalingConfig(
        num_workers=w.num_workers,
        use_gpu=w.accelerator == "gpu",
        resources_per_worker=resources or {"TPU": w.devices_per_worker},
        **(tpu if w.accelerator == "tpu" else {}),
        **({"elastic_resize_monitor_interval_s": w.elastic_resize_monitor_interval_s} if w.elastic else {}),
    )


def check_scaling(w: WorkersConfig) -> None:
    """ConfigError when Ray Train refuses ``scaling_config(w)`` (a TPU slice whose topology the
    workers do not fill, say), with Ray's reason, before Ray starts."""
    try:
        scaling_config(w)
    except ValueError as err:
        raise ConfigError(f"workers: Ray Train refuses this scaling: {err}") from None


def run_files(storage_path: str | Path, name: str, storage_uri: str | None = None) -> tuple[str, str]:
    """(attempt counter, restart causes): ``name.attempts.json`` and ``name.failures.json`` beside the
    run's folder (Ray Train v2 keeps the folder's own state for itself), in ``storage_uri`` when given
    (every node reads them there), else in ``storage_path``."""
    root = storage_uri or str(Path(storage_path))
    return storage.join(root, f"{name}.attempts.json"), storage.join(root, f"{name}.failures.json")


def make_trainer(
    trial: TrialConfig,
    datasets: dict,
    storage_path: str | Path,
    name: str,
    tensorboard_dir: str | Path | None = None,
    callbacks: list | None = None,
    xla_flags: str | None = None,
    storage_uri: str | None = None,
    train_samples: int | None = None,
) -> JaxTrainer:
    """The JaxTrainer of one trial, run ``storage_path/name`` (``run_files`` beside it). ``datasets``:
    ``{"train": Dataset, "eval": Dataset}`` given whole to every worker ({} with ``data.parquet``).
    ``xla_flags``: the workers' (None: this process's). ``storage_uri``: Ray Train's storage there
    instead (checkpoints at ``storage_uri/name``; the compile report stays in ``storage_path/name``).
    ``train_samples``: the samples an epoch draws from (a checkpoint's epoch and batch in it)."""
    w = trial.workers
    attempts, failures = run_files(storage_path, name, storage_uri)
    root = storage_uri or storage_path
    fs, path = storage.resolve(root) if storage.is_uri(root) else (None, str(root))
    # Object storage: staged on each node, resumed from fetched copies; a folder: written in place.
    staged = storage_uri is not None and fs is not None and not isinstance(fs, LocalFileSystem)
    ingest = DataConfig.default_ingest_options()
    ingest.preserve_order = True  # else the same seed gives another order
    return JaxTrainer(
        train_loop_per_worker,
        train_loop_config={
            "trial": trial,
            "tensorboard_dir": str(tensorboard_dir) if tensorboard_dir else None,
            "attempts_file": str(attempts),
            "failures_file": str(failures),
            "compile_file": str(Path(storage_path) / name / COMPILE_FILE),
            "train_rows": train_samples,
            "trial_uri": storage.join(storage_uri, name) if staged else None,
        },
        scaling_config=scaling_config(w),
        # Unsplit: each worker takes its rows of every global batch (``worker.worker_data``).
        dataset_config=DataConfig(datasets_to_split=[], execution_options=ingest),
        datasets=datasets,
        run_config=RunConfig(
            name=name,
            storage_path=path,
            storage_filesystem=fs,
            callbacks=[*(callbacks or []), FailureLog(failures)],
            worker_runtime_env={"env_vars": worker_env(w, xla_flags)},
            failure_config=FailureConfig(
                max_failures=w.max_failures, max_preemption_failures=w.max_preemption_failures
            ),
            # Ray's retention, the only one (Orbax keeps none of its own): the best
            # ``train.keep_checkpoints`` by ``train.score``'s metric, and always the latest.
            checkpoint_config=CheckpointConfig(
                num_to_keep=trial.train.keep_checkpoints,
                checkpoint_score_attribute=SCORE_KEY,
                checkpoint_score_order=trial.train.score[1],
            ),
        ),
    )
