"""The step loop: AOT compile (``compile_s``), step 1 timed alone (``warmup_s``), then steps 2..N timed
up to ``jax.block_until_ready``; input-pipeline time is inside, host time in hooks is not (``hook_s``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxray.models import Model
from jaxray.parallel.mesh import (
    DATA_AXIS,
    activation_sharding,
    batch_sharding,
    describe,
    replicated,
    shards_state,
    state_shardings,
)
from jaxray.train.step import (
    LOSSES,
    Batch,
    TrainState,
    apply_gradients,
    eval_step,
    loss_and_grads,
    train_step,
)

HookFn = Callable[[int, TrainState, dict[str, jax.Array]], None]


@dataclass(frozen=True)
class Hook:
    """Call ``fn(step, state, metrics)`` after every ``every``-th step and after the last step."""

    every: int
    fn: HookFn


class StopTraining(Exception):  # noqa: N818 - a signal, not an error
    """Raised by a hook to end the loop after the step it ran at (``run_loop`` returns that state)."""


@dataclass(frozen=True)
class LoopTiming:
    """Seconds: ``warmup_s`` for step 1, ``timed_s`` for steps 2..N (``timed_steps`` of them) without
    ``hook_s``, the host time hooks took in those steps."""

    warmup_s: float
    timed_s: float
    timed_steps: int
    hook_s: float = 0.0
    last_step: int | None = None  # the step a hook stopped the loop at (``StopTraining``); None: all ran

    @property
    def seconds_per_step(self) -> float:
        return self.timed_s / self.timed_steps if self.timed_steps else float("nan")


def compile_train_step(
    model: Model,
    tx,
    mesh: Mesh,
    state: TrainState,
    batch: dict[str, jax.Array],
    steps_per_call: int = 1,
    dropout: tuple[int, str] | None = None,
    shardings: Any = None,
):
    """AOT-compile the auto-sharded train step (laid out as ``_compile_step`` says) -> (compiled step,
    compile seconds). ``steps_per_call`` K > 1 scans K steps over ``[K, B, ...]``, metrics ``[K]``.
    ``dropout``: ``step.dropout_keys(trial)`` (None: no dropout); ``shardings``: the state's
    (``Layout.shardings``; None: ``state_shardings``)."""
    loss_fn = LOSSES[model.config.workload]
    step = laid_out(
        functools.partial(train_step, apply=model.apply, loss_fn=loss_fn, tx=tx, dropout=dropout), mesh
    )
    if steps_per_call > 1:
        step = functools.partial(jax.lax.scan, step)
    return _compile_step(step, mesh, state, batch, stacked=steps_per_call > 1, shardings=shardings)


def compile_shard_map_train_step(
    model: Model, tx, mesh: Mesh, state: TrainState, batch: dict[str, jax.Array]
):
    """AOT-compile the explicit data-parallel train step -> (compiled step, compile seconds), laid out
    as ``_compile_step`` says: under ``jax.shard_map`` over ``data`` each device takes the loss and
    gradients of its rows ``[B / devices, ...]``, ``pmean``s them and applies the same Optax update to
    its replicated state (the mean of per-device means is the global mean: ``check_devices`` enforces
    equal rows; ``check_vma=True`` makes a missing average a trace-time error). ValueError on a mesh
    whose ``fsdp`` or ``tensor`` is over 1 (the params are kept whole)."""
    if shards_state(mesh):
        raise ValueError(
            f"the shard_map step keeps the params whole: it needs parallel.fsdp 1 and parallel.tensor 1, "
            f"got mesh {describe(mesh.shape)}"
        )
    apply, loss_fn = model.apply, LOSSES[model.config.workload]

    def local_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        # Params cast to varying before differentiating: otherwise JAX returns gradients already
        # psum'd over devices and pmean keeps that sum (devices x the mean gradient).
        params = jax.lax.pcast(state.params, DATA_AXIS, to="varying")
        (loss, accuracy), grads = loss_and_grads(params, batch, apply=apply, loss_fn=loss_fn)
        grads, loss, accuracy = jax.lax.pmean((grads, loss, accuracy), DATA_AXIS)
        return apply_gradients(state, grads, loss, accuracy, tx=tx)

    specs = {"in_specs": (P(), P(DATA_AXIS)), "out_specs": (P(), P())}
    return _compile_step(jax.shard_map(local_step, mesh=mesh, check_vma=True, **specs), mesh, state, batch)


def _compile_step(
    step: Callable,
    mesh: Mesh,
    state: TrainState,
    batch: dict[str, jax.Array],
    stacked: bool = False,
    shardings: Any = None,
):
    """jit ``step(state, batch) -> (state, metrics)``, the state sharded by ``shardings`` (None:
    ``state_shardings``, replicated without ``fsdp``/``tensor``) and donated, the batch split, the
    metrics replicated; AOT compile, timed."""
    shardings = state_shardings(state, mesh) if shardings is None else shardings
    jitted = jax.jit(
        step,
        in_shardings=(shardings, batch_sharding(mesh, stacked)),
        out_shardings=(shardings, replicated(mesh)),
        donate_argnums=0,
    )
    start = time.perf_counter()
    compiled = jitted.lower(state, batch).compile()
    return compiled, time.perf_counter() - start


def laid_out(fn: Callable, mesh: Mesh) -> Callable:
    """``fn`` traced with its activations laid out on ``mesh`` (``activation_sharding``)."""

    @functools.wraps(fn)
    def traced(*args):
        with activation_sharding(mesh):
            return fn(*args)

    return traced


def jit_eval_step(model: Model, mesh: Mesh, params: Any = None):
    """The jitted masked eval step (params sharded as in training: ``params``, the params' shardings,
    None: ``state_shardings``; batch split, sums replicated)."""
    step = laid_out(
        functools.partial(eval_step, apply=model.apply, loss_fn=LOSSES[model.config.workload]), mesh
    )
    if params is None:
        params = state_shardings(jax.eval_shape(model.init, jax.random.key(0)), mesh)
    return jax.jit(step, in_shardings=(params, batch_sharding(mesh)), out_shardings=replicated(mesh))


def run_loop(
    step_fn: Callable,
    state: TrainState,
    batches: Iterator[dict[str, jax.Array]],
    num_steps: int,
    hooks: tuple[Hook, ...] = (),
    sync_each_step: bool = False,
    start: int = 0,
) -> tuple[TrainState, LoopTiming]:
    """Run steps ``start + 1 .. num_steps`` of ``step_fn(state, batch) -> (state, metrics)`` over
    ``batches``; hooks get device metrics and global step numbers. ``sync_each_step`` waits for
    every step; a hook raising ``StopTraining`` ends the loop after its step (``last_step``). Raises
    ValueError if ``batches`` runs dry."""
    if start >= num_steps:  # resumed from the final checkpoint: nothing left to run or time
        return state, LoopTiming(0.0, float("nan"), 0)
    clock_start = time.perf_counter()
    warmup_s, timed_start, hook_s = 0.0, clock_start, 0.0
    first, stopped = start + 1, None
    for i in range(first, num_steps + 1):
        try:
            batch = next(batches)
        except StopIteration:
            raise ValueError(f"the batch iterator ended after {i - 1} of {num_steps} steps") from None
        state, metrics = step_fn(state, batch)
        if sync_each_step:
            jax.block_until_ready(metrics)
        due = [hook for hook in hooks if i % hook.every == 0 or i == num_steps]
        if due:
            # Wait for the device first, so only host-side hook time is taken off the clock.
            jax.block_until_ready(metrics)
            hook_start = time.perf_counter()
            try:
                for hook in due:
                    hook.fn(i, state, metrics)
            except StopTraining:
                stopped = i if i < num_steps else None  # at the last step it ends anyway
            if i > first:
                hook_s += time.perf_counter() - hook_start
        if i == first:
            jax.block_until_ready(state)
            timed_start = time.perf_counter()
            warmup_s = timed_start - clock_start
        if stopped is not None:
            break
    jax.block_until_ready(state)
    end, last = time.perf_counter(), stopped or num_steps
    if last - start == 1:
        return state, LoopTiming(warmup_s, warmup_s, 1, last_step=stopped)
    return state, LoopTiming(warmup_s, end - timed_start - hook_s, last - first, hook_s, stopped)
