"""One workload at one config: compile jaxray's step, time it, report one row.

The building block of every suite and of ``compare``. Batches are real (Fashion-MNIST images or
TinyShakespeare byte sequences, the same seeded order as training) and pre-staged on the devices
before the clock starts, as the learning path's scripts do, so the figure is the step's own speed.
The call schedule matches the reference scripts: warm-up on batch 0, then timed calls over
batches 0, 1, 2, ... so that on the same config the final loss is comparable number for number.
Params start from the learning path's seeds (``INIT_SEED``), which make jaxray's initial params
equal to the reference scripts'.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import numpy as np

from jaxray.bench import mfu
from jaxray.bench.timing import environment, time_calls
from jaxray.config import ConfigError, TrialConfig, check_devices, parse_trial
from jaxray.data.batching import Arrays, num_rows
from jaxray.data.workloads import load_arrays
from jaxray.models import Model, build, param_count
from jaxray.parallel.checks import check_attention
from jaxray.parallel.mesh import make_mesh, needs_sync_per_step, replicate, shard_batch
from jaxray.train.held_out import evaluate
from jaxray.train.loop import compile_shard_map_train_step, compile_train_step, jit_eval_step
from jaxray.train.run import eval_batch_size, tokens_per_example
from jaxray.train.step import LOSSES, init_state, make_optimizer, train_step

StepKind = Literal["jit", "shard_map", "eager"]
STEP_KINDS: tuple[str, ...] = StepKind.__args__
# The learning path's init seeds: lab 7 builds its model with nnx.Rngs(1), lab 4 uses key(3).
INIT_SEED = {"transformer": 1, "mlp": 3, "shared_block_mlp": 1}


@dataclass(frozen=True)
class Spec:
    """What to measure.

    ``trial``: workload, width, dtype, global batch, sequence length and data seed. ``devices``:
    how many of ``jax.devices()`` form the mesh. ``steps``: timed steps per repeat (a multiple of
    ``steps_per_call``), ``repeats`` timed windows (median reported) after ``warmup`` calls.
    ``step``: "jit" (the auto-sharded compiled step), "shard_map" (explicit collectives) or
    "eager" (no jit: every op dispatched from Python). ``steps_per_call``: optimizer steps per
    dispatch (``lax.scan`` over a stack of batches; "jit" only). ``evaluate``: after timing, score
    the trained params on the whole held-out set (test images or validation bytes).
    """

    trial: TrialConfig
    devices: int = 1
    steps: int = 10
    repeats: int = 3
    warmup: int = 1
    step: StepKind = "jit"
    steps_per_call: int = 1
    init_seed: int | None = None
    evaluate: bool = False


def make_spec(
    workload: str,
    global_batch: int,
    dtype: str = "float32",
    width: int | None = None,
    seq_len: int = 256,
    devices: int = 1,
    data_dir: str | None = None,
    attention: str | None = None,
    block_repeats: int | None = None,
    num_layers: int | None = None,
    num_heads: int | None = None,
    max_seq_len: int | None = None,
    **timing: Any,
) -> Spec:
    """A Spec from plain values, validated like a training config (ConfigError names the field);
    model keys left None keep their defaults. ``timing``: the remaining Spec fields (steps,
    repeats, warmup, step, steps_per_call, init_seed, evaluate).

    Raises ValueError if ``steps`` is not a multiple of ``steps_per_call`` or a step kind is unknown.
    """
    model = {"workload": workload, "dtype": dtype, "width": width}
    if workload == "transformer":
        model.update(
            max_seq_len=max_seq_len or max(seq_len, 256),
            attention=attention or "auto",
            num_layers=num_layers,
            num_heads=num_heads,
        )
    elif workload == "shared_block_mlp":
        model.update(block_repeats=block_repeats)
    model = {k: v for k, v in model.items() if v is not None}
    # use_gpu tells the config whether cuDNN attention is possible at all (checked before compiling).
    workers = {"devices_per_worker": devices, "use_gpu": jax.devices()[0].platform == "gpu"}
    data = {"data_dir": data_dir, **({"seq_len": seq_len} if workload == "transformer" else {})}
    try:
        trial = parse_trial(
            {"model": model, "train": {"global_batch": global_batch}, "data": data, "workers": workers},
            source="(bench)",
        )
        check_attention(trial, source="(bench)")
    except ConfigError as err:
        raise ConfigError(
            f"{err}\n  (bench options: --batch is train.global_batch, --devices is "
            f"workers.devices_per_worker, --width is model.width, --seq-len is data.seq_len)"
        ) from None
    spec = Spec(trial, devices, **timing)
    if spec.step not in STEP_KINDS:
        raise ValueError(f"step must be one of {', '.join(STEP_KINDS)}, got {spec.step!r}")
    if min(spec.steps, spec.repeats, spec.steps_per_call) < 1 or spec.steps % spec.steps_per_call:
        raise ValueError(
            f"steps ({spec.steps}) must be a positive multiple of steps_per_call "
            f"({spec.steps_per_call}), repeats >= 1"
        )
    if spec.steps_per_call > 1 and spec.step != "jit":
        raise ValueError("steps_per_call > 1 needs step 'jit'")
    return spec


@dataclass
class Measurement:
    """The result row (JSON-safe values), the loss of every step run (warm-up included) and the
    final train state (device arrays)."""

    row: dict[str, Any]
    losses: list[float] = field(default_factory=list)
    state: Any = None


def stage_batches(arrays: Arrays, spec: Spec, mesh) -> list[dict[str, jax.Array]]:
    """Device-resident batches for one timed window (fewer if the data has fewer): each
    ``[global_batch, ...]``, or ``[steps_per_call, global_batch, ...]`` when several steps go per call."""
    batch, k = spec.trial.train.global_batch, spec.steps_per_call
    n_calls = min(spec.steps // k, num_rows(arrays) // (batch * k))
    if n_calls < 1:
        raise ValueError(
            f"global batch {batch} x steps_per_call {k} is more than the {num_rows(arrays)} training rows"
        )
    staged = []
    for c in range(n_calls):
        rows = {name: a[c * batch * k : (c + 1) * batch * k] for name, a in arrays.items()}
        if k == 1:
            staged.append(shard_batch(mesh, rows))
        else:
            stacked = {name: a.reshape(k, batch, *a.shape[1:]) for name, a in rows.items()}
            staged.append(shard_batch(mesh, stacked, stacked=True))
    return staged


def _compile(spec: Spec, model: Model, tx, mesh, state, batch) -> tuple[Callable, float]:
    if spec.step == "eager":
        return functools.partial(
            train_step, apply=model.apply, loss_fn=LOSSES[model.config.workload], tx=tx
        ), 0.0
    if spec.step == "shard_map":
        return compile_shard_map_train_step(model, tx, mesh, state, batch)
    return compile_train_step(model, tx, mesh, state, batch, steps_per_call=spec.steps_per_call)


def measure(spec: Spec, data: tuple[Arrays, Arrays] | None = None) -> Measurement:
    """Compile and time ``spec``'s step on real batches (``data``: the (train, held-out) arrays,
    default ``load_arrays(spec.trial)``).

    Returns a row with ``ms_per_step`` (median over repeats, per optimizer step),
    ``examples_per_sec`` (and ``tokens_per_sec``: predicted bytes, T - 1 per sequence, as the
    reference scripts count), ``final_loss``, ``compile_s``, model FLOPs, ``achieved_tflops`` and
    ``mfu`` (None where the device peak is unknown), plus shapes and the environment; with
    ``spec.evaluate`` also ``test_loss``/``test_accuracy`` (MLPs) or ``val_loss``/``val_perplexity``.
    Raises ConfigError/ValueError before compiling for sizes that cannot run on ``spec.devices``.
    """
    trial = spec.trial
    if spec.devices > len(jax.devices()):
        raise ValueError(
            f"devices {spec.devices} is more than the {len(jax.devices())} available"
            + (
                "; on a CPU add --cpu-devices N to force N host devices"
                if jax.devices()[0].platform == "cpu"
                else ""
            )
        )
    check_devices(trial.train.global_batch, spec.devices)
    mesh = make_mesh(jax.devices()[: spec.devices])
    train_arrays, held_out = data if data is not None else load_arrays(trial)
    batches = stage_batches(train_arrays, spec, mesh)
    model = build(trial.model)
    tx = make_optimizer(trial.learning_rate, trial.train.weight_decay)
    params = model.init(
        jax.random.key(INIT_SEED[trial.model.workload] if spec.init_seed is None else spec.init_seed)
    )
    state = replicate(init_state(params, tx), mesh)
    step, compile_s = _compile(spec, model, tx, mesh, state, batches[0])
    losses: list[jax.Array] = []
    sync = needs_sync_per_step(mesh)

    def call(i: int):
        nonlocal state
        state, metrics = step(state, batches[i % len(batches)])
        losses.append(metrics["loss"])
        return jax.block_until_ready(metrics) if sync else metrics

    timing = time_calls(call, spec.steps // spec.steps_per_call, spec.repeats, spec.warmup)
    flat = [float(x) for x in np.concatenate([np.ravel(v) for v in jax.device_get(losses)])]
    row = _row(spec, model, param_count(params), timing, compile_s, flat) | {"sync_each_step": sync}
    if spec.evaluate:
        row.update(_held_out_scores(trial, model, mesh, state.params, held_out))
    return Measurement(row, flat, state)


def _held_out_scores(trial: TrialConfig, model: Model, mesh, params, held_out: Arrays) -> dict[str, float]:
    scores = evaluate(
        jit_eval_step(model, mesh), params, held_out, eval_batch_size(trial, mesh.devices.size), mesh
    )
    if trial.model.workload == "transformer":
        return {"val_loss": scores["loss"], "val_perplexity": scores["perplexity"]}
    return {"test_loss": scores["loss"], "test_accuracy": scores["accuracy"]}


def _row(
    spec: Spec, model: Model, n_params: int, timing, compile_s: float, losses: list[float]
) -> dict[str, Any]:
    trial, cfg = spec.trial, spec.trial.model
    batch, seconds = trial.train.global_batch, timing.median_s / spec.steps_per_call
    env = environment(spec.devices)
    per_example = mfu.flops_per_example(cfg, trial.data.seq_len)
    row = {
        "workload": cfg.workload,
        "step": spec.step,
        "steps_per_call": spec.steps_per_call,
        **env,
        "dtype": cfg.dtype,
        "global_batch": batch,
        "per_device_batch": batch // spec.devices,
        "width": cfg.width,
        "params": n_params,
        "input_shape": _input_shape(trial),
        "steps": spec.steps,
        "repeats": spec.repeats,
        "warmup_calls": spec.warmup,
        "ms_per_step": seconds * 1e3,
        "ms_per_step_repeats": [t / spec.steps_per_call * 1e3 for t in timing.repeats_s],
        "examples_per_sec": batch / seconds,
        "final_loss": losses[-1],
        "compile_s": compile_s,
        "model_flops_per_example": per_example,
        "achieved_tflops": batch / seconds * per_example / 1e12,
        "mfu": mfu.mfu(batch / seconds, per_example, env["device_kind"], cfg.dtype, spec.devices),
    }
    if cfg.workload == "transformer":
        row.update(
            seq_len=trial.data.seq_len,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            tokens_per_sec=batch / seconds * tokens_per_example(trial),
            model_flops_per_token=mfu.flops_per_token(cfg, trial.data.seq_len),
            attention=model.attention.implementation,
            attention_note=model.attention.reason,
        )
    return row


def _input_shape(trial: TrialConfig) -> list[int]:
    if trial.model.workload == "transformer":
        return [trial.train.global_batch, trial.data.seq_len]
    return [trial.train.global_batch, 784]
