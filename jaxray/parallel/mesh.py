"""The only place that builds meshes and shardings: data parallelism over one axis, ``data``
(params and optimizer state replicated, batches split on their leading dimension)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D ``data`` mesh over ``devices`` (default: all), ordered by process then id, so process p
    holds global-batch rows ``[p * B / P, (p + 1) * B / P)``."""
    devices = devices if devices is not None else jax.devices()
    return Mesh(np.asarray(sorted(devices, key=lambda d: (d.process_index, d.id))), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds a full copy (params, optimizer state, scalar metrics)."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, stacked: bool = False) -> NamedSharding:
    """Batch dimension split across ``data``; other dimensions whole. The batch dimension is the
    leading one, or the second for a ``stacked`` ``[steps, B, ...]`` group of batches."""
    return NamedSharding(mesh, P(None, DATA_AXIS) if stacked else P(DATA_AXIS))


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place every leaf of ``tree`` on all devices of ``mesh``."""
    return jax.device_put(tree, replicated(mesh))


def shard_batch(
    mesh: Mesh, local_batch: Mapping[str, np.ndarray], stacked: bool = False
) -> dict[str, jax.Array]:
    """This process's rows ``{name: [B_local, ...]}`` -> global arrays ``[B_local x processes, ...]``
    (``stacked``: ``[K, B_local, ...]`` -> ``[K, B_local x processes, ...]``). Raises ValueError (from
    JAX) if B_local is not divisible by this process's device count."""
    sharding = batch_sharding(mesh, stacked)
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()
    }


def needs_sync_per_step(mesh: Mesh) -> bool:
    """True for a mesh of several CPU devices, where XLA's in-process all-reduce can deadlock when
    many steps are dispatched ahead (JAX 0.10.2), so loops wait for each step."""
    return mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"
