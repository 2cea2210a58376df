"""The manifest of a prepared Parquet folder (``python -m jaxray.data prepare``), and where it lives.

A folder (local or a pyarrow URI) holds ``manifest.json``, ``train/part-NNNNN.parquet`` and
``validation/`` or ``test/``, rows in natural order. Columns: ``row`` int64 (0..N-1), then
``tokens`` fixed_size_list<int32>[T], or ``image`` fixed_size_list<uint8>[784] and ``label`` int32."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from jaxray.config import DataConfig
from jaxray.storage import file_sha256, probe, resolve

MANIFEST = "manifest.json"
FORMAT = "jaxray-parquet"
FORMAT_VERSION = 1
# dataset -> its splits (train, then the held-out one)
SPLITS = {"tinyshakespeare": ("train", "validation"), "fashion-mnist": ("train", "test")}
# data.parquet_cache_mib's default: the most a split may take decoded in each process's memory
MAX_BYTES = DataConfig.model_fields["parquet_cache_mib"].default << 20


class ManifestError(ValueError):
    """A prepared folder's manifest is missing, unreadable or disagrees with its files; the message
    names the file."""


@dataclass(frozen=True)
class SplitFiles:
    """One split: ``rows`` in all, and its files as (path relative to the folder, rows, sha256)."""

    rows: int
    files: tuple[tuple[str, int, str], ...]


@dataclass(frozen=True)
class Manifest:
    """A validated manifest. ``columns``: the data columns' specs (``columns.column_specs``, ``row``
    excluded); ``seq_len`` is None for Fashion-MNIST; ``raw`` is the whole JSON."""

    root: str
    dataset: str
    seq_len: int | None
    columns: dict[str, dict[str, Any]]
    splits: dict[str, SplitFiles]
    raw: dict[str, Any]

    def samples(self, name: str) -> int:
        """Samples training draws from split ``name``: its rows, or for text every window offset of
        the text its rows cut (``Windows``: rows x seq_len - seq_len + 1)."""
        rows = self.split(name).rows
        return rows if self.seq_len is None else rows * self.seq_len - self.seq_len + 1

    def split(self, name: str) -> SplitFiles:
        """ManifestError naming the splits there are if ``name`` is not one."""
        if name not in self.splits:
            raise ManifestError(
                f"{self.root}/{MANIFEST}: no split {name!r} (it has {', '.join(self.splits)})"
            )
        return self.splits[name]

    def decoded_bytes(self, name: str) -> int:
        """Bytes of split ``name``'s rows as ``parquet.split_arrays`` holds them (decoded dtypes)."""
        row = sum(
            int(np.prod(c["shape"], dtype=np.int64)) * np.dtype(c["dtype"]).itemsize
            for c in self.columns.values()
        )
        return self.split(name).rows * row


def check_fits(manifest: Manifest, split: str, max_bytes: int) -> None:
    """ManifestError naming the sizes if ``split`` decodes to more than ``max_bytes``: each training
    process holds it whole in host memory."""
    size = manifest.decoded_bytes(split)
    if size > max_bytes:
        raise ManifestError(
            f"{manifest.root}: split {split} decodes to {size / 2**20:,.0f} MiB, more than "
            f"data.parquet_cache_mib ({max_bytes / 2**20:,.0f} MiB); each training process holds it in host "
            f"memory: raise data.parquet_cache_mib where the hosts have the memory"
        )


def read_manifest(
    path_or_uri: str, filesystem: pafs.FileSystem | None = None, verify_checksums: bool = False
) -> Manifest:
    """Read and validate ``<folder>/manifest.json``: format, version, dataset, splits, row counts and
    every listed file present (with ``verify_checksums``, its SHA-256 too). Raises ManifestError
    naming the file at fault and what is wrong."""
    try:
        if filesystem is None:
            probe(path_or_uri)
    except (OSError, ValueError) as err:
        raise ManifestError(f"{path_or_uri} cannot be reached: {err}") from None
    fs, root = resolve(path_or_uri, filesystem)
    where = f"{root}/{MANIFEST}"
    try:
        with fs.open_input_stream(where) as f:
            raw = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise ManifestError(
            f"{where} does not exist: is {path_or_uri} a folder written by `python -m jaxray.data prepare`?"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestError(f"{where} cannot be read as JSON: {err}") from None
    manifest = _parse(raw, where, root)
    for name, split in manifest.splits.items():
        for rel, rows, sha in split.files:
            path = f"{root}/{rel}"
            if fs.get_file_info(path).type != pafs.FileType.File:
                raise ManifestError(
                    f"{path} is listed in {where} (split {name}, {rows} rows) but does not exist"
                )
            if verify_checksums and file_sha256(path, fs) != sha:
                raise ManifestError(
                    f"{path} does not match the SHA-256 recorded in {where}: the file changed "
                    f"after prepare; prepare the folder again"
                )
    return manifest


def _parse(raw: Any, where: str, root: str) -> Manifest:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ManifestError(f"{where}: {what}")

    need(isinstance(raw, dict), "expected a JSON object")
    need(raw.get("format") == FORMAT, f"format is {raw.get('format')!r}, expected {FORMAT!r}")
    need(
        raw.get("format_version") == FORMAT_VERSION,
        f"format_version is {raw.get('format_version')!r}; this jaxray reads {FORMAT_VERSION}",
    )
    dataset = raw.get("dataset")
    need(dataset in SPLITS, f"dataset is {dataset!r}, expected one of {', '.join(SPLITS)}")
    seq_len = raw.get("seq_len")
    need(
        seq_len is None if dataset == "fashion-mnist" else isinstance(seq_len, int) and seq_len >= 2,
        f"seq_len {seq_len!r} does not fit dataset {dataset}",
    )
    columns = raw.get("columns")
    need(
        isinstance(columns, dict)
        and all(
            isinstance(c, dict)
            and isinstance(c.get("shape"), list)
            and c.get("dtype") in ("int32", "float32")
            and c.get("stored", "uint8") == "uint8"
            for c in columns.values()
        ),
        "columns must map each name to {dtype: int32|float32, shape: [...], stored: uint8 (optional)}",
    )
    splits_raw = raw.get("splits")
    need(
        isinstance(splits_raw, dict) and sorted(splits_raw) == sorted(SPLITS[dataset]),
        f"splits must be {' and '.join(SPLITS[dataset])}, got {sorted(splits_raw or {})}",
    )
    splits = {}
    for name, s in splits_raw.items():
        files = s.get("files") if isinstance(s, dict) else None
        need(
            isinstance(files, list)
            and files
            and all(
                isinstance(f, dict)
                and isinstance(f.get("path"), str)
                and isinstance(f.get("rows"), int)
                and f["rows"] > 0
                and isinstance(f.get("sha256"), str)
                for f in files
            ),
            f"split {name}: files must be a non-empty list of {{path, rows > 0, sha256}}",
        )
        total = sum(f["rows"] for f in files)
        need(s.get("rows") == total, f"split {name}: rows is {s.get('rows')!r} but its files hold {total}")
        splits[name] = SplitFiles(total, tuple((f["path"], f["rows"], f["sha256"]) for f in files))
    return Manifest(root, dataset, seq_len, columns, splits, raw)
