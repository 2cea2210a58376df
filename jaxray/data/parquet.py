"""Training batches from a prepared Parquet folder through Ray Data, identical in content and order
to ``train_batches`` over the split's ``train_source`` (text: windows at every offset): each process
reads the split once into host memory (``split_arrays``) and draws its batches there. A split that
decodes to more than ``max_bytes`` is refused (``data.parquet_cache_mib``), naming its size."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import ray.data

from jaxray.data.batching import train_batches
from jaxray.data.columns import column_values
from jaxray.data.manifest import MAX_BYTES, Manifest, check_fits, read_manifest
from jaxray.data.workloads import train_source
from jaxray.storage import resolve

_PLANNING_LOCK = threading.Lock()


@contextlib.contextmanager
def _planning(**settings: Any) -> Iterator[None]:
    """``settings`` on the process-wide DataContext while a read is planned (``read_parquet`` reads
    them from there, not from the dataset's own context), restored after."""
    with _PLANNING_LOCK:
        current = ray.data.DataContext.get_current()
        saved = {k: getattr(current, k) for k in settings}
        try:
            for k, v in settings.items():
                setattr(current, k, v)
            yield
        finally:
            for k, v in saved.items():
                setattr(current, k, v)


def parquet_dataset(
    path_or_uri: str, split: str, filesystem: pafs.FileSystem | None = None, manifest: Manifest | None = None
) -> ray.data.Dataset:
    """``ray.data.read_parquet`` over the manifest's files of ``split``, in manifest order (rows in
    natural order). ``path_or_uri``: a local folder or pyarrow URI; ``filesystem``: one to read
    through instead. One read task per file (``use_datasource_v2=False``: faster here).
    Raises ManifestError (missing or inconsistent manifest, unknown split)."""
    fs, root = resolve(path_or_uri, filesystem)
    manifest = manifest or read_manifest(root, fs)
    paths = [f"{root}/{rel}" for rel, _, _ in manifest.split(split).files]
    with _planning(use_datasource_v2=False, enable_progress_bars=False):
        ds = ray.data.read_parquet(
            paths, filesystem=fs, partitioning=None, file_extensions=None, override_num_blocks=len(paths)
        )
    ds.context.enable_progress_bars = False
    ds.context.execution_options.preserve_order = True
    return ds


def _fill(
    tables: Iterator[pa.Table],
    key: str,
    total: int,
    columns: dict[str, dict[str, Any]],
    what: str,
) -> dict[str, np.ndarray]:
    """Write each row of ``tables`` at its ``key`` into decoded ``{column: [total, *shape]}`` arrays.
    RuntimeError naming ``what`` if a key is missing or repeated."""
    out = {name: np.empty((total, *c["shape"]), c["dtype"]) for name, c in columns.items()}
    filled = np.zeros(total, bool)
    for table in tables:
        keys = table.column(key).to_numpy()
        if filled[keys].any():
            raise RuntimeError(f"{what}: a row key came twice (keys {keys.min()}..{keys.max()})")
        filled[keys] = True
        for name, c in columns.items():
            out[name][keys] = column_values(table, name, c)
    if not filled.all():
        raise RuntimeError(f"{what}: {total - filled.sum()} of {total} rows never arrived")
    return out


def split_arrays(
    path_or_uri: str, split: str, filesystem: pafs.FileSystem | None = None, manifest: Manifest | None = None
) -> dict[str, np.ndarray]:
    """Every row of ``split`` in natural order, decoded (``{"tokens": [N, T] int32}`` or ``{"image":
    [N, 784] float32, "label": [N] int32}``). Raises ManifestError, or RuntimeError on a missing or
    repeated row."""
    fs, root = resolve(path_or_uri, filesystem)
    manifest = manifest or read_manifest(root, fs)
    ds = parquet_dataset(root, split, fs, manifest)
    ds.context.execution_options.preserve_order = False  # blocks may come in any order: rows go by key
    return _fill(
        ds.iter_batches(batch_size=None, batch_format="pyarrow"),
        "row",
        manifest.split(split).rows,
        manifest.columns,
        f"split {split}",
    )


def parquet_batches(
    path_or_uri: str,
    split: str,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    filesystem: pafs.FileSystem | None = None,
    max_bytes: int = MAX_BYTES,
    manifest: Manifest | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches of this process, equal to ``train_batches(train_source(dataset, arrays),
    global_batch, seed, process_index, process_count)`` over the natural-order arrays:
    ``{"tokens": [L, T] int32}`` or ``{"image": [L, 784] float32, "label": [L] int32}``,
    L = global_batch / process_count. ``manifest``: the folder's, already read (None: read here).
    Needs ``ray.init``. Raises ManifestError (also for a split decoding to more than ``max_bytes``),
    ValueError as ``train_batches``, RuntimeError if a row never arrives."""
    fs, root = resolve(path_or_uri, filesystem)
    manifest = manifest or read_manifest(root, fs)
    rows = manifest.split(split).rows
    if rows < global_batch:
        raise ValueError(f"batch size {global_batch} is larger than the {rows} rows of the dataset")
    if global_batch % process_count:
        raise ValueError(f"batch size {global_batch} does not divide over {process_count} processes")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in 0..{process_count - 1}")
    check_fits(manifest, split, max_bytes)
    source = train_source(manifest.dataset, split_arrays(root, split, fs, manifest))
    yield from train_batches(source, global_batch, seed, process_index, process_count)
