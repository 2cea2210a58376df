"""The only place that builds meshes and shardings. Batches are split on their leading dimension
over every device. With ``fsdp`` 1 (the default) the mesh is 1-D, ``data``, and params and optimizer
state are replicated; with ``fsdp`` N > 1 it is (``data``, ``fsdp``) and each param and optimizer
state array with a dimension N divides is split N ways over ``fsdp`` (fully sharded data
parallelism: XLA gathers a param where the step uses it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS, FSDP_AXIS = "data", "fsdp"


def make_mesh(devices: Sequence[jax.Device] | None = None, fsdp: int = 1) -> Mesh:
    """A mesh over ``devices`` (default: all), ordered by process then id, so process p holds
    global-batch rows ``[p * B / P, (p + 1) * B / P)``: 1-D ``data`` for ``fsdp`` 1, else
    (``data``, ``fsdp``) of shape (devices / fsdp, fsdp), each ``fsdp`` group of consecutive devices.
    Raises ValueError if ``fsdp`` does not divide the device count."""
    devices = sorted(devices if devices is not None else jax.devices(), key=lambda d: (d.process_index, d.id))
    if fsdp < 1 or len(devices) % fsdp:
        raise ValueError(f"parallel.fsdp {fsdp} does not divide the {len(devices)} devices")
    if fsdp == 1:
        return Mesh(np.asarray(devices), (DATA_AXIS,))
    return Mesh(np.asarray(devices).reshape(len(devices) // fsdp, fsdp), (DATA_AXIS, FSDP_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds a full copy (scalar metrics; params and optimizer state without fsdp)."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, stacked: bool = False) -> NamedSharding:
    """Batch dimension split across every device (``data``, and ``fsdp`` when the mesh has it);
    other dimensions whole. The batch dimension is the leading one, or the second for a
    ``stacked`` ``[steps, B, ...]`` group of batches."""
    axes = DATA_AXIS if FSDP_AXIS not in mesh.axis_names else (DATA_AXIS, FSDP_AXIS)
    return NamedSharding(mesh, P(None, axes) if stacked else P(axes))


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """A NamedSharding per leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``s: params, optimizer
    state): replicated on a mesh without ``fsdp``; else split over ``fsdp`` on the leaf's largest
    dimension that the axis size divides (the first such on a tie), replicated when none does
    (scalars, small biases)."""
    if FSDP_AXIS not in mesh.axis_names:
        return jax.tree.map(lambda _: replicated(mesh), tree)
    n = mesh.shape[FSDP_AXIS]

    def one(leaf) -> NamedSharding:
        shape = getattr(leaf, "shape", ())
        dims = [d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n]
        if not dims:
            return replicated(mesh)
        spec = [None] * len(shape)
        spec[max(dims, key=lambda d: (shape[d], -d))] = FSDP_AXIS
        return NamedSharding(mesh, P(*spec))

    return jax.tree.map(one, tree)


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
