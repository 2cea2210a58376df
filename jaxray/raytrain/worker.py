"""The Ray Train worker: an adapter that runs ``jaxray.train.run.train`` in each worker process.

It parses the trial config, reads rank and world size from Ray Train's context, joins the other
workers into one JAX program (``cluster``), builds the mesh over every device of every process,
takes this worker's rows of every global batch (``shards``), continues from the newest usable
checkpoint (``resume``) and runs the loop with hooks that report to Ray Train (``reports``) and,
in the fault-tolerance tests, inject faults (``faults``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import ray.train

from jaxray.config import parse_trial
from jaxray.models import resolve_attention
from jaxray.parallel.mesh import make_mesh
from jaxray.raytrain.cluster import check_local_devices, cpu_program, describe_worker
from jaxray.raytrain.faults import fault_hooks
from jaxray.raytrain.reports import checkpoint_saver, compile_writer, log_reporter
from jaxray.raytrain.resume import count_attempt, resume_point
from jaxray.raytrain.shards import worker_data
from jaxray.reporting.tensorboard import TensorBoardLogger
from jaxray.train.run import train


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point. ``config``: ``{"trial": TrialConfig dict, "tensorboard_dir": str | None,
    "attempts_file": str | None, "compile_file": str | None, "train_rows": int | None}``.

    Reports a log row with ``ray.train.report`` every ``train.report_interval`` steps, a full-state
    checkpoint every ``train.checkpoint_every`` steps and, at the end, the summary row with the
    final full-state checkpoint (saved by rank 0, with ``history.json``, every logged row). After a
    worker died, Ray Train restarts the group (``workers.max_failures``) and the loop resumes from
    the newest usable checkpoint (``resume_point``). The summary records ``restarts`` and
    ``resumed_from_step`` and, for the transformer, the ``attention`` used and why
    (``attention_note``), which the worker's first log line gives too. Rank 0 also writes
    TensorBoard events at every log step, and the step's compile report to ``compile_file``
    before the first step (``jaxray.train.compile_report``).
    """
    trial = parse_trial(config["trial"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    with cpu_program(trial.workers, rank, world):
        check_local_devices(trial.workers)
        attempt = count_attempt(config.get("attempts_file")) if rank == 0 else 1
        # stdout reaches the driver's console and the Ray dashboard, prefixed with the worker's pid.
        # The attention is decided as ``train`` decides it (same request, same device).
        attention = resolve_attention(trial.model) if trial.model.workload == "transformer" else None
        print(describe_worker(rank, attention), flush=True)
        start = resume_point(trial, rank, attempt)
        if start.checkpoint is not None and rank == 0:
            print(f"jaxray: attempt {start.attempt}, resuming from {start.checkpoint}", flush=True)
        mesh = make_mesh()
        batches, held_out, rows = worker_data(trial, rank, world, config.get("train_rows"))
        save = checkpoint_saver(
            trial, rank, start.attempt, rows // trial.train.global_batch if rows else None
        )
        tb_dir = config.get("tensorboard_dir") if rank == 0 else None
        with TensorBoardLogger(tb_dir) if tb_dir else contextlib.nullcontext() as tb:
            result = train(
                trial,
                batches,
                held_out,
                mesh,
                on_log=[log_reporter(trial.train)] + ([tb] if tb else []),
                resume=start.checkpoint,
                save=save,
                hooks=fault_hooks(trial, rank, start.attempt),
                on_compile=compile_writer(config.get("compile_file") if rank == 0 else None),
            )
            # A count, not the names (Tune's TensorBoard logger takes numbers only); the names are in
            # the worker log's warning.
            result.summary.update(restarts=start.attempt - 1, skipped_checkpoints=len(start.skipped))
            if tb:
                tb.add_final(result.summary, trial.train.steps)
        # The final checkpoint with the summary, and the last logged row too (step, loss, ...):
        # schedulers such as ASHA read them in every report.
        final_row = {**result.history[-1], **result.summary, "final": True}
        save(trial.train.steps, result.state, result.history, row=final_row)
