"""The explicit data-parallel train step: ``jax.shard_map`` over ``data`` with hand-written ``pmean``s.

The counterpart of the auto-sharded step (``jaxray.train.loop.compile_train_step`` jits
``train_step`` on a ``data``-sharded batch and lets XLA place the all-reduce). Here each device
runs ``local_train_step`` on its own rows ``[B / devices, ...]`` of the global batch ``[B, ...]``:
it computes the mean loss, accuracy and gradients of its slice, averages all three across devices
with ``jax.lax.pmean``, and applies the same Optax update to its replicated copy of the state, so
the copies stay identical. Metrics (``loss``, ``accuracy``, ``grad_norm`` of the averaged
gradients) are those of ``jaxray.train.step.train_step``.

The mean of per-device means equals the mean over the global batch only because every device
holds the same number of rows: the ``data`` sharding splits the batch evenly, and
``jaxray.config.check_devices`` rejects a global batch that is not divisible by the device count.

``check_vma=True`` makes JAX type-check which values vary across ``data``: the replicated state
(``P()``) is invariant, the batch slice (``P("data")``) varies, ``pmean`` turns varying into
invariant, and ``out_specs=P()`` only accepts invariant outputs, so an average left out is an error
at trace time rather than silently diverging copies.
"""

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

    The params are cast to varying before differentiating, so the gradients are this device's own
    (varying) and the average is the explicit ``pmean`` below. Without the cast the gradients of
    the invariant params come back already summed over devices (JAX transposes the implicit
    invariant-to-varying broadcast into a ``psum``), ``pmean`` silently casts that sum back to
    varying and keeps it, and the step would use ``devices`` x the mean gradient; Adam's scale
    invariance nearly hides that in the params, ``grad_norm`` shows it (the parity test compares both).
    """
    local_params = jax.lax.pcast(state.params, axis, to="varying")
    (loss, accuracy), grads = loss_and_grads(local_params, batch, apply=apply, loss_fn=loss_fn)
    grads, loss, accuracy = jax.lax.pmean((grads, loss, accuracy), axis)
    return apply_gradients(state, grads, loss, accuracy, tx=tx)


def shard_map_train_step(
    state: TrainState, batch: Batch, *, mesh: Mesh, axis: str = DATA_AXIS, **step: Any
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One AdamW step on the mean loss of the global ``batch`` (leading dimension sharded on ``axis``).

    ``step`` holds ``local_train_step``'s ``apply``, ``loss_fn`` and ``tx``. ``state`` is replicated
    over ``mesh``; returns the new replicated state and float32 scalar metrics ``loss``,
    ``accuracy`` and ``grad_norm``, as ``train_step`` does. Call it under ``jax.jit``.
    """
    body = functools.partial(local_train_step, axis=axis, **step)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis)), out_specs=(P(), P()), check_vma=True)(
        state, batch
    )
