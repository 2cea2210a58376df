"""What a checkpoint's save records and every read compares: the SHA-256 of each file
(``file_digests``, checked before the arrays are read and again after) and of the arrays themselves
(``array_digest``, compared with what was restored: ``check_arrays``)."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxray.checkpoint.failures import CheckpointError
from jaxray.checkpoint.trees import key_names, local_copy

_SHA256 = re.compile(r"[0-9a-f]{64}")
log = logging.getLogger(__name__)
_warned_no_arrays: set[str] = set()  # folders already named in the "no array digests" warning


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


def check_recorded(manifest: Path, doc: dict[str, Any], trees: tuple[str, ...]) -> None:
    """Raise CheckpointError "<manifest> is damaged" when its "arrays" (absent in checkpoints saved
    before them) is no object, does not record exactly the array folders ``trees`` (a record cut or
    edited), or holds a value that is no SHA-256 (64 lowercase hex digits)."""
    arrays = doc.get("arrays", {})
    if not isinstance(arrays, dict):
        raise CheckpointError(
            f"{manifest} is damaged: its arrays are a {type(arrays).__name__}, not an object"
        )
    if "arrays" in doc and sorted(arrays) != sorted(trees):
        raise CheckpointError(
            f"{manifest} is damaged: its arrays record {', '.join(map(repr, sorted(arrays))) or 'nothing'}, "
            f"not {', '.join(map(repr, trees))} (a record cut or edited)"
        )
    for name, digest in arrays.items():
        if not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
            raise CheckpointError(
                f"{manifest} is damaged: arrays[{name!r}] is {digest!r}, not a SHA-256 (64 hex digits, "
                f"lower case)"
            )


def check_arrays(directory: Path, doc: dict[str, Any], restored: dict[str, Any]) -> None:
    """Raise CheckpointError when a restored tree (``restored``: its folder name -> the tree)
    differs from the ``array_digest`` the save recorded in ``doc`` (the manifest's document,
    ``check_recorded`` already), "changed while it was read" with both digests. A manifest
    without "arrays" (saved before them) gets a warning, once per folder: its files were checked,
    not the arrays read; ``doc`` ``{}`` (no manifest at all) was warned of already."""
    if "arrays" not in doc:
        if "files" in doc and str(directory) not in _warned_no_arrays:
            _warned_no_arrays.add(str(directory))
            log.warning(
                "%s was saved before array digests: its files are checked, not the arrays read", directory
            )
        return
    recorded = doc.get("arrays", {})
    for name, tree in restored.items():  # check_recorded: ``recorded`` holds every tree read
        found = array_digest(tree)
        if found != recorded[name]:
            raise CheckpointError(
                f"{directory} changed while it was read: the arrays restored from {name}/ have SHA-256 "
                f"{found}, its save recorded {recorded[name]}, so what was read is not what was "
                f"verified; read it again once nothing writes to it (refused again: the record was "
                f"edited or the checkpoint is damaged)"
            )
