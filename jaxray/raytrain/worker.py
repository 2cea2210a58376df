"""The Ray Train worker: ``jaxray.train.run.train`` in each worker process. Each worker trains on rows
``[rank * L, (rank + 1) * L)`` of every global batch (L = global_batch / world), from its Ray Train
shard or the Parquet folder, and evaluates on the whole held-out set."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray.train

from jaxray.config import TrialConfig
from jaxray.data.batching import Arrays
from jaxray.data.parquet import parquet_batches, split_arrays
from jaxray.data.ray_data import shard_batches
from jaxray.data.workloads import held_out_split, parquet_folder
from jaxray.models import resolve_attention
from jaxray.parallel.mesh import trial_mesh
from jaxray.raytrain.cluster import check_local_devices, cpu_program, describe_worker
from jaxray.raytrain.failures import read_causes
from jaxray.raytrain.reports import Reports, compile_writer, discard_unfinished, trial_folder
from jaxray.raytrain.resume import count_attempt, resume_point
from jaxray.raytrain.seams import train_hooks
from jaxray.reporting.tensorboard import TensorBoardLogger
from jaxray.train import compile_cache
from jaxray.train.run import Diverged, train

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
    """Ray Train entry point; ``config``: ``make_trainer``'s ``train_loop_config``. Reports a log row
    every ``train.report_interval`` steps, a checkpoint every ``train.checkpoint_interval`` and the
    summary with the final one; after a restart resumes from the newest usable checkpoint. Rank 0
    writes TensorBoard events and the compile report."""
    trial: TrialConfig = config["trial"]  # parsed and checked once, before Ray started
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    with cpu_program(trial.workers, rank, world):
        check_local_devices(trial.workers)
        compile_cache.enable(trial.workers.compile_cache)
        attempt = count_attempt(config.get("attempts_file"), world) if rank == 0 else (1, [world])
        transformer = trial.model.workload == "transformer"  # the MLPs have no attention
        choice = resolve_attention(trial.model, seq_len=trial.data.seq_len) if transformer else None
        print(describe_worker(rank, choice), flush=True)
        start = resume_point(rank, attempt, trial_folder(), config.get("trial_uri"))
        if start.checkpoint is not None and rank == 0:
            print(f"jaxray: attempt {start.attempt}, resuming from {start.checkpoint.path}", flush=True)
        if start.attempt > 1 and rank == 0:
            for name in discard_unfinished(start.attempt):
                print(f"jaxray: removed {name}, a checkpoint an earlier attempt never finished", flush=True)
        mesh = trial_mesh(trial)
        batches, held_out, rows = worker_data(trial, rank, world, config.get("train_rows"))
        reports = Reports(trial, rank, start.attempt, rows // trial.train.global_batch if rows else None)
        tb_dir = config.get("tensorboard_dir") if rank == 0 else None
        # An earlier attempt's events past the checkpoint resumed from (or all of them) are redone.
        first = 1 if start.checkpoint is None else int(start.checkpoint.state["step"]) + 1
        with TensorBoardLogger(tb_dir, first) if tb_dir else contextlib.nullcontext() as tb:
            try:
                result = train(
                    trial,
                    batches,
                    held_out,
                    mesh,
                    on_log=[reports.log] + ([tb] if tb else []),
                    resume=start.checkpoint,
                    save=reports.save,
                    hooks=(*train_hooks(trial, rank, start.attempt), reports.preemption_hook()),
                    on_compile=compile_writer(config.get("compile_file") if rank == 0 else None),
                )
            except Diverged as err:  # a failed trial, not a crash: no restart, nothing of it saved
                print(f"jaxray: {err}; the trial stops", flush=True)
                reports.abandon()  # a save under way may hold the broken params
                ray.train.report({**DIVERGED_METRICS, "step": err.step, "final": True, **err.row()})
                return
            # A count: Tune's TensorBoard logger takes numbers only.
            result.summary.update(restarts=start.attempt - 1, skipped_checkpoints=len(start.skipped))
            if start.attempt > 1:  # why, oldest first: "node lost, preempted"
                causes = read_causes(config.get("failures_file"), start.workers)
                result.summary["restart_causes"] = ", ".join(causes)
                result.summary["workers_by_attempt"] = ", ".join(map(str, start.workers))
            if tb:
                tb.add_final(result.summary, result.summary.get("last_step", trial.train.steps))
        # The final row carries the last logged metrics too: ASHA reads them in every report.
        final_row = {**result.history[-1], **result.summary, "final": True}
        if trial.model.workload != "transformer":  # its held-out metrics are the summary's test_*
            final_row = {k: v for k, v in final_row.items() if not k.startswith("val_")}
        reports.save(
            result.summary.get("last_step", trial.train.steps), result.state, result.history, row=final_row
        )
