"""Ray Train: the per-worker training loop (an adapter around ``jaxray.train.run.train``) and the
``JaxTrainer`` factory.

Each worker is one JAX process that owns ``devices_per_worker`` devices (GPUs through
``ScalingConfig(use_gpu=True, resources_per_worker={"GPU": k})``, or forced host devices on CPU).
With several workers they form one JAX program: on GPU the JaxTrainer backend initialises
``jax.distributed`` itself; on CPU ``join_cpu_program`` does (gloo collectives, the coordinator
address broadcast from rank 0 with Ray Train's collective helper). The mesh spans every device of
every process, and each worker feeds the rows of each global batch that its own devices hold.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
from ray.train import Checkpoint, CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.v2.jax import JaxTrainer

from jaxray.config import ConfigError, TrialConfig, WorkersConfig, parse_trial
from jaxray.data.ray_data import shard_batches

# Beside the trial's checkpoints (``train/<trial>/``): what XLA knows about its compiled step.
COMPILE_FILE = "compile.json"
FAULT_PAUSE_S = (
    10.0  # before an injected exit: several of Ray Train's 2 s health-check polls, also under load
)


def worker_env(workers: WorkersConfig) -> dict[str, str]:
    """Environment for the worker processes, set by Ray before JAX is imported there."""
    # Ray Data's per-dataset progress bars would flood every trial's log.
    quiet = {"RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
    if workers.use_gpu:
        # Several JAX processes may share a GPU in small tests; preallocation would starve them.
        return {**quiet, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    return {
        **quiet,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={workers.devices_per_worker}",
    }


def join_cpu_program(rank: int, world: int) -> None:
    """Make this worker process ``rank`` of one ``world``-process JAX program on CPU. Call before
    JAX's backend starts (any device query starts it).

    Rank 0 picks a free port on its node and Ray Train broadcasts ``host:port`` to every worker
    (``ray.train.collective.broadcast_from_rank_zero``, also a barrier); CPU collectives go through
    gloo (``jax_cpu_collectives_implementation``), as JAX's multi-process CPU backend needs.
    """
    import jax
    from ray.train.collective import broadcast_from_rank_zero

    address = None
    if rank == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            address = f"{ray.util.get_node_ip_address()}:{probe.getsockname()[1]}"
    address = broadcast_from_rank_zero(address)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num_processes=world, process_id=rank)


def describe_worker(rank: int) -> str:
    """One log line: Ray rank, JAX process index and count, local devices and, on GPU, the physical
    GPUs' UUIDs (so two workers sharing a GPU show the same UUID)."""
    import jax

    line = (
        f"jaxray worker rank {rank}: JAX process {jax.process_index()} of {jax.process_count()}, "
        f"local devices {jax.local_devices()}"
    )
    if jax.default_backend() == "gpu":
        line += f", GPUs {gpu_uuids()}"
    return line


def gpu_uuids() -> list[str]:
    """UUIDs of the GPUs this process may use (``CUDA_VISIBLE_DEVICES`` order) from ``nvidia-smi``;
    [] when it cannot be asked."""
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    uuids = dict(line.split(", ", 1) for line in listing.strip().splitlines() if ", " in line)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [uuids.get(i.strip(), i.strip()) for i in visible.split(",")] if visible else list(uuids.values())


def rank_batches(
    shard, global_batch: int, rank: int, world: int, prefetch_batches: int = 2
) -> Iterator[dict[str, np.ndarray]]:
    """This worker's rows of every global batch from an unsplit dataset iterator, endlessly: rows
    ``[rank * L, (rank + 1) * L)`` of each ``global_batch``-row batch (L = global_batch / world),
    the rows its own devices hold under the ``data`` sharding. Every worker gets the same number of
    batches, and together they see exactly what ``train_batches(arrays, global_batch)`` gives one
    process. Raises ValueError if the dataset holds fewer rows than one global batch."""
    local = global_batch // world
    for batch in shard_batches(shard, global_batch, prefetch_batches):
        yield {k: v[rank * local : (rank + 1) * local] for k, v in batch.items()}


