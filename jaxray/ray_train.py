"""Ray Train: the per-worker training loop (an adapter around ``jaxray.train.run.train``) and the
``JaxTrainer`` factory.

Each worker is one JAX process that owns ``devices_per_worker`` devices (GPUs through
``ScalingConfig(use_gpu=True, resources_per_worker={"GPU": k})``, or forced host devices on CPU),
builds a mesh over ``jax.devices()`` and trains on its shard of the ``train`` dataset. On GPU the
JaxTrainer backend initialises ``jax.distributed`` itself, so the worker never does.
"""
from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any, Optional

import numpy as np
import ray.train
from ray.train import Checkpoint, DataConfig, RunConfig, ScalingConfig
from ray.train.v2.jax import JaxTrainer

from jaxray.config import ConfigError, TrialConfig, WorkersConfig, parse_trial

HISTORY_FILE = "history.json"  # every log row of the run, saved with the final checkpoint


def worker_env(workers: WorkersConfig) -> dict[str, str]:
    """Environment for the worker processes, set by Ray before JAX is imported there."""
    # Ray Data's per-dataset progress bars would flood every trial's log.
    quiet = {"RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
    if workers.use_gpu:
        # Several JAX processes may share a GPU in small tests; preallocation would starve them.
        return {**quiet, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    return {**quiet, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={workers.devices_per_worker}"}


def _collect(shard) -> dict[str, np.ndarray]:
    """Every row of an unsplit dataset shard as numpy arrays (the held-out set, small)."""
    parts = list(shard.iter_batches(batch_size=4096, batch_format="numpy"))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _check_local_devices(trial: TrialConfig) -> None:
    import jax

    found = jax.local_device_count()
    if found != trial.workers.devices_per_worker:
        raise ConfigError(f"workers.devices_per_worker is {trial.workers.devices_per_worker} but this worker "
                          f"sees {found} {jax.default_backend()} device(s): {jax.local_devices()}")


def _reporter(every: int, steps: int):
    def report(row: dict[str, float]) -> None:
        if row["step"] % every == 0 and row["step"] != steps:  # the last step goes out with the summary
            ray.train.report(row)

    return report


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point. ``config``: ``{"trial": TrialConfig dict, "tensorboard_dir": str | None}``.

    Reports a log row with ``ray.train.report`` every ``train.report_interval`` steps and, at the end,
    the summary row with an Orbax checkpoint (saved by rank 0, with ``history.json``, every logged
    row) as a ``ray.train.Checkpoint``. Rank 0 also writes TensorBoard events at every log step.
    """
    import jax

    from jaxray import checkpoint
    from jaxray.data.ray_data import shard_batches
    from jaxray.parallel.mesh import make_mesh
    from jaxray.tensorboard import TensorBoardLogger
    from jaxray.train.run import train

    trial = parse_trial(config["trial"])
    _check_local_devices(trial)
    rank = ray.train.get_context().get_world_rank()
    # stdout reaches the driver's console and the Ray dashboard, prefixed with the worker's pid.
    print(f"jaxray worker rank {rank}: JAX process {jax.process_index()} of {jax.process_count()}, "
          f"local devices {jax.local_devices()}", flush=True)
    mesh = make_mesh()
    local_batch = trial.train.global_batch // jax.process_count()
    batches = shard_batches(ray.train.get_dataset_shard("train"), local_batch)
    held_out = _collect(ray.train.get_dataset_shard("eval"))

    tb_dir = config.get("tensorboard_dir") if rank == 0 else None
    with TensorBoardLogger(tb_dir) if tb_dir else contextlib.nullcontext() as tb:
        on_log = [_reporter(trial.train.report_interval, trial.train.steps)] + ([tb] if tb else [])
        result = train(trial, batches, held_out, mesh, on_log=on_log)
        if tb:
            tb.add_final(result.summary, trial.train.steps)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = None
        if rank == 0:
            path = checkpoint.save(Path(tmp) / "checkpoint", result.state.params, trial)
            (path / HISTORY_FILE).write_text(json.dumps(result.history))
            ckpt = Checkpoint.from_directory(path)
        ray.train.report({**result.summary, "final": True}, checkpoint=ckpt)


def _ordered_ingest():
    """Ray Data's ingest options with block order kept: without it the same seed gives a different
    batch order (and loss curve) from run to run."""
    options = DataConfig.default_ingest_options()
    options.preserve_order = True
    return options


def make_trainer(trial: TrialConfig, datasets: dict, storage_path: str | Path, name: str,
                 tensorboard_dir: Optional[str | Path] = None, callbacks: Optional[list] = None) -> JaxTrainer:
    """A JaxTrainer for one trial. ``datasets``: ``{"train": Dataset, "eval": Dataset}``; only
    ``train`` is split across workers, every worker evaluates on all of ``eval``."""
    w = trial.workers
    resources = {"GPU": w.devices_per_worker} if w.use_gpu else {"CPU": 1}
    return JaxTrainer(
        train_loop_per_worker,
        train_loop_config={"trial": trial.model_dump(),
                           "tensorboard_dir": str(tensorboard_dir) if tensorboard_dir else None},
        scaling_config=ScalingConfig(num_workers=w.num_workers, use_gpu=w.use_gpu, resources_per_worker=resources),
        dataset_config=DataConfig(datasets_to_split=["train"], execution_options=_ordered_ingest()),
        datasets=datasets,
        run_config=RunConfig(name=name, storage_path=str(storage_path), callbacks=callbacks or [],
                             worker_runtime_env={"env_vars": worker_env(w)}),
    )
