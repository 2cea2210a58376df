"""The trial of ``python -m jaxray.local`` in this process (imports JAX: after the devices are set):
``jaxray.runner.run_trial`` with the Ray worker's data order and outputs, written by plain files."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import jax

from jaxray import checkpoint, storage
from jaxray.checkpoint import checkpoint_name
from jaxray.config import TrialConfig
from jaxray.data.batching import num_samples, train_batches
from jaxray.data.workloads import load_arrays
from jaxray.parallel.checks import check_trial
from jaxray.parallel.mesh import trial_mesh
from jaxray.reporting.format import json_safe
from jaxray.runner import run_trial
from jaxray.train.step import optimizer_for

SUMMARY = "summary.json"
ATTEMPT = 1  # one process, no restarts: every checkpoint is attempt 1's, as a Ray run's first attempt


class LocalRunError(RuntimeError):
    """A local run that cannot start: too few devices, Parquet data, a folder already used."""


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with storage.written_whole(path) as tmp:
        tmp.write_text(json.dumps(json_safe(doc), indent=2))


def _start(trial: TrialConfig, out: Path, resume: bool) -> checkpoint.Verified | None:
    """The checkpoint to resume from, verified; LocalRunError for a run that cannot start here,
    ConfigError for a trial that cannot run on its mesh (``check_trial``: batch, params, attention),
    CheckpointError for a damaged one."""
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
    done = checkpoint.checkpoints(Path(out))  # committed ones, newest first
    latest = done[0] if done else None
    if latest is not None and not resume:
        raise LocalRunError(f"{out} already holds checkpoints ({latest.name}): --resume, or another --out")
    if resume:
        print(
            f"jaxray local: resuming from {latest}" if latest else f"jaxray local: nothing to resume in {out}"
        )
        if latest is not None:
            _check_resumable(trial, latest)
    for name in checkpoint.remove_unfinished(out) if out.is_dir() else ():  # a killed save's folder
        print(f"jaxray local: removed {name}, a checkpoint never finished", flush=True)
    return checkpoint.open(latest, full_state=True) if latest is not None else None


# Settings a resumed run may change: how long it trains (--steps cuts a longer warmup to the run),
# and when it logs, evaluates and saves.
CADENCE = {"steps", "warmup_steps", "log_every", "eval_every", "patience", "min_delta", "report_every"}
CADENCE |= {"eval_batch"}
CADENCE |= {"checkpoint_every", "keep_checkpoints", "checkpoint_score"}
HOW_IT_RUNS = {"attention", "remat", "scan_layers", "init"}  # model settings a restored state ignores


def _check_resumable(trial: TrialConfig, latest: Path) -> None:
    """LocalRunError naming the settings that differ from ``latest``'s trial (model, seq_len, the
    optimizer, seed: a resumed run would be another trial's); ``train.steps`` may change, and then
    the line printed says where the rebuilt learning-rate schedule takes the rate."""
    saved, step = checkpoint.load_trial_config(latest), checkpoint.checkpoint_order(latest)[0]
    if trial.train.steps < step:
        raise LocalRunError(f"train.steps {trial.train.steps} is below {latest.name}'s step {step}")
    effective = [  # the optimizer's settings as trained (a recipe default and its spelled-out value agree)
        (c.model.model_dump(), c.train.model_dump() | c.recipe()) for c in (saved, trial)
    ]
    differ = [
        f"{part}.{key} {before[key]!r} -> {now[key]!r}"
        for part, skip, before, now in (
            ("model", HOW_IT_RUNS, effective[0][0], effective[1][0]),
            ("train", CADENCE, effective[0][1], effective[1][1]),
        )
        for key in before
        if key not in skip and before[key] != now.get(key)
    ]
    differ += [f"data.seq_len {saved.data.seq_len} -> {trial.data.seq_len}"] * (
        saved.data.seq_len != trial.data.seq_len
    )
    if differ:
        raise LocalRunError(
            f"{latest.name} was trained with other settings ({'; '.join(differ)}): --resume with its "
            "own config (only train.steps, the warmup within it and the logging, evaluation and "
            "checkpoint cadence may change)"
        )
    if (saved.train.steps, saved.train.warmup_steps) != (trial.train.steps, trial.train.warmup_steps):
        (_, old), (_, new) = optimizer_for(saved), optimizer_for(trial)
        print(
            f"jaxray local: train.steps {saved.train.steps} -> {trial.train.steps}: the learning-rate "
            f"schedule is rebuilt over {trial.train.steps} steps; at step {step} the rate goes from "
            f"{float(old(step)):.4g} to {float(new(step)):.4g}",
            flush=True,
        )


def run(trial: TrialConfig, out: Path, resume: bool) -> dict[str, Any]:
    """Train ``trial`` here into ``out`` (``run_trial``, ``Saves`` its host); the summary (also
    ``out/summary.json``). Raises ConfigError, DataFileError, LocalRunError before compiling; a
    diverged trial's summary says where."""
    start = _start(trial, out, resume)
    (out / SUMMARY).unlink(missing_ok=True)  # an earlier run's: it may name a checkpoint pruned below
    mesh = trial_mesh(trial, jax.devices()[: trial.workers.total_devices])
    source, held_out = load_arrays(trial)
    per_epoch = num_samples(source) // trial.train.global_batch
    if per_epoch == 0:
        raise LocalRunError(
            f"train.global_batch {trial.train.global_batch} is more than the training set's "
            f"{num_samples(source)} samples"
        )
    batches = train_batches(source, trial.train.global_batch, trial.train.seed)  # the Ray workers' order
    save = Saves(trial, out, per_epoch)
    try:
        row = run_trial(
            trial, mesh, batches, held_out, save, resume=start, tensorboard=out / "tensorboard",
            on_compile=lambda report: _write_json(out / "compile.json", report),
        )  # fmt: skip
    except BaseException:  # Ctrl-C, a full disk: the save under way is of a finite state
        save.commit()
        raise
    summary = {"name": trial.name(), **row}
    if row.get("stopped_early"):
        save.say(f"stopped at step {row['last_step']}: train.patience evaluations without a better val_loss")
    if "diverged_step" not in row:
        ranked = checkpoint.ranked_checkpoints(str(out))
        summary["checkpoint"] = Path(ranked[0]).name if ranked else None  # what --checkpoint loads
    _write_json(out / SUMMARY, summary)
    return summary


