"""Files at a local path or a pyarrow URI (``s3://``, ``gs://``, ``file://``): the filesystem of a
path, reads and whole writes, the file hash, and the local cache folder. Credentials and endpoints
come from the environment, as pyarrow reads them."""

from __future__ import annotations

import hashlib
import os
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs as pafs

# pyarrow retries a gs:// URI without credentials or endpoint for many minutes, silently: at most this
# long per operation (``resolve``), and ``PROBE_RETRY_S`` for the first look at a URI (``probe``), so
# one that cannot be reached is refused within seconds; a URI's own ``?retry_limit_seconds=`` wins.
GCS_RETRY_S, PROBE_RETRY_S = 30, 2
# The cache's folder (default ~/.cache/jaxray): checkpoints/ (fetched), staging/ (training's uploads),
# data downloads at its root.
CACHE_ENV = "JAXRAY_CACHE_DIR"
CHUNK_BYTES = 1 << 22


def resolve(
    path_or_uri: str, filesystem: pafs.FileSystem | None = None, retry_s: int = GCS_RETRY_S
) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) of a local path or a pyarrow URI (``gs://`` retried at most
    ``retry_s`` s per operation); with ``filesystem``, ``path_or_uri`` is a path inside it."""
    if filesystem is not None:
        return filesystem, path_or_uri.rstrip("/")
    if "://" not in path_or_uri:
        return pafs.LocalFileSystem(), os.path.abspath(path_or_uri)
    if path_or_uri.startswith(("gs://", "gcs://")) and "retry_limit_seconds=" not in path_or_uri:
        path_or_uri += f"{'&' if '?' in path_or_uri else '?'}retry_limit_seconds={retry_s}"
    fs, path = pafs.FileSystem.from_uri(path_or_uri)
    return fs, path.rstrip("/")


def probe(uri: str) -> None:
    """One look at ``uri`` with short retries (a local path or ``file://`` passes): raises OSError or
    ValueError within seconds when its service cannot be reached or refuses the credentials."""
    if "://" in uri and not uri.startswith("file://"):
        fs, path = resolve(uri, retry_s=PROBE_RETRY_S)
        fs.get_file_info(path)


def file_sha256(path: str | Path, fs: pafs.FileSystem | None = None) -> str:
    """SHA-256 (hex) of the bytes of the file ``path`` (in ``fs``; default: a local path)."""
    digest = hashlib.sha256()
    with fs.open_input_stream(str(path)) if fs is not None else open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def is_uri(path: str | Path) -> bool:
    """Whether ``path`` is a URI (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and "://" in path


def join(uri: str, *names: str) -> str:
    """``uri`` with ``names`` appended as path segments (a URI without a query)."""
    return "/".join([uri.rstrip("/"), *names])


def display(uri: str) -> str:
    """``uri`` without credentials (``user:secret@``) or query: what is shown and recorded."""
    parts = urllib.parse.urlsplit(uri)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def cache_dir(kind: str = "checkpoints") -> Path:
    """``$JAXRAY_CACHE_DIR/<kind>``, else ~/.cache/jaxray's: ``checkpoints`` (fetched), ``staging``
    (where a worker writes a checkpoint before Ray uploads it) or "" (the root: data downloads)."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxray"
    return Path(root).expanduser().absolute() / kind


def check_writable(uri: str) -> None:
    """Create the folder ``uri`` and write and delete a small file in it. Raises OSError naming the
    URI and the cause (no bucket, refused credentials, unknown scheme)."""
    try:
        probe(uri)  # unreachable or refused: within seconds
        fs, root = resolve(uri)
        fs.create_dir(root, recursive=True)
        written = f"{root}/.jaxray-write-check-{os.getpid()}"
        with fs.open_output_stream(written) as f:
            f.write(b"ok")
        fs.delete_file(written)
    except (OSError, ValueError) as err:
        raise OSError(f"{display(uri)} cannot be written: {err}") from err


def read_text(path_or_uri: str | Path) -> str | None:
    """The text of the file at a local path or a URI; None when it does not exist. Raises OSError."""
    fs, path = resolve(str(path_or_uri))
    try:
        with fs.open_input_stream(path) as f:
            return f.read().decode()
    except FileNotFoundError:
        return None


def write_text(path_or_uri: str | Path, text: str) -> None:
    """``text`` as the file at a local path or ``file://`` URI (written whole) or an object storage URI
    (one object). Raises OSError."""
    fs, path = resolve(str(path_or_uri))
    if not isinstance(fs, pafs.LocalFileSystem):
        with fs.open_output_stream(path) as f:
            f.write(text.encode())
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with written_whole(path) as tmp:
        tmp.write_text(text)


@contextmanager
def written_whole(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` for the block to write, renamed over ``path`` when it ends,
    removed when it fails. Its name carries the process id and ends as ``path`` does (matplotlib
    reads the format from it)."""
    path = Path(path)
    tmp = path.with_name(f".partial-{os.getpid()}-{path.name}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
