"""The explicit data-parallel train step: ``jax.shard_map`` over ``data`` with hand-written ``pmean``s.

Each device runs ``local_train_step`` on its rows ``[B / devices, ...]``, ``pmean``s loss, accuracy
and gradients, and applies the same Optax update to its replicated state. The mean of per-device
means is the global mean because ``check_devices`` enforces equal rows per device; ``check_vma=True``
makes a missing average a trace-time error."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxray.parallel.mesh import DATA_AXIS
from jaxray.train.step import Batch, LossFn, TrainState, apply_gradients, loss_and_grads


def local_train_step(
    state: TrainState,
    batch: Batch,
    *,
    apply: Callable,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    axis: str = DATA_AXIS,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The per-device body: ``batch`` is this device's slice; returns the same state on every device.

    Params are cast to varying before differentiating: otherwise JAX returns gradients already
    psum'd over devices and ``pmean`` keeps that sum (``devices`` x the mean gradient)."""
    local_params = jax.lax.pcast(state.params, axis, to="varying")
    (loss, accuracy), grads = loss_and_grads(local_params, batch, apply=apply, loss_fn=loss_fn)
    grads, loss, accuracy = jax.lax.pmean((grads, loss, accuracy), axis)
    return apply_gradients(state, grads, loss, accuracy, tx=tx)


def shard_map_train_step(
    state: TrainState, batch: Batch, *, mesh: Mesh, axis: str = DATA_AXIS, **step: Any
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One AdamW step on the mean loss of the global ``batch`` (sharded on ``axis``); ``state`` is
    replicated over ``mesh``. Returns the new state and float32 scalar ``loss``, ``accuracy``,
    ``grad_norm``. Call under ``jax.jit``."""
    body = functools.partial(local_train_step, axis=axis, **step)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis)), out_specs=(P(), P()), check_vma=True)(
        state, batch
    )