def parquet_data(
    trial: TrialConfig, rank: int, world: int
) -> tuple[Iterator[dict[str, np.ndarray]], dict, int]:
    """(this worker's training batches, the whole held-out split, the training rows) from
    ``data.parquet``: Ray Data streams the prepared files, each epoch in the order ``train.seed``
    draws, and the worker keeps its rows of every global batch
    (``jaxray.data.parquet.parquet_batches``)."""
    from jaxray.data.parquet import parquet_batches, split_arrays
    from jaxray.data.workloads import held_out_split, parquet_folder

    folder, manifest = parquet_folder(trial)
    batches = parquet_batches(
        folder,
        "train",
        trial.train.global_batch,
        trial.train.seed,
        rank,
        world,
        cache_bytes=trial.data.parquet_cache_mib << 20,
    )
    held_out = split_arrays(folder, held_out_split(trial.model.workload), manifest=manifest)
    return batches, held_out, manifest.split("train").rows


def _collect(shard) -> dict[str, np.ndarray]:
    """Every row of an unsplit dataset shard as numpy arrays (the held-out set, small)."""
    parts = list(shard.iter_batches(batch_size=4096, batch_format="numpy"))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _check_local_devices(trial: TrialConfig) -> None:
    import jax

    found = jax.local_device_count()
    if found != trial.workers.devices_per_worker:
        raise ConfigError(
            f"workers.devices_per_worker is {trial.workers.devices_per_worker} but this worker "
            f"sees {found} {jax.default_backend()} device(s): {jax.local_devices()}"
        )


def _reporter(every: int, steps: int):
    def report(row: dict[str, float]) -> None:
        if row["step"] % every == 0 and row["step"] != steps:  # the last step goes out with the summary
            ray.train.report(row)

    return report


def checkpoint_name(step: int, attempt: int) -> str:
    """Ray Train folder name of the checkpoint at ``step`` saved by worker-group ``attempt``: names
    sort by step, then attempt. The attempt keeps them unique: a restart that resumes from an older
    checkpoint saves the later steps again, and Ray Train's rotation must never see one folder twice
    (it would delete a folder it still lists)."""
    return f"checkpoint_step_{step:08d}_attempt{attempt}"


def count_attempt(path: str | None) -> int:
    """This worker group's attempt number (1 for the first start; Ray Train restarts add one),
    counted in the file ``path`` (rank 0 calls it once per start); 1 without a file."""
    if not path:
        return 1
    file = Path(path)
    attempt = (json.loads(file.read_text())["attempts"] if file.is_file() else 0) + 1
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"attempts": attempt}))
    return attempt


