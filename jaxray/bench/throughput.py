"""The clock (``time_calls``) and one config's step compiled and timed on real batches pre-staged on the
devices: warm-up on batch 0, then batches 0, 1, ..., from the reference scripts' seeds (``INIT_SEED``)."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jaxlib
import numpy as np

from jaxray.bench import mfu, profile
from jaxray.config import ConfigError, TrialConfig, parse_trial
from jaxray.data.batching import Arrays, Source, Windows, gather, num_rows
from jaxray.data.workloads import load_arrays
from jaxray.models import build, param_count
from jaxray.parallel.checks import check_attention, check_trial
from jaxray.parallel.mesh import needs_sync_per_step, shard_batch, trial_mesh
from jaxray.train import compile_cache
from jaxray.train.held_out import evaluate
from jaxray.train.loop import compile_shard_map_train_step, compile_train_step, jit_eval_step
from jaxray.train.run import eval_batch_size, tokens_per_example
from jaxray.train.step import LOSSES, dropout_keys, make_optimizer, placed_init_state, train_step

STEP_KINDS = ("jit", "shard_map", "eager")
INIT_SEED = {"transformer": 1, "mlp": 3, "shared_block_mlp": 1}  # lab 7: nnx.Rngs(1); lab 4: key(3)
TIMING = ("steps", "repeats", "warmup", "step", "steps_per_call", "evaluate", "profile")


def time_calls(call: Callable[[int], Any], calls: int, repeats: int, warmup: int = 1) -> tuple[float, list]:
    """(median s per call, every window's s per call) of ``call(i)``, which returns arrays to wait on."""
    if calls < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"calls and repeats must be >= 1 and warmup >= 0, got {calls}, {repeats}, {warmup}")
    for i in range(warmup):
        jax.block_until_ready(call(i))
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([call(i) for i in range(calls)][-1])
        per_call.append((time.perf_counter() - start) / calls)
    return statistics.median(per_call), per_call


def environment(devices: int) -> dict[str, Any]:
    """Platform, device kind, devices used, jax and jaxlib versions."""
    d = jax.devices()[0]
    return {"platform": d.platform, "device_kind": d.device_kind, "devices": devices, "jax": jax.__version__,
            "jaxlib": jaxlib.__version__}  # fmt: skip


@dataclass(frozen=True)
class Spec:
    """``repeats`` windows of ``steps`` steps (``steps_per_call`` a dispatch) after ``warmup`` calls."""

    trial: TrialConfig
    devices: int = 1
    steps: int = 10
    repeats: int = 3
    warmup: int = 1
    step: str = "jit"
    steps_per_call: int = 1
    evaluate: bool = False
    profile: bool = False


def make_spec(workload: str, global_batch: int, dtype: str = "float32", width: int | None = None,
              seq_len: int = 256, devices: int = 1, data_dir: str | None = None,
              mesh: dict[str, int] | None = None, **more: Any) -> Spec:  # fmt: skip
    """A Spec checked like a training config (ConfigError); ``more``: ``TIMING`` or model fields."""
    lm, timing = workload == "transformer", {k: v for k, v in more.items() if k in TIMING}
    model = {"workload": workload, "dtype": dtype, "width": width, **more}
    model |= {"max_seq_len": more.get("max_seq_len") or max(seq_len, 256)} if lm else {}
    raw = {"model": {k: v for k, v in model.items() if v is not None and k not in TIMING}}
    raw["train"] = {"global_batch": global_batch}
    raw["data"] = {"data_dir": data_dir} | ({"seq_len": seq_len} if lm else {})
    raw["workers"] = {"devices_per_worker": devices, "accelerator": jax.default_backend()}
    raw["parallel"] = mesh or {}
    try:
        check_attention(trial := parse_trial(raw, source="(bench)"), source="(bench)")
    except ConfigError as err:
        hint = "--batch: train.global_batch, --devices: workers.devices_per_worker, --mesh: parallel"
        raise ConfigError(f"{err}\n  ({hint})") from None
    spec = Spec(trial, devices, **timing)
    shape = trial.mesh_shape
    if spec.step == "shard_map" and shape["fsdp"] * shape["tensor"] > 1:  # it takes the params whole
        raise ValueError(
            f"step shard_map keeps the params whole: it needs fsdp 1 and tensor 1, "
            f"got fsdp {shape['fsdp']}, tensor {shape['tensor']}"
        )
    if spec.step not in STEP_KINDS or (spec.steps_per_call > 1 and spec.step != "jit"):
        raise ValueError(f"step must be one of {STEP_KINDS} (jit for steps_per_call > 1), got {spec.step!r}")
    if min(spec.steps, spec.repeats, spec.steps_per_call) < 1 or spec.steps % spec.steps_per_call:
        raise ValueError(f"steps {spec.steps} must be a multiple of steps_per_call {spec.steps_per_call}")
    return spec


class Measurement(NamedTuple):
    """The row, the loss of every step run (warm-up included) and the final train state."""

    row: dict[str, Any]
    losses: list[float]
    state: Any


