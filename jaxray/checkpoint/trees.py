"""One PyTree through Orbax (a StandardCheckpointer folder): saved by one process of a
multi-process program alone, restored into an abstract target whose leaves carry the shardings
wanted, its shapes checked first so that a mismatch names the entry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Sharding

PARAMETER, OPTIMISER_ENTRY = "parameter", "optimiser entry"  # what ``restore_tree`` names a leaf


class CheckpointError(ValueError):
    """A path that is not a usable checkpoint; the message names it and says what is wrong."""


class CheckpointSaveError(OSError):
    """A save that could not finish; the message names the folder, what was saved and the cause."""


def local_copy(tree: Any) -> Any:
    """This process's copy of a PyTree that every process holds whole on its own devices (replicated,
    or split only among them, as ``fsdp`` within a worker splits params): host arrays assembled from
    the local shards in a multi-process program (whose global arrays one process cannot read
    whole), the tree itself otherwise."""
    if jax.process_count() == 1:
        return tree

    def host(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        out, copied, held = np.empty(x.shape, x.dtype), set(), 0
        for shard in x.addressable_shards:  # one copy of each part, however many devices hold it
            part = tuple((s.start, s.stop) for s in shard.index)
            if part not in copied:
                copied.add(part)
                out[shard.index] = np.asarray(shard.data)
                held += shard.data.size  # parts are disjoint: fsdp splits a dimension
        if held != x.size:
            raise ValueError(
                f"process {jax.process_index()} holds {held} of the {x.size} elements of an array of "
                f"shape {x.shape}, so it cannot save it alone"
            )
        return out

    return jax.tree.map(host, tree)


def abstract(tree: Any, sharding: Sharding) -> Any:
    """ShapeDtypeStructs of ``tree``'s leaves carrying ``sharding``: an Orbax restore target."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def save_tree(path: Path, tree: Any) -> None:
    """One Orbax StandardCheckpointer save of a PyTree that each process holds whole (``local_copy``),
    finalised when this returns."""
    options = ocp.options.MultiprocessingOptions()
    if jax.process_count() > 1:
        # One process of a multi-process program saves alone: its local copy of the replicated
        # arrays, with Orbax's barriers limited to itself (the others never call save).
        me = jax.process_index()
        tree = local_copy(tree)
        options = ocp.options.MultiprocessingOptions(
            primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"jaxray-save-{me}"
        )
    checkpointer = ocp.StandardCheckpointer(multiprocessing_options=options)
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()


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
