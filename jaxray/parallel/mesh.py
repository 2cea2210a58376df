"""The only place that builds meshes and shardings: a (``data``, ``fsdp``, ``tensor``) mesh, and
``RULES``, the one table from the params' logical axis names (``jaxray.models.axes``) to mesh axes.
Batches are split over (``data``, ``fsdp``); ``fsdp`` splits params and optimizer state on their
``embed``-like dimensions (fully sharded data parallelism: XLA gathers a param where the step uses it);
``tensor`` splits ``heads``, ``mlp`` and ``vocab`` (Megatron-style tensor parallelism: XLA all-reduces
over ``tensor`` after each row-split matmul). Sources: Flax's lm1b NNX example, MaxText's rules."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxray.config import MESH_AXES, TrialConfig
from jaxray.models.axes import activation_layout, axes_of, param_name

DATA_AXIS, FSDP_AXIS, TENSOR_AXIS = MESH_AXES  # the config's names: ParallelConfig's fields

# Logical axis name -> mesh axis (or axes); names not listed (head_dim, positions, norm, classes)
# are replicated.
RULES: dict[str, str | tuple[str, ...]] = {
    "batch": (DATA_AXIS, FSDP_AXIS),
    "embed": FSDP_AXIS,
    "pixels": FSDP_AXIS,
    "hidden": FSDP_AXIS,
    "heads": TENSOR_AXIS,
    "mlp": TENSOR_AXIS,
    "vocab": TENSOR_AXIS,
}


def make_mesh(devices: Sequence[jax.Device] | None = None, fsdp: int = 1, tensor: int = 1) -> Mesh:
    """A (``data``, ``fsdp``, ``tensor``) mesh over ``devices`` (default: all) of shape
    (devices / (fsdp x tensor), fsdp, tensor), devices ordered by process then id: ``tensor`` groups
    are consecutive devices (within a process when ``tensor`` divides its device count), and process
    p holds global-batch rows ``[p * B / P, (p + 1) * B / P)``. Raises ValueError if fsdp x tensor
    does not divide the device count."""
    devices = sorted(devices if devices is not None else jax.devices(), key=lambda d: (d.process_index, d.id))
    if fsdp < 1 or tensor < 1 or len(devices) % (fsdp * tensor):
        raise ValueError(
            f"parallel.fsdp {fsdp} x parallel.tensor {tensor} does not divide the {len(devices)} devices"
        )
    shape = (len(devices) // (fsdp * tensor), fsdp, tensor)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def trial_mesh(trial: TrialConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """``make_mesh`` with the trial's ``parallel`` sizes (``ParallelConfig.shape``) over ``devices``
    (default: all; fewer than ``workers.total_devices`` when an elastic group runs short)."""
    devices = list(devices if devices is not None else jax.devices())
    shape = trial.parallel.shape(len(devices))
    return make_mesh(devices, fsdp=shape["fsdp"], tensor=shape["tensor"])


def activation_sharding(mesh: Mesh):
    """The context in which a traced step's activations (``constrain``) follow ``RULES`` on ``mesh``."""
    return activation_layout(lambda names: NamedSharding(mesh, spec_for(names, mesh)))


def shards_state(mesh: Mesh) -> bool:
    """True when ``fsdp`` or ``tensor`` is over 1: params and optimizer state are split, not replicated."""
    return mesh.shape.get(FSDP_AXIS, 1) * mesh.shape.get(TENSOR_AXIS, 1) > 1


def describe(shape: Mapping[str, int]) -> str:
    """A mesh's axes (``Mesh.shape``: axis -> size) of size over 1, e.g. ``"data=2,tensor=2"``;
    ``"data=1"`` for one device."""
    return ",".join(f"{axis}={n}" for axis, n in shape.items() if n > 1) or f"{DATA_AXIS}=1"


def _mesh_axes(name: str | None) -> tuple[str, ...]:
    """The mesh axes ``RULES`` split logical axis ``name`` over (none: replicated)."""
    rule = RULES.get(name)
    return (rule,) if isinstance(rule, str) else rule or ()


def spec_for(axes: Sequence[str], mesh: Mesh | None = None) -> P:
    """The PartitionSpec ``RULES`` give logical ``axes`` (one name per dimension); with a ``mesh``, mesh
    axes of size 1 are left out (the same layout, a simpler spec)."""
    spec = []
    for name in axes:
        kept = tuple(a for a in _mesh_axes(name) if mesh is None or mesh.shape.get(a, 1) > 1)
        spec.append(kept[0] if len(kept) == 1 else (kept or None))
    return P(*spec)


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds a full copy (scalar metrics; params and optimizer state without fsdp)."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, stacked: bool = False) -> NamedSharding:
    """Batch dimension (the leading one; the second for ``stacked`` ``[steps, B, ...]``) split over
    ``data`` x ``fsdp`` (``RULES["batch"]``), replicated over ``tensor``; other dimensions whole."""
    batch = spec_for(("batch",), mesh)
    return NamedSharding(mesh, P(None, *batch) if stacked else batch)


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """A NamedSharding per leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``s: params, optimizer
    state, a TrainState): the leaf's logical names (``jaxray.models.axes``) through ``RULES``; scalars
    replicated. Raises KeyError for a leaf without names, ValueError naming the param, dimension
    and sizes where a mesh axis does not divide the dimension it splits (``unsplittable``)."""
    problems = unsplittable(tree, mesh.shape)
    if problems:
        raise ValueError("; ".join(problems))

    def one(path, leaf) -> NamedSharding:
        axes = axes_of(path, len(getattr(leaf, "shape", ())))
        if axes is None:
            raise KeyError(f"no logical axis names for param {param_name(path)} {tuple(leaf.shape)}")
        return NamedSharding(mesh, spec_for(axes, mesh))

    return jax.tree_util.tree_map_with_path(one, tree)


def unsplittable(tree: Any, mesh_shape: Mapping[str, int]) -> list[str]:
    """Why ``tree``'s leaves cannot be laid out on a mesh of ``mesh_shape`` (``{axis: size}``): one
    line per mesh axis and logical dimension it does not divide, naming the sizes and the first
    param concerned; empty when every split is even."""
    found: dict[tuple, list[str]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        for dim, (size, name) in enumerate(zip(shape, axes_of(path, len(shape)) or ())):
            for axis in _mesh_axes(name):
                n = mesh_shape.get(axis, 1)
                if n > 1 and size % n:
                    where = f"dimension {dim} of {param_name(path)} {list(shape)}"
                    found.setdefault((axis, n, name, size), []).append(where)
    return [
        f"parallel.{axis} {n} does not divide '{name}' of size {size} ({where[0]}"
        + (f", and {len(where) - 1} more params)" if len(where) > 1 else ")")
        for (axis, n, name, size), where in found.items()
    ]


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


def held_bytes(tree: Any) -> tuple[int, int]:
    """(bytes of ``tree``'s jax Arrays in all, the most any one of this process's devices holds of
    them): how far sharding cuts the memory a device needs for the train state."""
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    per_device: dict[Any, int] = {}
    for x in arrays:
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return sum(x.nbytes for x in arrays), max(per_device.values(), default=0)


def needs_sync_per_step(mesh: Mesh) -> bool:
    """True for a mesh of several CPU devices, where XLA's in-process all-reduce can deadlock when
    many steps are dispatched ahead (JAX 0.10.2), so loops wait for each step."""
    return mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"