def stage_batches(arrays: Source, spec: Spec, mesh) -> list[dict[str, jax.Array]]:
    """Device batches of one window: ``[global_batch, ...]`` or ``[steps_per_call, global_batch, ...]``,
    in the reference scripts' order (``default_rng(train.seed).permutation`` of the rows, for text of
    the windows at multiples of ``seq_len``) so that ``compare`` can check their final losses."""
    batch, k = spec.trial.train.global_batch, spec.steps_per_call
    rng = np.random.default_rng(spec.trial.train.seed)
    if isinstance(arrays, Windows):
        starts = rng.permutation(len(arrays.tokens) // arrays.seq_len)[: spec.steps * batch] * arrays.seq_len
        arrays = arrays.gather(starts)
    else:
        arrays = gather(arrays, rng.permutation(num_rows(arrays))[: spec.steps * batch])
    if (n_calls := min(spec.steps // k, num_rows(arrays) // (batch * k))) < 1:
        raise ValueError(f"batch {batch} x steps_per_call {k} is more than the {num_rows(arrays)} rows")
    windows = [{n: a[c * batch * k : (c + 1) * batch * k] for n, a in arrays.items()} for c in range(n_calls)]
    if k > 1:
        windows = [{n: a.reshape(k, batch, *a.shape[1:]) for n, a in rows.items()} for rows in windows]
    return [shard_batch(mesh, rows, stacked=k > 1) for rows in windows]


def check_device_count(devices: int) -> None:
    """ValueError when fewer than ``devices`` devices are visible."""
    if devices > len(jax.devices()):
        hint = "; on a CPU, --cpu-devices N forces N host devices" if jax.default_backend() == "cpu" else ""
        raise ValueError(f"devices {devices} is more than the {len(jax.devices())} available{hint}")


def _compile(spec: Spec, model, tx, mesh, state, batch) -> tuple[Callable, float]:
    if spec.step == "eager":
        loss_fn = LOSSES[model.config.workload]
        return functools.partial(train_step, apply=model.apply, loss_fn=loss_fn, tx=tx), 0.0
    if spec.step == "shard_map":
        return compile_shard_map_train_step(model, tx, mesh, state, batch)
    dropout = dropout_keys(spec.trial)
    return compile_train_step(
        model, tx, mesh, state, batch, steps_per_call=spec.steps_per_call, dropout=dropout
    )


def measure(spec: Spec, data: tuple[Arrays, Arrays] | None = None) -> Measurement:
    """Compile and time ``spec``'s step on ``data`` ((train, held-out); default ``load_arrays``)."""
    trial = spec.trial
    check_device_count(spec.devices)
    mesh = trial_mesh(trial, jax.devices()[: spec.devices])
    check_trial(trial, mesh.shape)
    train_arrays, held_out = data if data is not None else load_arrays(trial)
    batches = stage_batches(train_arrays, spec, mesh)
    model = build(trial.model, seq_len=trial.data.seq_len)
    tx = make_optimizer(trial.learning_rate, trial.train.weight_decay)
    state = placed_init_state(model, tx, mesh, jax.random.key(INIT_SEED[trial.model.workload]))
    n_params = param_count(state.params)  # before the first step donates the state
    with compile_cache.watch() as cache:
        step, compile_s = _compile(spec, model, tx, mesh, state, batches[0])
    losses, sync = [], needs_sync_per_step(mesh)

    def call(i: int):
        nonlocal state
        state, metrics = step(state, batches[i % len(batches)])
        losses.append(metrics["loss"])
        return jax.block_until_ready(metrics) if sync else metrics

    median_s, windows = time_calls(call, spec.steps // spec.steps_per_call, spec.repeats, spec.warmup)
    flat = [float(x) for x in np.concatenate([np.ravel(v) for v in jax.device_get(losses)])]
    row = _row(spec, model, n_params, median_s / spec.steps_per_call, compile_s, flat)
    row |= {"sync_each_step": sync, "ms_per_step_repeats": [t / spec.steps_per_call * 1e3 for t in windows]}
    row |= cache.fields()
    if spec.profile:  # a few more steps under jax.profiler, after the timed ones
        row["profile"] = profile.profile(step, lambda: [call(i) for i in range(3)])
    if spec.evaluate:
        size = eval_batch_size(trial, mesh.devices.size)
        scores = evaluate(jit_eval_step(model, mesh), state.params, held_out, size, mesh)
        lm = trial.model.workload == "transformer"
        names = ("val_loss", "val_perplexity") if lm else ("test_loss", "test_accuracy")
        row |= dict(zip(names, (scores["loss"], scores["perplexity" if lm else "accuracy"])))
    return Measurement(row, flat, state)


def _row(spec: Spec, model, n_params: int, seconds: float, compile_s: float, losses: list[float]) -> dict:
    trial, cfg, batch = spec.trial, spec.trial.model, spec.trial.train.global_batch
    env, rate = environment(spec.devices), batch / seconds
    per_example = mfu.flops_per_example(cfg, trial.data.seq_len)
    row = env | {
        "workload": cfg.workload, "step": spec.step, "steps_per_call": spec.steps_per_call,
        "dtype": cfg.dtype, **trial.mesh_shape, "global_batch": batch,
        "per_device_batch": batch // (trial.mesh_shape["data"] * trial.mesh_shape["fsdp"]),
        "width": cfg.width, "params": n_params, "steps": spec.steps, "repeats": spec.repeats,
        "ms_per_step": seconds * 1e3, "examples_per_sec": rate,
        "final_loss": losses[-1], "compile_s": compile_s, "achieved_tflops": rate * per_example / 1e12,
        "mfu": mfu.mfu(rate, per_example, env["device_kind"], cfg.dtype, spec.devices),
    }  # fmt: skip
    if cfg.workload == "transformer":
        row |= {"seq_len": trial.data.seq_len, "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
                "tokens_per_sec": rate * tokens_per_example(trial),
                "attention": model.attention.implementation, "remat": cfg.remat,
                "scan_layers": cfg.scan_layers,
                "attention_note": model.attention.reason}  # fmt: skip
    return row
