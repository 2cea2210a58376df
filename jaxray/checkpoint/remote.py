"""A checkpoint folder on object storage, read by URI (``s3://``, ``gs://``, ``file://``: any pyarrow
filesystem): ``fetch`` copies it into a local cache, checking every file against the SHA-256 that its
``train_state.json`` records, and the commands read that copy. A cached copy is used again while the
remote ``train_state.json`` is unchanged and the copy still verifies; otherwise it is fetched anew.
Credentials and endpoints come from the environment, as pyarrow reads them (``AWS_ENDPOINT_URL``, ...)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pyarrow.fs as pafs

from jaxray.checkpoint import MODEL_CONFIG, TRAIN_STATE, CheckpointError, verify
from jaxray.data.manifest import resolve

CACHE_ENV = "JAXRAY_CACHE_DIR"  # the cache's folder (default ~/.cache/jaxray); checkpoints/ inside it
CHUNK_BYTES = 1 << 22


def is_uri(path: str | Path) -> bool:
    """Whether ``path`` is a URI (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and "://" in path


def cache_dir() -> Path:
    """Where fetched checkpoints are kept: ``$JAXRAY_CACHE_DIR/checkpoints``, else ~/.cache/jaxray's."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxray"
    return Path(root).expanduser() / "checkpoints"


def fetch(uri: str) -> Path:
    """The local copy of the checkpoint folder ``uri``, fetched unless the cache holds it unchanged.
    Raises CheckpointError naming ``uri``: unreachable, not a checkpoint, incomplete (no
    ``train_state.json``), or a listed file missing or not matching its SHA-256; an earlier good
    copy in the cache is left as it was."""
    try:
        fs, root = resolve(uri)
        with fs.open_input_stream(f"{root}/{TRAIN_STATE}") as f:
            manifest = f.read()
    except FileNotFoundError:
        has_config = _exists(fs, f"{root}/{MODEL_CONFIG}")
        what = "incomplete: its save never finished" if has_config else "not a jaxray checkpoint folder"
        raise CheckpointError(f"{uri} is {what} (no {TRAIN_STATE})") from None
    except (OSError, ValueError) as err:  # pyarrow: bad scheme or bucket, no route, refused credentials
        raise CheckpointError(f"{uri} cannot be read: {err}") from err
    try:
        files = dict(json.loads(manifest)["files"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{uri}/{TRAIN_STATE} is damaged: {err}") from err
    entry = cache_dir() / hashlib.sha256(uri.encode()).hexdigest()[:24]
    if _cached(entry, manifest):
        return entry
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for rel, expected in files.items():
            _copy(fs, f"{root}/{rel}", tmp / rel, expected, uri, rel)
        (tmp / TRAIN_STATE).write_bytes(manifest)  # last, as a save writes it
        if _cached(entry, manifest):  # another process fetched it meanwhile
            return entry
        shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return entry


def _cached(entry: Path, manifest: bytes) -> bool:
    """Whether ``entry`` is a copy of the checkpoint whose ``train_state.json`` is ``manifest``."""
    try:
        if (entry / TRAIN_STATE).read_bytes() != manifest:
            return False
        verify(entry)
    except (OSError, CheckpointError):
        return False
    return True


def _copy(fs: pafs.FileSystem, source: str, dest: Path, expected: str, uri: str, rel: str) -> None:
    """Copy ``source`` to ``dest``, raising CheckpointError unless its SHA-256 is ``expected``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    try:
        with fs.open_input_stream(source) as f, dest.open("wb") as out:
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
    except FileNotFoundError:
        raise CheckpointError(f"{uri} is damaged: {rel} is missing") from None
    except OSError as err:
        raise CheckpointError(f"{uri}: {rel} cannot be fetched: {err}") from err
    if digest.hexdigest() != expected:
        raise CheckpointError(
            f"{uri} is damaged: {rel} does not match its checksum (truncated or overwritten): "
            f"{TRAIN_STATE} records SHA-256 {expected}, the file has {digest.hexdigest()}"
        )


def _exists(fs: pafs.FileSystem, path: str) -> bool:
    try:
        return fs.get_file_info(path).type == pafs.FileType.File
    except OSError:
        return False
