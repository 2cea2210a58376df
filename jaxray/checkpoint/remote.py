"""Checkpoints by URI (any pyarrow filesystem): ``fetch`` copies one into a local cache, checking each
file against its SHA-256 in ``train_state.json``; an entry is named by the URI and that file, so a
checkpoint replaced at the URI is fetched anew (one copy per URI). Also the ranking of a trial's
checkpoints (by their recorded validation loss) and the space they take, in a folder or at a URI."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

import filelock
import pyarrow.fs as pafs

from jaxray.checkpoint.folder import (
    CHECKPOINT_PREFIX,
    HISTORY_FILE,
    MODEL_CONFIG,
    TRAIN_STATE,
    CheckpointError,
    checkpoint_order,
    checkpoints,
    verify,
)
from jaxray.storage import (
    CACHE_ENV,
    CHUNK_BYTES,
    cache_dir,
    display,
    join,
    probe,
    read_text,
    resolve,
    written_whole,
)


class StorageError(CheckpointError):
    """The storage or the local cache could not be reached or written (not a damaged checkpoint)."""


def saved_val_loss(uri: str) -> float | None:
    """The ``val_loss`` a transformer checkpoint's own history records at its step (the whole
    held-out split of its params); None when it has none, is an MLP's (ranked by its final test
    metrics), or its files cannot be read."""
    try:
        if json.loads(read_text(join(uri, MODEL_CONFIG)))["workload"] != "transformer":
            return None
        step = json.loads(read_text(join(uri, TRAIN_STATE)))["step"]
        rows = json.loads(read_text(join(uri, HISTORY_FILE)))
        value = next((r.get("val_loss") for r in reversed(rows) if r.get("step") == step), None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def ranked_checkpoints(uri: str) -> list[str]:
    """The complete checkpoints of the folder ``uri`` (a URI or path), best first: the lowest
    ``saved_val_loss`` (the newer on a tie), then the rest newest first. Raises CheckpointError when
    it cannot be listed."""
    done = checkpoints(uri)
    scored = [(loss, i) for i, c in enumerate(done) if (loss := saved_val_loss(c)) is not None]
    if not scored:
        return done
    best = done[min(scored)[1]]
    return [best, *(c for c in done if c != best)]


def best_of(row: dict, recorded: str | None) -> str | None:
    """The checkpoint beside ``recorded`` (the final one) that ``row``'s ``best_step`` names; if Ray's
    retention removed it, ``ranked_checkpoints``' best, ``row``'s ``val_loss``, ``val_perplexity``
    and ``best_step`` then rewritten to it; ``recorded`` when unlistable or without a best step."""
    if not recorded or row.get("best_step") is None:
        return recorded
    try:
        ranked = ranked_checkpoints(recorded.rstrip("/").rpartition("/")[0])
    except CheckpointError:
        return recorded
    named = [c for c in ranked if checkpoint_order(c)[0] == row["best_step"]]
    if named or not ranked:
        return named[0] if named else recorded
    loss = saved_val_loss(ranked[0])
    if loss is not None:
        step = checkpoint_order(ranked[0])[0]
        row.update(val_loss=loss, val_perplexity=math.exp(loss), best_step=step)
    return ranked[0]


def disk_use(uri: str) -> tuple[int, float]:
    """(how many ``checkpoint_*`` folders the folder ``uri`` holds, the MiB their files take)."""
    fs, root = resolve(uri)
    found = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    inside = []  # (checkpoint folder, size) of each file in one
    for f in found:
        parts = PurePosixPath(f.path).relative_to(root).parts
        if f.type == pafs.FileType.File and len(parts) > 1 and parts[0].startswith(CHECKPOINT_PREFIX):
            inside.append((parts[0], f.size))
    return len({name for name, _ in inside}), round(sum(size for _, size in inside) / 2**20, 2)


def fetch(uri: str, manifest_sha256: str | None = None) -> Path:
    """The local copy of the checkpoint folder ``uri``, fetched (under a lock file) unless the cache
    holds it whole; with ``manifest_sha256``, its remote ``train_state.json`` must still have that
    SHA-256. Raises CheckpointError naming ``uri``: absent, a run folder, not a checkpoint,
    incomplete, changed, a file missing or not matching, or what ``verify`` refuses; StorageError
    when ``uri`` cannot be reached or the cache written."""
    uri, shown = uri.rstrip("/"), display(uri.rstrip("/"))
    try:
        probe(uri)  # unreachable or refused: within seconds
        fs, root = resolve(uri)
        with fs.open_input_stream(f"{root}/{TRAIN_STATE}") as f:
            manifest = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{shown} {_not_a_checkpoint(fs, root)}") from None
    except (OSError, ValueError) as err:  # pyarrow: unknown scheme, no route, refused credentials
        raise StorageError(f"{shown} cannot be read: {err}") from err
    if manifest_sha256 is not None and hashlib.sha256(manifest).hexdigest() != manifest_sha256:
        raise CheckpointError(
            f"{shown} changed since it was checked (its {TRAIN_STATE} differs): start again to use it"
        )
    entry = cache_dir() / hashlib.sha256(uri.encode() + b"\0" + manifest).hexdigest()[:24]
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(f"{entry}.lock")
        lock.acquire()
    except OSError as err:
        raise StorageError(
            f"the checkpoint cache {cache_dir()} cannot be written (set {CACHE_ENV} to another folder): {err}"
        ) from err
    try:
        _fill(entry, fs, root, manifest, shown)
        _drop_older(entry, shown)
        return entry
    finally:
        lock.release()


def _fill(entry: Path, fs: pafs.FileSystem, root: str, manifest: bytes, shown: str) -> None:
    """Copy the checkpoint at ``root`` into ``entry`` unless it holds a whole copy: each file that
    ``manifest`` lists (refused unless a plain path inside the folder) checked as it arrives, then
    ``manifest``; the whole verified before it takes the entry's place."""
    with contextlib.suppress(CheckpointError):
        verify(entry)
        return
    try:
        files = {str(k): v for k, v in dict(json.loads(manifest)["files"]).items()}
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{shown}/{TRAIN_STATE} is damaged: {err}") from err
    tmp = Path(tempfile.mkdtemp(prefix=f"{entry.name}.", suffix=".tmp", dir=entry.parent))
    try:
        for rel, expected in files.items():
            parts = PurePosixPath(rel).parts
            plain = PurePosixPath(rel).as_posix() == rel and "\\" not in rel
            if not plain or not parts or rel.startswith("/") or ".." in parts or rel == TRAIN_STATE:
                raise CheckpointError(
                    f"{shown}/{TRAIN_STATE} is damaged: it lists {rel!r}, not a file inside the folder"
                )
            _copy(fs, f"{root}/{rel}", tmp / rel, expected, shown, rel)
        (tmp / TRAIN_STATE).write_bytes(manifest)  # last, as a save writes it
        try:  # the digests were checked as the files arrived: the rest of verify (a diverged model)
            verify(tmp, digests=False)
        except CheckpointError as err:
            raise CheckpointError(f"{shown}: {err}") from err
        with written_whole(entry.with_name(f"{entry.name}.uri")) as sidecar:
            sidecar.write_text(shown)
        if entry.exists():  # a damaged copy: out of the way first
            os.replace(entry, tmp.with_suffix(".old"))
            shutil.rmtree(tmp.with_suffix(".old"))
        os.replace(tmp, entry)
    except OSError as err:  # a local write: a full disk, say
        raise StorageError(
            f"{shown} cannot be fetched into the checkpoint cache {cache_dir()} ({CACHE_ENV}): {err}"
        ) from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _drop_older(entry: Path, shown: str) -> None:
    """Remove the cache's other copies of ``shown``, each under its lock (one being fetched is left)."""
    for sidecar in entry.parent.glob("[!.]*.uri"):  # not a sidecar being written (written_whole)
        older = sidecar.with_suffix("")
        try:
            if older == entry or sidecar.read_text() != shown:
                continue
            with filelock.FileLock(f"{older}.lock", timeout=0):
                shutil.rmtree(older, ignore_errors=True)
                sidecar.unlink(missing_ok=True)
        except (filelock.Timeout, OSError):  # being fetched, or just dropped by another process
            continue


