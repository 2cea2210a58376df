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

# Free space a save leaves untouched: the run's own small records (Ray Tune's experiment state, Ray
# Train's checkpoint list, logs) must still be writable after a save refused for want of room.
RESERVE_BYTES = 1 << 20


class CheckpointError(ValueError):
    """A path that is not a usable checkpoint; the message names it and says what is wrong."""


class CheckpointSaveError(OSError):
    """A save that could not finish; the message names the folder, what was saved and the cause."""


def finish(checkpointers: list[ocp.StandardCheckpointer]) -> None:
    """Wait for every one of ``start_saves``' writes and commits (a barrier of every process), all even
    when one fails; raises the first failure."""
    failures = []
    for checkpointer in checkpointers:
        try:
            checkpointer.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - Orbax and TensorStore raise bare Exceptions
            failures.append(err)
        checkpointer.close()
    if failures:
        raise failures[0]


def start_saves(items: dict[Path, Any]) -> list[ocp.StandardCheckpointer]:
    """Start one collective Orbax save of each ``{path: tree}`` (every process alike, each writing replica
    0 of the shards it holds): returns once the arrays are in host memory, writes on until ``finish``.
    Raises OSError(ENOSPC) before writing when a disk has less room than this process's bytes plus
    ``RESERVE_BYTES`` (a path whose parent is missing is not checked)."""
    need: dict[int, tuple[int, Path]] = {}  # {device: (bytes this process writes there, a folder on it)}
    for path, tree in items.items():
        try:
            device = path.parent.stat().st_dev
        except OSError:
            continue
        leaves = jax.tree.leaves(tree)
        arrays = [a for a in leaves if isinstance(a, jax.Array)]
        mine = sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.replica_id == 0)
        if jax.process_index() == 0:  # host arrays: written whole by process 0
            mine += sum(getattr(a, "nbytes", 0) for a in leaves if not isinstance(a, jax.Array))
        need[device] = (need.get(device, (0,))[0] + mine, path.parent)
    for bytes_, where in need.values():
        free = shutil.disk_usage(where).free
        if free < bytes_ + RESERVE_BYTES:
            raise OSError(
                errno.ENOSPC,
                f"No space left on device: the arrays need {bytes_ / 2**20:.1f} MiB on the disk holding "
                f"{where}, {free / 2**20:.1f} MiB are free ({RESERVE_BYTES >> 20} MiB kept for the run's "
                "records)",
            )
    started: list[ocp.StandardCheckpointer] = []
    try:
        for path, tree in items.items():
            started.append(ocp.StandardCheckpointer())
            started[-1].save(path, tree)
    except Exception:  # those started are finished first
        with contextlib.suppress(Exception):
            finish(started)
        raise
    return started


def key_names(path: tuple) -> tuple[str, ...]:
    """A PyTree key path as plain names (dict keys, list indices, attributes; NNX's ``value`` dropped),
    so Orbax's metadata tree and an NNX State target compare."""
    names = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return names[:-1] if names and names[-1] == "value" else names


def restore_tree(path: Path, target: Any, into: str, whose: str = "model") -> Any:
    """Orbax's restore of ``path`` into ``target`` (``into`` words it: "the model"), its shapes checked
    first. Raises CheckpointError naming ``path`` and the first entry of the ``whose`` ("model",
    "optimiser") not saved or saved with another shape, or with Orbax's error as the cause when the
    save cannot be read."""
    kind = "optimiser entry" if whose == "optimiser" else "parameter"
    try:
        meta = ocp.StandardCheckpointer().metadata(path)
        meta = getattr(meta, "item_metadata", meta)
        leaves, _ = jax.tree_util.tree_flatten_with_path(
            getattr(meta, "tree", meta), is_leaf=lambda x: hasattr(x, "shape")
        )
        saved = {key_names(k): v for k, v in leaves}
        for key, want in jax.tree_util.tree_flatten_with_path(target)[0]:
            name, have = "/".join(key_names(key)), saved.get(key_names(key))
            if have is None:
                mismatch = f"it has no {kind} {name} (the {whose} expects shape {tuple(want.shape)})"
                break
            if tuple(have.shape) != tuple(want.shape):
                mismatch = (
                    f"{kind} {name} has shape {tuple(have.shape)} in the checkpoint but "
                    f"{tuple(want.shape)} in the {whose} (a different model config)"
                )
                break
        else:
            return ocp.StandardCheckpointer().restore(path, target)
    except Exception as err:  # noqa: BLE001 - Orbax raises bare Exceptions for damaged or unreadable data
        raise CheckpointError(f"{path} could not be restored into {into}: {err}") from err
    raise CheckpointError(f"{path} could not be restored into {into}: {mismatch}")