class Saves:
    """``run_trial``'s host for a local run (``jaxray.runner.Host``): lines and rows printed,
    checkpoints of ``trial`` into ``out``, a save's files written while training goes on (one in
    flight: the one before is committed first); after each commit only the best and the newest are
    kept."""

    def __init__(self, trial: TrialConfig, out: Path, per_epoch: int):
        self.trial, self.out, self.per_epoch = trial, out, per_epoch
        self.pending: list[checkpoint.PendingSave] = []

    def say(self, line: str) -> None:
        print(f"jaxray local: {line}", flush=True)

    def log(self, row: dict[str, float]) -> None:
        """Print the row, then commit a save of an earlier step (its files are written by now), so
        that a crash loses at most a log interval of a committed checkpoint's progress."""
        shown = " ".join(f"{k} {v:.4g}" for k, v in row.items() if k != "step" and isinstance(v, float))
        print(f"step {row['step']}: {shown}", flush=True)
        if self.pending and self.pending[-1].step < row["step"]:
            self.commit()

    def save(self, step: int, state, history: list[dict], row: dict | None = None) -> None:
        self.commit()
        position = {"epoch": step // self.per_epoch, "batch_in_epoch": step % self.per_epoch}
        summary = row if row and row.get("final") else None
        folder = self.out / checkpoint_name(step, ATTEMPT)
        save = checkpoint.start_save_state(folder, state, self.trial, history, position, summary=summary)
        self.pending.append(save)

    def finish(self, step: int, state, history: list[dict], row: dict) -> None:
        """The final checkpoint with ``row``, committed (none when resumed from it: it exists)."""
        if row.get("resumed_from_step", 0) < step:
            self.save(step, state, history, row=row)
        self.commit()

    def commit(self) -> None:
        """Finish the save in flight, if any. Raises CheckpointSaveError."""
        while self.pending:
            self.pending.pop().commit()
            keep_best_and_newest(self.out)

    def abandon(self) -> None:
        """Let the save under way finish writing, then remove it (a diverged run: the params it holds
        may already be broken), as the Ray workers' ``Reports.abandon``."""
        while self.pending:
            pending = self.pending.pop()
            with contextlib.suppress(checkpoint.CheckpointSaveError):
                pending.commit(manifest=False)
            shutil.rmtree(pending.directory, ignore_errors=True)


def keep_best_and_newest(out: Path) -> list[str]:
    """Remove the complete checkpoints in ``out`` but the newest (resume) and the best (the lowest
    recorded ``val_loss``: ``checkpoint.ranked_checkpoints``); returns the removed names."""
    ranked = checkpoint.ranked_checkpoints(str(out))  # one listing: the best first, the rest newest first
    keep = {ranked[0], max(ranked, key=checkpoint.checkpoint_order)} if ranked else set()
    gone = [c for c in ranked if c not in keep]
    for c in gone:
        shutil.rmtree(c)
    return [Path(c).name for c in gone]
