"""The Ray Train worker: ``jaxray.runner.run_trial`` in each worker process. Each worker trains on rows
``[rank * L, (rank + 1) * L)`` of every global batch (L = global_batch / world), from its Ray Train
shard or the Parquet folder, and evaluates on the whole held-out set."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray.train

from jaxray.config import TrialConfig
from jaxray.data.batching import Arrays
from jaxray.data.parquet import parquet_batches, split_arrays
from jaxray.data.ray_data import shard_batches
from jaxray.data.workloads import held_out_split, parquet_folder
from jaxray.parallel.mesh import trial_mesh
from jaxray.raytrain.cluster import check_local_devices, cpu_program, describe_worker
from jaxray.raytrain.failures import read_causes
from jaxray.raytrain.reports import Reports, compile_writer, discard_unfinished, trial_folder
from jaxray.raytrain.resume import ResumePoint, count_attempt, resume_point
from jaxray.raytrain.seams import train_hooks
from jaxray.runner import run_trial

# Every metric a sweep's ASHA may read (Tune checks each report has it), NaN in a diverged trial's.
DIVERGED_METRICS = dict.fromkeys(("loss", "accuracy", "val_loss", "val_accuracy"), float("nan"))


def worker_data(
    trial: TrialConfig, rank: int, world: int, train_rows: int | None
) -> tuple[Iterator[dict[str, np.ndarray]], Arrays, int | None]:
    """(this worker's training batches, endless; the held-out arrays; the training rows if known)
    from ``data.parquet``, else Ray Train's unsplit ``train`` and ``eval`` shards: together what
    ``train_batches(arrays, global_batch)`` gives one process. The batches raise ValueError if the
    dataset holds fewer rows than one global batch."""
    global_batch = trial.train.global_batch
    if trial.data.parquet:
        folder, manifest = parquet_folder(trial)
        seed, max_bytes = trial.train.seed, trial.data.parquet_cache_mib << 20
        batches = parquet_batches(
            folder, "train", global_batch, seed, rank, world, max_bytes=max_bytes, manifest=manifest
        )
        held_out = split_arrays(folder, held_out_split(trial.model.workload), manifest=manifest)
        return batches, held_out, manifest.samples("train")
    local = global_batch // world
    batches = (
        {k: v[rank * local : (rank + 1) * local] for k, v in batch.items()}
        for batch in shard_batches(ray.train.get_dataset_shard("train"), global_batch)
    )
    # The held-out set is small: every row of it as numpy arrays.
    parts = list(ray.train.get_dataset_shard("eval").iter_batches(batch_size=4096, batch_format="numpy"))
    return batches, {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, train_rows


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point; ``config``: ``make_trainer``'s ``train_loop_config``. ``run_trial`` with
    this worker's data and ``Reports`` as its host: a log row every ``train.report_interval`` steps, a
    checkpoint every ``train.checkpoint_interval`` and the summary with the final one; after a
    restart resumes from the newest usable checkpoint. Rank 0 writes TensorBoard events and the
    compile report."""
    trial: TrialConfig = config["trial"]  # parsed and checked once, before Ray started
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    with cpu_program(trial.workers, rank, world):
        check_local_devices(trial.workers)
        attempt = count_attempt(config.get("attempts_file"), world) if rank == 0 else (1, [world])
        print(describe_worker(rank), flush=True)
        start = resume_point(rank, attempt, trial_folder(), config.get("trial_uri"))
        batches, held_out, rows = worker_data(trial, rank, world, config.get("train_rows"))
        reports = Reports(trial, rank, start.attempt, rows // trial.train.global_batch if rows else None)
        if start.checkpoint is not None:
            reports.say(f"attempt {start.attempt}, resuming from {start.checkpoint.path}")
        for name in discard_unfinished(start.attempt) if start.attempt > 1 and rank == 0 else ():
            reports.say(f"removed {name}, a checkpoint an earlier attempt never finished")
        row = run_trial(
            trial,
            trial_mesh(trial),
            batches,
            held_out,
            reports,
            resume=start.checkpoint,
            tensorboard=config.get("tensorboard_dir") if rank == 0 else None,
            hooks=(*train_hooks(trial, rank, start.attempt), reports.preemption_hook()),
            on_compile=compile_writer(config.get("compile_file") if rank == 0 else None),
            notes=functools.partial(restart_notes, config.get("failures_file"), start),
        )
        if "diverged_step" in row:  # unsaved: reported alone
            ray.train.report({**DIVERGED_METRICS, **row, "final": True})


def restart_notes(failures_file: str | None, start: ResumePoint) -> dict[str, Any]:
    """The summary's ``restarts`` and ``skipped_checkpoints`` (counts: Tune's TensorBoard logger takes
    numbers only) and after a restart ``restart_causes``, oldest first ("node lost, preempted"), and
    ``workers_by_attempt``: read when the trial ends, as late as can be (``FailureLog``: a lost node
    is marked dead only after missed heartbeats)."""
    notes: dict[str, Any] = {"restarts": start.attempt - 1, "skipped_checkpoints": len(start.skipped)}
    if start.attempt > 1:
        notes["restart_causes"] = ", ".join(read_causes(failures_file, start.workers))
        notes["workers_by_attempt"] = ", ".join(map(str, start.workers))
    return notes
