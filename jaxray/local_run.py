"""The trial of ``python -m jaxray.local`` in this process (imports JAX: after the devices are set):
``jaxray.train.run.train`` with the Ray worker's data order and outputs, written by plain files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax

from jaxray import checkpoint, storage
from jaxray.checkpoint import checkpoint_name, remote
from jaxray.config import TrialConfig
from jaxray.data.batching import num_samples, train_batches
from jaxray.data.workloads import load_arrays
from jaxray.models import resolve_attention
from jaxray.parallel.checks import check_trial
from jaxray.parallel.mesh import trial_mesh
from jaxray.reporting.format import json_safe
from jaxray.reporting.tensorboard import TensorBoardLogger
from jaxray.train import compile_cache
from jaxray.train.run import Diverged, train

SUMMARY = "summary.json"
ATTEMPT = 1  # one process, no restarts: every checkpoint is attempt 1's, as a Ray run's first attempt


class LocalRunError(RuntimeError):
    """A local run that cannot start: too few devices, Parquet data, a folder already used."""


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with storage.written_whole(path) as tmp:
        tmp.write_text(json.dumps(json_safe(doc), indent=2))


def _start(trial: TrialConfig, out: Path, resume: bool) -> Path | None:
    """The checkpoint to resume from; LocalRunError for a run that cannot start here, ConfigError for
    a trial that cannot run on its mesh (``check_trial``: batch, params, attention)."""
    platform = jax.default_backend()
    if trial.workers.accelerator != "cpu" and trial.workers.accelerator != platform:
        raise LocalRunError(
            f"workers.accelerator is {trial.workers.accelerator} but JAX here runs on {platform}: "
            f"set workers.accelerator: {platform if platform in ('cpu', 'gpu', 'tpu') else 'cpu'}"
        )
    check_trial(trial, trial.mesh_shape)
    if trial.data.parquet:
        raise LocalRunError("data.parquet is read through Ray Data: a local run reads the data files")
    if trial.workers.total_devices > len(jax.devices()):
        raise LocalRunError(
            f"the trial needs {trial.workers.total_devices} devices (workers.num_workers x "
            f"workers.devices_per_worker), this process sees {len(jax.devices())}: {jax.devices()}"
        )
    done = remote.complete_checkpoints(str(out))  # committed ones, newest first
    latest = Path(done[0]) if done else None
    if latest is not None and not resume:
        raise LocalRunError(f"{out} already holds checkpoints ({latest.name}): --resume, or another --out")
    if resume:
        print(
            f"jaxray local: resuming from {latest}" if latest else f"jaxray local: nothing to resume in {out}"
        )
        for name in checkpoint.remove_unfinished(out):  # begun, never committed: a killed save
            print(f"jaxray local: removed {name}, a checkpoint never finished", flush=True)
    return latest


def run(trial: TrialConfig, out: Path, resume: bool) -> dict[str, Any]:
    """Train ``trial`` here into ``out``; the summary (also ``out/summary.json``). Raises ConfigError,
    DataFileError, LocalRunError before compiling; a diverged trial's summary says where."""
    start = _start(trial, out, resume)
    compile_cache.enable(trial.workers.compile_cache)
    mesh = trial_mesh(trial, jax.devices()[: trial.workers.total_devices])
    source, held_out = load_arrays(trial)
    per_epoch = num_samples(source) // trial.train.global_batch
    if per_epoch == 0:
        raise LocalRunError(
            f"train.global_batch {trial.train.global_batch} is more than the training set's "
            f"{num_samples(source)} samples"
        )
    batches = train_batches(source, trial.train.global_batch, trial.train.seed)  # the Ray workers' order
    if trial.model.workload == "transformer":
        choice = resolve_attention(trial.model, seq_len=trial.data.seq_len)
        print(f"jaxray local: {trial.name()}, {choice.describe()}", flush=True)

    pending: list[checkpoint.PendingSave] = []  # a save's files are written while training goes on

    def commit() -> None:
        while pending:
            pending.pop().commit()
            keep_best_and_newest(out)

    def save(step: int, state, history: list[dict], row: dict | None = None) -> None:
        commit()  # the one before: one save in flight at a time
        position = {"epoch": step // per_epoch, "batch_in_epoch": step % per_epoch}
        summary = row if row and row.get("final") else None
        folder = out / checkpoint_name(step, ATTEMPT)
        pending.append(checkpoint.start_save_state(folder, state, trial, history, position, summary=summary))

    def log(row: dict[str, float]) -> None:
        shown = " ".join(f"{k} {v:.4g}" for k, v in row.items() if k != "step" and isinstance(v, float))
        print(f"step {row['step']}: {shown}", flush=True)

    with TensorBoardLogger(out / "tensorboard") as tb:
        try:
            result = train(
                trial, batches, held_out, mesh, on_log=[log, tb], resume=start, save=save,
                on_compile=lambda report: _write_json(out / "compile.json", report),
            )  # fmt: skip
        except Diverged as err:
            commit()
            summary = {"name": trial.name(), **err.row()}
            _write_json(out / SUMMARY, summary)
            return summary
        commit()
        tb.add_final(result.summary, result.summary.get("last_step", trial.train.steps))
    summary = {"name": trial.name(), **result.summary, "final": True}
    last = summary.get("last_step", trial.train.steps)  # earlier when train.patience stopped it
    if summary.get("resumed_from_step", 0) < last:  # else its final checkpoint exists
        save(last, result.state, result.history, row={**result.history[-1], **summary})
        commit()
    if summary.get("stopped_early"):
        print(f"jaxray local: stopped at step {last}: train.patience evaluations without a better val_loss")
    ranked = remote.ranked_checkpoints(str(out))
    summary["checkpoint"] = Path(ranked[0]).name if ranked else None  # what --checkpoint loads
    _write_json(out / SUMMARY, summary)
    return summary


def keep_best_and_newest(out: Path) -> list[str]:
    """Remove the complete checkpoints in ``out`` but the newest (resume) and the best (the lowest
    recorded ``val_loss``: ``remote.ranked_checkpoints``); returns the removed names."""
    ranked = remote.ranked_checkpoints(str(out))  # one listing: the best first, the rest newest first
    keep = {ranked[0], max(ranked, key=checkpoint.checkpoint_order)} if ranked else set()
    gone = [c for c in ranked if c not in keep]
    for c in gone:
        shutil.rmtree(c)
    return [Path(c).name for c in gone]