def damage(checkpoint_dir: Path) -> Path:
    """Fault injection: truncate the largest array file of a checkpoint to half its size."""
    victim = max((f for f in checkpoint_dir.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    return victim


def resume_point(trial: TrialConfig, rank: int, attempt: int) -> tuple[Path | None, list[str], int]:
    """The checkpoint this worker group continues from: the newest of the run's checkpoints that is
    complete and undamaged (``checkpoint.verify``), starting from ``ray.train.get_checkpoint()``;
    None on a fresh start. Rank 0 decides (after the ``corrupt_latest_checkpoint`` fault, if set)
    and broadcasts it, so every rank restores the same one. A damaged newest checkpoint is named
    in a warning with the one used instead. Returns (checkpoint, names of the newer ones skipped,
    rank 0's attempt number)."""
    from ray.train.collective import broadcast_from_rank_zero

    from jaxray import checkpoint

    chosen, skipped = None, []
    latest = ray.train.get_checkpoint()
    if rank == 0 and latest is not None:
        newest = Path(latest.path)
        if trial.fault.corrupt_latest_checkpoint and attempt == 2:
            print(f"jaxray fault injection: damaged {damage(newest)}", flush=True)
        candidates = sorted(newest.parent.glob("checkpoint_step_*"), reverse=True)
        candidates = [newest] + [c for c in candidates if c.name < newest.name]
        try:
            _, path = checkpoint.restore_latest(candidates, checkpoint.verify)
            chosen, skipped = str(path), [c.name for c in candidates[: candidates.index(path)]]
        except checkpoint.CheckpointError as err:  # every one damaged: start over rather than fail
            checkpoint.log.warning("%s; starting again from step 0", err)
            skipped = [c.name for c in candidates]
    if ray.train.get_context().get_world_size() > 1:
        chosen, skipped, attempt = broadcast_from_rank_zero((chosen, skipped, attempt))
    return (Path(chosen) if chosen else None), skipped, attempt


def _die(step: int) -> None:
    # Ray Train's controller collects reports (and registers their checkpoints) when it polls the
    # workers, every 2 s: a worker that dies sooner after a report loses that report. The pause
    # makes the injected fault the same on every run: every checkpoint reported before it counts.
    time.sleep(FAULT_PAUSE_S)
    print(f"jaxray fault injection: worker process exits at step {step}", flush=True)
    os._exit(17)


def _fault_hooks(trial: TrialConfig, rank: int, attempt: int) -> tuple:
    """The ``fault.kill_at_step`` hook (rank 0, first attempt only, not at a checkpoint step: there
    the save itself dies half-way, ``_saver``)."""
    from jaxray.train.loop import Hook

    kill, every = trial.fault.kill_at_step, trial.train.checkpoint_every
    if kill is None or rank != 0 or attempt != 1 or (every and kill % every == 0):
        return ()
    return (Hook(kill, lambda step, state, metrics: _die(step) if step == kill else None),)


def _saver(trial: TrialConfig, rank: int, attempt: int, rows_per_epoch: int | None):
    """``save(step, state, history, row=None)`` for ``train`` and for the final checkpoint: rank 0
    writes the full state with Orbax into a local folder and every rank reports it to Ray Train (a
    barrier) with ``row`` (default: the last log row), which copies it to the run's storage and
    keeps ``train.keep_checkpoints`` of them. The copy is synchronous (``ASYNC`` upload was tried
    once and lost a checkpoint on a kill, before ``_die``'s pause existed)."""
    from jaxray import checkpoint

    def save(step: int, state, history: list[dict], row: dict | None = None) -> None:
        ckpt = None
        if rank == 0:
            die = trial.fault.kill_at_step == step and attempt == 1
            folder = checkpoint.save_state(
                tempfile.mkdtemp(prefix="jaxray-ckpt-"),
                state,
                trial,
                history,
                position(step, rows_per_epoch),
                (lambda: _die(step)) if die else None,
            )
            ckpt = Checkpoint.from_directory(folder)
        if row is None:
            row = {**(history[-1] if history else {}), "step": step}
        ray.train.report(
            row,
            checkpoint=ckpt,
            checkpoint_dir_name=checkpoint_name(step, attempt),
            delete_local_checkpoint_after_upload=True,
        )

    return save


def position(step: int, batches_per_epoch: int | None) -> dict[str, int]:
    """The data position after ``step`` batches: epoch and batch index within it (when known)."""
    if not batches_per_epoch:
        return {}
    return {"epoch": step // batches_per_epoch, "batch_in_epoch": step % batches_per_epoch}


def _compile_writer(path: str | None):
    """``on_compile`` for ``train``: the report as JSON at ``path`` (temp file, then rename), or None."""
    if not path:
        return None

    def write(report: dict) -> None:
        from jaxray.reporting.sweep import json_safe

        file = Path(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(json_safe(report), indent=2))
        tmp.replace(file)

    return write


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point. ``config``: ``{"trial": TrialConfig dict, "tensorboard_dir": str | None,
    "attempts_file": str | None, "compile_file": str | None, "train_rows": int | None}``.

    Reports a log row with ``ray.train.report`` every ``train.report_interval`` steps, a full-state
    checkpoint every ``train.checkpoint_every`` steps and, at the end, the summary row with the
    final full-state checkpoint (saved by rank 0, with ``history.json``, every logged row). After a
    worker died, Ray Train restarts the group (``workers.max_failures``) and the loop resumes from
    the newest usable checkpoint (``resume_point``). The summary records ``restarts`` and
    ``resumed_from_step``. Rank 0 also writes TensorBoard events at every log step, and the step's
    compile report to ``compile_file`` before the first step (``jaxray.train.compile_report``).
    """
    import jax

    from jaxray.parallel.mesh import make_mesh
    from jaxray.reporting.tensorboard import TensorBoardLogger
    from jaxray.train.run import train

    trial = parse_trial(config["trial"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    if world > 1 and not trial.workers.use_gpu:
        join_cpu_program(rank, world)
    _check_local_devices(trial)
    attempt = count_attempt(config.get("attempts_file")) if rank == 0 else 1
    # stdout reaches the driver's console and the Ray dashboard, prefixed with the worker's pid.
    print(describe_worker(rank), flush=True)
    resume, skipped, attempt = resume_point(trial, rank, attempt)
    if resume is not None and rank == 0:
        print(f"jaxray: attempt {attempt}, resuming from {resume}", flush=True)
    mesh = make_mesh()
    if trial.data.parquet:
        batches, held_out, rows = parquet_data(trial, rank, world)
    else:
        batches = rank_batches(ray.train.get_dataset_shard("train"), trial.train.global_batch, rank, world)
        held_out, rows = _collect(ray.train.get_dataset_shard("eval")), config.get("train_rows")
    per_epoch = rows // trial.train.global_batch if rows else None
    save = _saver(trial, rank, attempt, per_epoch)

    tb_dir = config.get("tensorboard_dir") if rank == 0 else None
    with TensorBoardLogger(tb_dir) if tb_dir else contextlib.nullcontext() as tb:
        on_log = [_reporter(trial.train.report_interval, trial.train.steps)] + ([tb] if tb else [])
        result = train(
            trial,
            batches,
            held_out,
            mesh,
            on_log=on_log,
            resume=resume,
            save=save,
            hooks=_fault_hooks(trial, rank, attempt),
            on_compile=_compile_writer(config.get("compile_file") if rank == 0 else None),
        )
        # A count, not the names (Tune's TensorBoard logger takes numbers only); the names are in
        # the worker log's warning.
        result.summary.update(restarts=attempt - 1, skipped_checkpoints=len(skipped))
        if tb:
            tb.add_final(result.summary, trial.train.steps)
    # The final checkpoint with the summary, and the last logged row too (step, loss, ...):
    # schedulers such as ASHA read them in every report.
    save(
        trial.train.steps,
        result.state,
        result.history,
        row={**result.history[-1], **result.summary, "final": True},
    )
    if world > 1 and not trial.workers.use_gpu:
        jax.distributed.shutdown()  # JaxTrainer's backend only shuts down what it started (GPU, TPU)


def _ordered_ingest():
    """Ray Data's ingest options with block order kept: without it the same seed gives a different
    batch order (and loss curve) from run to run."""
    options = DataConfig.default_ingest_options()
    options.preserve_order = True
    return options


def make_trainer(
    trial: TrialConfig,
    datasets: dict,
    storage_path: str | Path,
    name: str,
    tensorboard_dir: str | Path | None = None,
    callbacks: list | None = None,
) -> JaxTrainer:
    """A JaxTrainer for one trial. ``datasets``: ``{"train": Dataset, "eval": Dataset}``, both given
    whole to every worker: each takes its rows of every global batch of ``train`` and of ``eval``."""
    w = trial.workers
    resources = {"GPU": w.devices_per_worker} if w.use_gpu else {"CPU": 1}
    # Outside Ray's own run folder (Ray Train v2 keeps that for its own state).
    attempts = Path(storage_path) / f"{name}.attempts.json"
    return JaxTrainer(
        train_loop_per_worker,
        train_loop_config={
            "trial": trial.model_dump(),
            "tensorboard_dir": str(tensorboard_dir) if tensorboard_dir else None,
            "attempts_file": str(attempts),
            "compile_file": str(Path(storage_path) / name / COMPILE_FILE),
            "train_rows": datasets["train"].count() if "train" in datasets else None,
        },
        scaling_config=ScalingConfig(
            num_workers=w.num_workers, use_gpu=w.use_gpu, resources_per_worker=resources
        ),
        # Unsplit: each worker takes its rows of every global batch (``rank_batches``), so the global
        # batches are the same whatever the number of workers.
        dataset_config=DataConfig(datasets_to_split=[], execution_options=_ordered_ingest()),
        datasets=datasets,
        run_config=RunConfig(
            name=name,
            storage_path=str(storage_path),
            callbacks=callbacks or [],
            worker_runtime_env={"env_vars": worker_env(w)},
            failure_config=FailureConfig(max_failures=w.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=trial.train.keep_checkpoints),
        ),
    )
