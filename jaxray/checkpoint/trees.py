"""One PyTree through Orbax (a StandardCheckpointer folder): saved collectively, each process writing
its own shards, asynchronously; restored into an abstract target whose leaves carry the shardings
wanted (any mesh, any device count), its shapes checked first so that a mismatch names the entry."""

from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Sharding

PARAMETER, OPTIMISER_ENTRY = "parameter", "optimiser entry"  # what ``restore_tree`` names a leaf
# Free space a save leaves untouched: the run's own small records (Ray Tune's experiment state, Ray
# Train's checkpoint list, logs) must still be writable after a save refused for want of room.
RESERVE_BYTES = 1 << 20


class CheckpointError(ValueError):
    """A path that is not a usable checkpoint; the message names it and says what is wrong."""


class CheckpointSaveError(OSError):
    """A save that could not finish; the message names the folder, what was saved and the cause."""


def abstract(tree: Any, sharding: Sharding) -> Any:
    """ShapeDtypeStructs of ``tree``'s leaves carrying ``sharding``: an Orbax restore target."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def finish(checkpointers: list[ocp.StandardCheckpointer]) -> None:
    """Wait for every one of ``start_saves``' writes and Orbax's commits (a barrier of every process),
    all of them even when one fails (none keeps writing afterwards); raises the first failure."""
    failures = []
    for checkpointer in checkpointers:
        try:
            checkpointer.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - Orbax and TensorStore raise bare Exceptions
            failures.append(err)
        checkpointer.close()
    if failures:
        raise failures[0]


def own_bytes(tree: Any) -> int:
    """Bytes of ``tree``'s arrays this process writes: replica 0 of each shard it holds (a jax.Array),
    every byte of a host array on process 0."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            total += sum(s.data.nbytes for s in leaf.addressable_shards if s.replica_id == 0)
        elif jax.process_index() == 0:
            total += getattr(leaf, "nbytes", 0)
    return total


def check_room(items: dict[Path, Any]) -> None:
    """Raise OSError(ENOSPC) when a filesystem that ``items``' paths are on has less free space than
    this process's bytes of them plus ``RESERVE_BYTES``: a save that cannot fit fails before writing,
    instead of filling the disk under the run's own records. Paths whose parent is missing are
    skipped (created by Orbax, on storage this cannot see)."""
    need: dict[int, tuple[int, Path]] = {}
    for path, tree in items.items():
        try:
            device = path.parent.stat().st_dev
        except OSError:
            continue
        bytes_, _ = need.get(device, (0, path.parent))
        need[device] = (bytes_ + own_bytes(tree), path.parent)
    for bytes_, where in need.values():
        free = shutil.disk_usage(where).free
        if free < bytes_ + RESERVE_BYTES:
            raise OSError(
                errno.ENOSPC,
                f"No space left on device: the arrays need {bytes_ / 2**20:.1f} MiB on the disk holding "
                f"{where}, {free / 2**20:.1f} MiB are free ({RESERVE_BYTES >> 20} MiB kept for the run's "
                "records)",
            )


def start_saves(items: dict[Path, Any]) -> list[ocp.StandardCheckpointer]:
    """Start one collective Orbax save of each ``{path: tree}``: every process of the program calls it
    with the same trees and writes the shards it holds (replica 0 of each), the primary process the
    metadata and the commit; no process gathers an array whole. Returns once the arrays are copied
    to host memory; the writes go on in the background until ``finish``. If one cannot start, those
    started are finished first. Raises OSError(ENOSPC) before writing when the disk has no room
    (``check_room``)."""
    check_room(items)
    started: list[ocp.StandardCheckpointer] = []
    try:
        for path, tree in items.items():
            started.append(ocp.StandardCheckpointer())
            started[-1].save(path, tree)
    except Exception:
        with contextlib.suppress(Exception):
            finish(started)
        raise
    return started


def key_names(path: tuple) -> tuple[str, ...]:
    """A PyTree key path as plain names (dict keys, list indices, attributes; NNX's ``value`` dropped),
    so Orbax's metadata tree and an NNX State target compare."""
    names = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return names[:-1] if names and names[-1] == "value" else names


def _shape_mismatch(path: Path, target: Any, kind: str) -> str | None:
    """The first ``kind`` (parameter, optimiser entry) whose saved shape differs from ``target``'s
    or that was not saved, in words; None when every one fits."""
    meta = ocp.StandardCheckpointer().metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    leaves = jax.tree_util.tree_flatten_with_path(
        getattr(meta, "tree", meta), is_leaf=lambda x: hasattr(x, "shape")
    )
    saved = {key_names(k): v for k, v in leaves[0]}
    whose = "optimiser" if kind == OPTIMISER_ENTRY else "model"
    for key, want in jax.tree_util.tree_flatten_with_path(target)[0]:
        name, have = "/".join(key_names(key)), saved.get(key_names(key))
        if have is None:
            return f"it has no {kind} {name} (the {whose} expects shape {tuple(want.shape)})"
        if tuple(have.shape) != tuple(want.shape):
            return (
                f"{kind} {name} has shape {tuple(have.shape)} in the checkpoint but "
                f"{tuple(want.shape)} in the {whose} (a different model config)"
            )
    return None


def restore_tree(path: Path, target: Any, into: str, kind: str = PARAMETER) -> Any:
    """Orbax's restore of ``path`` into ``target`` (``into`` words it: "the model"), its shapes
    checked first. Raises CheckpointError naming ``path`` and the entry whose shape differs, or
    Orbax's own error as the cause (``from`` it) when the save cannot be read."""
    try:
        mismatch = _shape_mismatch(path, target, kind)
        if mismatch is None:
            return ocp.StandardCheckpointer().restore(path, target)
    except Exception as err:  # noqa: BLE001 - Orbax raises bare Exceptions for damaged or unreadable data
        raise CheckpointError(f"{path} could not be restored into {into}: {err}") from err
    raise CheckpointError(f"{path} could not be restored into {into}: {mismatch}")
