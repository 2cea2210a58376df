"""What a checkpoint's save records and every read compares: the SHA-256 of each file
(``file_digests``, checked before the arrays are read and again after) and of the arrays themselves
(``array_digest``, compared with what was restored: ``check_arrays``)."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxray.checkpoint.failures import CheckpointError
from jaxray.checkpoint.trees import key_names, local_copy


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_all(paths: list[Path]) -> list[str]:  # hashlib releases the GIL: files in parallel
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256, paths))


def file_digests(directory: Path, manifests: tuple[str, ...]) -> dict[str, str]:
    """{path relative to ``directory``: SHA-256} of every file but the digest manifests."""
    rels = [f.relative_to(directory).as_posix() for f in sorted(directory.rglob("*")) if f.is_file()]
    rels = [r for r in rels if r not in manifests]
    return dict(zip(rels, sha256_all([directory / r for r in rels]), strict=True))


def array_digest(tree: Any) -> str:
    """SHA-256 (hex) of ``tree``'s arrays as this process holds them (``local_copy``): each leaf's
    name, dtype, shape and bytes, in name order, whatever their sharding. A save records it and a
    restore compares it: the one check that sees the bytes Orbax read, not the files' bytes before
    or after (a fresh user changed a params file through a shared mmap during the read and changed
    it back before the files were hashed again)."""
    digest = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path(local_copy(tree))[0]
    for names, leaf in sorted(((key_names(key), leaf) for key, leaf in leaves), key=lambda kv: kv[0]):
        array = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{'/'.join(names)}|{array.dtype.str}|{array.shape}\n".encode())
        digest.update(array.reshape(-1).view(np.uint8))
    return digest.hexdigest()


def check_arrays(directory: Path, recorded: dict[str, str], restored: dict[str, Any]) -> None:
    """Raise CheckpointError "changed while it was read" when a restored tree (``restored``: its
    folder name -> the tree) differs from the ``array_digest`` its save recorded (``recorded``, the
    manifest's "arrays"; checkpoints saved before it have none: nothing to compare)."""
    if not isinstance(recorded, dict):
        raise CheckpointError(f"{directory}'s digest manifest is damaged: its arrays are no object")
    for name, tree in restored.items():
        if name in recorded and array_digest(tree) != recorded[name]:
            raise CheckpointError(
                f"{directory} changed while it was read: the arrays restored from {name}/ do not "
                f"match the SHA-256 its save recorded, so what was read is not what was verified; "
                f"read it again once nothing writes to it (refused again: the record was edited or "
                f"the checkpoint is damaged)"
            )
