"""Locate, verify and (if needed) download the data files jaxray trains on.

Every file is pinned by the SHA-256 of its *decompressed* content (the Debian package recompresses
the Fashion-MNIST archives). Search order (first hit wins): ``data_dir``, ``$JAXRAY_DATA_DIR``, the
cache (``~/.cache/jaxray`` or ``$JAXRAY_CACHE_DIR``), ``/usr/share/datasets/fashion-mnist``
(Fashion-MNIST only), then a download into the cache."""

from __future__ import annotations

import gzip
import hashlib
import http.client
import logging
import os
import tempfile
import urllib.request
import zlib
from pathlib import Path
from typing import NamedTuple

from jaxray import storage

log = logging.getLogger(__name__)

DATA_DIR_ENV = "JAXRAY_DATA_DIR"
SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
DOWNLOAD_TIMEOUT_S = 60.0

_FMNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"


class DataFileError(Exception):
    """A data file is missing, truncated, corrupt or not the expected version; the message names
    the file(s) and the fix."""


class KnownFile(NamedTuple):
    sha256: str  # of the decompressed content
    url: str


_FMNIST_SHA256 = {
    "train-images-idx3-ubyte.gz": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte.gz": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte.gz": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte.gz": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
REGISTRY: dict[str, KnownFile] = {
    "tinyshakespeare.txt": KnownFile(
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
    ),
    **{f"fashion-mnist/{n}": KnownFile(sha, _FMNIST_URL + n) for n, sha in _FMNIST_SHA256.items()},
}


def read_verified(name: str, data_dir: str | os.PathLike | None = None) -> bytes:
    """The decompressed, checksum-verified content of registered file ``name`` (:data:`REGISTRY`).
    Each searched directory ``d`` is tried as ``d/<name>`` and ``d/<basename>``, each also without
    ``.gz``, else the file is downloaded; the first copy found is used (a warning when ``data_dir``
    is given and the copy is elsewhere), a bad one reported. Raises
    ValueError (unknown ``name``) or DataFileError (unreadable, corrupt, wrong SHA-256, or not
    found and the download failed: every path searched is listed)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown data file {name!r}; known: {sorted(REGISTRY)}")
    known = REGISTRY[name]
    candidates = _candidate_paths(name, data_dir)
    for path in candidates:
        if path.is_file():
            if data_dir is not None and not path.is_relative_to(Path(data_dir).expanduser().absolute()):
                log.warning(
                    "data file %s is not in the data folder given, %s: read from %s", name, data_dir, path
                )
            fix = (
                f"Delete it (a fresh copy is then downloaded into {storage.cache_dir('')} if online), "
                f"or point --data-dir / {DATA_DIR_ENV} at a directory holding a good copy."
            )
            return _verify(path, known, fix)
    return _download_into_cache(name, known, candidates)


def _candidate_paths(name: str, data_dir: str | os.PathLike | None) -> list[Path]:
    dirs = [] if data_dir is None else [Path(data_dir)]
    if os.environ.get(DATA_DIR_ENV):
        dirs.append(Path(os.environ[DATA_DIR_ENV]))
    dirs.append(storage.cache_dir(""))
    if name.startswith("fashion-mnist/"):
        dirs.append(SYSTEM_DIR)
    # A copy someone gunzipped by hand is as good: the digest is of the payload.
    rels = [
        r for rel in dict.fromkeys([name, name.rsplit("/", 1)[-1]]) for r in (rel, rel.removesuffix(".gz"))
    ]
    # Absolute paths so the "not found" message is unambiguous whatever the cwd; the system package
    # ships a flat folder, only basenames live there.
    dirs = [d.expanduser().absolute() for d in dirs]
    return list(dict.fromkeys(d / r for d in dirs for r in rels if not (d == SYSTEM_DIR and "/" in r)))


def _verify(path: Path, known: KnownFile, fix: str) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataFileError(f"cannot read data file {path}: {e}") from e
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise DataFileError(f"data file {path} is truncated or corrupt (gzip error: {e}). {fix}") from e
    actual = hashlib.sha256(raw).hexdigest()
    if actual != known.sha256:
        raise DataFileError(
            f"data file {path} has the wrong content: SHA-256 of its "
            f"{'decompressed ' if path.suffix == '.gz' else ''}content is "
            f"{actual}, expected {known.sha256}. It is truncated, corrupt or a "
            f"different version. {fix}"
        )
    return raw


def _download(url: str, dest: Path) -> None:
    """Fetch ``url`` into the file ``dest`` (overwritten). Raises OSError-likes."""
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp:
        with open(dest, "wb") as out:
            while chunk := resp.read(1 << 20):
                out.write(chunk)


def _download_into_cache(name: str, known: KnownFile, searched: list[Path]) -> bytes:
    target = storage.cache_dir("") / name
    tmp_path = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Same directory as the target so the final rename is atomic.
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".part-", suffix=target.suffix)
        os.close(fd)
        tmp_path = Path(tmp)
        _download(known.url, tmp_path)
    except (OSError, http.client.HTTPException, ValueError) as e:
        if tmp_path is not None:
            tmp_path.unlink(missing_ok=True)
        raise DataFileError(_not_found_message(name, known, searched, e)) from e
    fix = (
        f"This was a download of {known.url}; it has been discarded. Supply a good "
        f"copy with --data-dir / {DATA_DIR_ENV}, or copy one to {target}."
    )
    try:
        # Verify before the rename so a bad download never lands in the cache.
        content = _verify(tmp_path, known, fix)
    except DataFileError:
        tmp_path.unlink(missing_ok=True)
        raise
    os.replace(tmp_path, target)
    return content


def _not_found_message(name: str, known: KnownFile, searched: list[Path], err: BaseException) -> str:
    lines = [f"data file {name!r} not found. Looked in:"]
    lines += [f"  {p}" for p in searched]
    lines.append(f"and downloading {known.url} failed: {type(err).__name__}: {err}")
    lines.append("Supply the file in one of these ways:")
    lines.append(
        f"  - pass --data-dir DIR (or set {DATA_DIR_ENV}=DIR) where DIR holds {name} or its basename;"
    )
    if name.startswith("fashion-mnist/"):
        lines.append(f"  - apt-get install dataset-fashion-mnist (installs into {SYSTEM_DIR});")
    lines.append(f"  - copy it to {storage.cache_dir('') / name};")
    lines.append("  - or run again with network access to download it.")
    return "\n".join(lines)