def manifest_sha256(path: str | Path) -> str:
    """SHA-256 of a (fetched) checkpoint's ``train_state.json``: what ``fetch`` may be asked to match."""
    return hashlib.sha256((Path(path) / TRAIN_STATE).read_bytes()).hexdigest()


def source(path: str | Path) -> str:
    """The URI a cached copy ``path`` was fetched from; any other path as it is, as a string."""
    entry = Path(path).absolute()
    try:
        return entry.with_name(f"{entry.name}.uri").read_text() if entry.parent == cache_dir() else str(path)
    except OSError:
        return str(path)


def _not_a_checkpoint(fs: pafs.FileSystem, root: str) -> str:
    """Why the folder ``root`` (with no ``train_state.json``) is not a checkpoint to read."""
    try:
        if fs.get_file_info(root).type == pafs.FileType.NotFound:
            return "does not exist (check the bucket and the path)"
        names = {PurePosixPath(i.path).name for i in fs.get_file_info(pafs.FileSelector(root))}
    except OSError as err:
        return f"cannot be listed: {err}"
    if MODEL_CONFIG in names:
        return f"is incomplete: its save never finished (no {TRAIN_STATE})"
    if any(n.startswith(CHECKPOINT_PREFIX) for n in names) or {"summary.json", "train"} & names:
        return "is a run or trial folder: only checkpoint folders are read by URI (name a checkpoint_* in it)"
    return f"is not a jaxray checkpoint folder (no {TRAIN_STATE})"


def _copy(fs: pafs.FileSystem, source: str, dest: Path, expected: str, uri: str, rel: str) -> None:
    """Copy ``source`` to ``dest``. Raises CheckpointError unless its SHA-256 is ``expected``,
    StorageError when it cannot be read, OSError for a failed local write."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    try:
        stream = fs.open_input_stream(source)
    except FileNotFoundError:
        raise CheckpointError(f"{uri} is damaged: {rel} is missing") from None
    except OSError as err:
        raise StorageError(f"{uri}: {rel} cannot be read: {err}") from err
    with stream, dest.open("wb") as out:
        while True:
            try:
                chunk = stream.read(CHUNK_BYTES)
            except OSError as err:
                raise StorageError(f"{uri}: {rel} cannot be read: {err}") from err
            if not chunk:
                break
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != expected:
        raise CheckpointError(
            f"{uri} is damaged: {rel} does not match its checksum (truncated or overwritten): "
            f"{TRAIN_STATE} records SHA-256 {expected}, the file has {digest.hexdigest()}"
        )
