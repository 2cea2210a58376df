"""One training run, independent of Ray: build the model, compile, loop, evaluate, summarise."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxray import checkpoint
from jaxray.config import TrialConfig
from jaxray.data.batching import Arrays, eval_batches
from jaxray.models import Model, param_count
from jaxray.parallel.mesh import describe, held_bytes, shard_batch
from jaxray.train import compile_cache, compile_report
from jaxray.train.held_out import evaluate
from jaxray.train.layout import Layout, trial_layout
from jaxray.train.loop import Hook, StopTraining, compile_train_step, jit_eval_step, run_loop
from jaxray.train.step import TrainState, dropout_keys, placed_init_state

LogFn = Callable[[dict[str, float]], None]
# save(step, state, history so far): a full-state checkpoint every ``train.checkpoint_interval`` steps.
SaveFn = Callable[[int, TrainState, list[dict[str, float]]], None]
# The training metrics whose non-finite value stops a run (``Diverged``).
WATCHED = ("loss", "grad_norm")


class Diverged(ArithmeticError):
    """Training stopped at ``step``: its ``metric`` (loss or grad_norm) was ``value`` (NaN or inf)."""

    def __init__(self, step: int, metric: str, value: float) -> None:
        super().__init__(f"diverged at step {step}: {metric} {value}")
        self.step, self.metric, self.value = step, metric, value

    def row(self) -> dict[str, Any]:
        """What a report records of it: ``diverged_step``, ``diverged_metric``, ``diverged_value``
        (a string, "nan" or "inf": JSON has no NaN)."""
        return {"diverged_step": self.step, "diverged_metric": self.metric, "diverged_value": str(self.value)}


def check_finite(step: int, metrics: dict[str, float], watched: Sequence[str] = WATCHED) -> None:
    """Raise ``Diverged`` when a ``watched`` metric of ``step`` is NaN or inf."""
    for name in watched:
        if name in metrics and not math.isfinite(metrics[name]):
            raise Diverged(step, name, metrics[name])


@dataclass
class TrainResult:
    """Final state, the summary row (floats and ints) and the metrics logged every ``log_every`` steps."""

    state: TrainState
    summary: dict[str, Any]
    history: list[dict[str, float]] = field(default_factory=list)
    compile_report: dict[str, Any] = field(default_factory=dict)


def tokens_per_example(trial: TrialConfig) -> int:
    """Predicted tokens per sequence (T - 1) for the transformer, 0 for the MLPs."""
    return trial.data.seq_len - 1 if trial.model.workload == "transformer" else 0


# Tokens an evaluation batch holds by default: 256 windows of 64 bytes, 64 of 256.
EVAL_TOKENS = 16384


def eval_batch_size(trial: TrialConfig, devices: int) -> int:
    """``train.eval_batch`` (default: 1000 images, or the training global batch of sequences and at
    least ``EVAL_TOKENS`` tokens), rounded up to a multiple of the device count."""
    seqs = max(trial.train.global_batch, EVAL_TOKENS // trial.data.seq_len)
    size = trial.train.eval_batch or (seqs if trial.model.workload == "transformer" else 1000)
    return -(-size // devices) * devices


def _log_hook(
    trial: TrialConfig, history: list, on_log: Sequence[LogFn], schedule: Callable, validate: Callable | None
) -> Hook:
    """Every ``log_every`` steps a row: the step's metrics, the learning rate it trained with
    (``schedule(step - 1)``: the schedule counts updates from 0) and, every ``eval_every`` steps
    (``validate(params)``), the held-out ``val_loss``/``val_accuracy`` measured then. ``on_log`` also
    gets ``ms_per_step`` from the second row on (wall clock since the previous row was done, other
    hooks included: a trial stopped early keeps it); ``history`` does not (resumes compare it)."""
    per_example, every = tokens_per_example(trial), trial.train.eval_every
    last_step, last_done = 0, 0.0  # the previous row's step (0: none yet) and when it was done
    plateau = Plateau(trial.train.patience, trial.train.min_delta, history)

    def log(step: int, state: TrainState, metrics: dict[str, jax.Array]) -> None:
        nonlocal last_step, last_done
        now = time.perf_counter()
        row = {
            "step": step,
            "examples": step * trial.train.global_batch,
            **{k: float(v) for k, v in jax.device_get(metrics).items()},
            "lr": float(schedule(step - 1)),
        }
        check_finite(step, row)
        if per_example:
            row["tokens"] = row["examples"] * per_example
            row["perplexity"] = float(np.exp(row["loss"]))
        if validate is not None and (step % every == 0 or step == trial.train.steps):
            found = validate(state.params)
            row.update(val_loss=found["loss"], val_accuracy=found["accuracy"])
        history.append(row)  # what a resume restores: no clock in it
        if 0 < last_step < step:
            row = {**row, "ms_per_step": (now - last_done) / (step - last_step) * 1e3}
        for fn in on_log:
            fn(row)
        last_step, last_done = step, time.perf_counter()
        if "val_loss" in row and plateau.stalled():
            raise StopTraining(step)

    return Hook(trial.train.log_every, log)


@dataclass
class Plateau:
    """``train.patience``: stalled once the last ``patience`` evaluations of ``history`` (a resumed run's
    included) all missed the best before them by less than ``min_delta`` (flax's EarlyStopping rule)."""

    patience: int | None
    min_delta: float
    history: list[dict]

    def stalled(self) -> bool:
        losses = [r["val_loss"] for r in self.history if "val_loss" in r]
        if self.patience is None or len(losses) <= self.patience:
            return False
        best_before = min(losses[: -self.patience])
        return all(v > best_before - self.min_delta for v in losses[-self.patience :])


def _checkpoint_hook(trial: TrialConfig, history: list, save: SaveFn) -> Hook:
    def fn(step: int, state: TrainState, metrics: dict[str, jax.Array]) -> None:
        if step < trial.train.steps:  # the final state is saved by the caller, with the summary
            # No params of a diverged step are saved.
            check_finite(step, {k: float(v) for k, v in jax.device_get(metrics).items()})
            save(step, state, list(history))

    return Hook(trial.train.checkpoint_interval, fn)


def train(
    trial: TrialConfig,
    batches: Iterator[Arrays],
    eval_arrays: Arrays,
    layout: Layout | Mesh,
    on_log: Sequence[LogFn] = (),
    resume: Path | checkpoint.Verified | None = None,
    save: SaveFn | None = None,
    hooks: Sequence[Hook] = (),
    on_compile: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train ``trial`` on ``batches`` (this process's rows of each global batch) and evaluate.

    ``on_log(row)`` gets ``step``, ``examples``, ``loss``, ``accuracy``, ``grad_norm`` (and ``tokens``,
    ``perplexity``). ``resume``: a full-state checkpoint to continue from with the same data order
    (a final one gives back its saved summary). ``save(step, state, history)`` runs every
    ``train.checkpoint_interval`` steps; ``on_compile(report)`` gets the compile report.
    ``layout``: ``trial_layout(trial, mesh)`` (a Mesh: laid out here); the trial is taken as checked
    on it (``check_trial``: the plan's, before Ray or the local run starts). Raises CheckpointError
    if ``resume`` is damaged or holds another model, Diverged at the first logged or checkpointed
    step whose loss or grad_norm is NaN or inf, or when the held-out loss of the final params is
    (nothing of that step is saved)."""
    layout = trial_layout(trial, layout) if isinstance(layout, Mesh) else layout
    mesh, model, tx = layout.mesh, layout.model, layout.tx
    if resume is None:  # fresh from train.seed, placed as training shards it
        state = placed_init_state(model, tx, mesh, jax.random.key(trial.train.seed), layout.shardings)
        saved, history = {"step": 0}, []
    else:
        state, saved, history = checkpoint.restore_state(resume, layout.state)
    start = saved["step"]
    final = saved.get("summary") or {}
    if final and (start >= trial.train.steps or final.get("stopped_early")):  # nothing left to train
        return TrainResult(state, {**saved["summary"], "resumed_from_step": start}, history, {})
    # The data position: a resumed run skips the batches it had already trained on.
    sharded = (shard_batch(mesh, b) for b in itertools.islice(batches, start, None))
    first = next(sharded)
    # One jit for the evaluations during and after: compiled once.
    eval_fn = jit_eval_step(model, mesh, layout.shardings.params)
    with ThreadPoolExecutor(1) as pool:  # XLA compiles the two programs at once (it drops the GIL)
        warm = pool.submit(_warm_eval, eval_fn, state.params, trial, mesh, eval_arrays)
        step_fn, report = _compiled(trial, layout, state, first)
        warm.result()  # before the first step donates the params it reads
    if on_compile is not None:
        on_compile(report)
    validate = _validator(trial, eval_fn, mesh, eval_arrays)
    loop_hooks = [_log_hook(trial, history, on_log, layout.schedule, validate)]
    if save is not None:
        loop_hooks.append(_checkpoint_hook(trial, history, save))
    state, timing = run_loop(
        step_fn,
        state,
        itertools.chain([first], sharded),
        trial.train.steps,
        hooks=(*loop_hooks, *hooks),
        sync_each_step=layout.sync_each_step,
        start=start,
    )
    held_out = _final_held_out(trial, eval_fn, mesh, state, eval_arrays)
    summary = _summary(trial, mesh, start, state, report, timing, history, held_out, saved=save is not None)
    return TrainResult(state, summary, history, report)


def _compiled(trial: TrialConfig, layout: Layout, state: TrainState, batch):
    """(the AOT-compiled train step, its compile report with the attention chosen and whether the
    persistent compilation cache served it)."""
    model, mesh = layout.model, layout.mesh
    with compile_cache.watch() as cache:
        step_fn, compile_s = compile_train_step(
            model, layout.tx, mesh, state, batch, dropout=dropout_keys(trial), shardings=layout.shardings
        )
    report = {
        "config": compile_report.describe(trial, mesh),
        **compile_report.report(step_fn, compile_s, mesh.local_devices[0]),
        **cache.fields(),
        **_attention(model),
    }
    return step_fn, report


def _warm_eval(eval_fn, params, trial: TrialConfig, mesh: Mesh, eval_arrays: Arrays) -> None:
    """Compile ``eval_fn`` (``jit_eval_step``) by evaluating one held-out batch of ``params``: the
    evaluations during and after training then run from jit's cache. Run in a thread beside the
    train step's compile, so that the first evaluation does not wait for a compile of its own."""
    batch = next(eval_batches(eval_arrays, eval_batch_size(trial, mesh.devices.size)))
    jax.block_until_ready(eval_fn(params, shard_batch(mesh, batch)))


def _final_held_out(trial: TrialConfig, eval_fn, mesh: Mesh, state: TrainState, eval_arrays: Arrays):
    """The final params' held-out metrics over all of ``eval_arrays`` (``eval_fn``: ``jit_eval_step``).
    Raises Diverged when the loss is not finite: the last update can break params the last logged
    loss (taken before it) did not."""
    batch = eval_batch_size(trial, mesh.devices.size)
    held_out = evaluate(eval_fn, state.params, eval_arrays, batch, mesh)
    name = "val_loss" if trial.model.workload == "transformer" else "test_loss"  # as the summary names it
    check_finite(trial.train.steps, {name: held_out["loss"]}, (name,))
    return held_out


def _validator(trial: TrialConfig, eval_fn, mesh: Mesh, eval_arrays: Arrays) -> Callable | None:
    """``params -> evaluate(eval_fn, ...)`` over all of ``eval_arrays``: the logged ``val_loss`` is the
    summary's measure (the whole held-out split); None without ``train.eval_every``."""
    if trial.train.eval_every is None:
        return None
    batch = eval_batch_size(trial, mesh.devices.size)
    return lambda params: evaluate(eval_fn, params, eval_arrays, batch, mesh)


def _attention(model: Model) -> dict[str, str]:
    """The transformer's attention implementation and why (what ``auto`` chose; {} for the MLPs)."""
    if model.attention is None:
        return {}
    return {"attention": model.attention.implementation, "attention_note": model.attention.note}


def best_saved(
    trial: TrialConfig, history: list[dict], held_out: dict[str, float], steps: int
) -> dict[str, Any]:
    """``step``, ``val_loss``, ``val_accuracy`` of the checkpointed step with the lowest logged
    ``val_loss`` (every ``train.checkpoint_interval`` steps; the last, ``steps``, is ``held_out``'s, the
    same whole-split measure); the last step on a tie or when no other step was evaluated."""
    every = trial.train.checkpoint_interval
    best = {"step": steps, "val_loss": held_out["loss"], "val_accuracy": held_out["accuracy"]}
    for r in reversed(history):  # newest first: the newer on a tie, as ``checkpoint.ranked_checkpoints``
        saved = r["step"] % every == 0 and r["step"] < steps
        if saved and math.isfinite(r.get("val_loss", math.nan)) and r["val_loss"] < best["val_loss"]:
            best = {"step": r["step"], "val_loss": r["val_loss"], "val_accuracy": r["val_accuracy"]}
    return best


def _summary(trial, mesh, start, state, report, timing, history, held_out, saved=True) -> dict[str, Any]:
    """The run's summary row; ``report``: ``_compiled``'s (compile time, memory, attention, cache);
    ``saved``: checkpoints were written (else the best is the final params, the only ones kept)."""
    m, t = trial.model, trial.train
    row: dict[str, Any] = {
        "workload": m.workload,
        "global_batch": t.global_batch,
        "dtype": m.dtype,
        "width": m.width,
        "learning_rate": trial.learning_rate,
        "steps": t.steps,
        "last_step": timing.last_step or t.steps,  # before ``steps`` when ``train.patience`` stopped it
        "devices": mesh.devices.size,
        "params": param_count(state.params),
        "examples_per_sec": t.global_batch / timing.seconds_per_step,
        "ms_per_step": timing.seconds_per_step * 1e3,
        "compile_s": report["compile_s"],
        "warmup_s": timing.warmup_s,
        "hook_s": timing.hook_s,
        "final_train_loss": history[-1]["loss"],
    }
    if timing.last_step is not None:
        row["stopped_early"] = True
    if m.workload == "transformer":
        row["tokens_per_sec"] = row["examples_per_sec"] * tokens_per_example(trial)
        best = best_saved(trial, history if saved else [], held_out, row["last_step"])
        row.update(
            val_loss=best["val_loss"],
            val_perplexity=float(np.exp(best["val_loss"])),
            val_accuracy=best["val_accuracy"],
            val_sequences=held_out["count"],
            best_step=best["step"],
            final_val_loss=held_out["loss"],
        )
    else:
        row.update(
            test_loss=held_out["loss"], test_accuracy=held_out["accuracy"], test_examples=held_out["count"]
        )
    row["mesh"] = describe(mesh.shape)  # "data=2,tensor=2"
    row["per_device_batch"] = t.global_batch // (mesh.shape["data"] * mesh.shape["fsdp"])
    row["state_bytes"], row["state_bytes_per_device"] = held_bytes(state)
    row.update(resumed_from_step=start, peak_bytes_per_device=report["memory"].get("peak_bytes"))
    row.update({k: report[k] for k in ("attention", "attention_note") if k in report})
    row["compile_from_cache"] = report["compile_from_cache"]
    return row
