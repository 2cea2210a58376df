"""Training batches from a prepared Parquet folder through Ray Data, identical in content and order
to ``train_batches`` over the split's ``train_source`` (text: windows at every offset, read whole).

Epoch e of N rows, global batch G over P processes (L = G / P): ``order = epoch_order(N, seed, e)``,
row r at position ``pos[r]``; process p keeps rows with ``pos < (N // G) * G`` and
``(pos % G) // L == p``, keyed ``(pos // G) * L + pos % L``, written at their key into an epoch buffer
(built one epoch ahead on a background thread). Splits whose decoded rows fit in ``cache_bytes``
are read once (``split_arrays``) and batches gathered in host memory by ``train_batches``."""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import ray.data

from jaxray.data.batching import epoch_order, train_batches
from jaxray.data.columns import column_values
from jaxray.data.manifest import Manifest, read_manifest
from jaxray.data.workloads import train_source
from jaxray.storage import resolve

_PLANNING_LOCK = threading.Lock()
CACHE_BYTES = 1 << 30  # splits up to 1 GiB decoded are read once (module docstring)


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


@functools.lru_cache(maxsize=4)
def local_keys(
    rows: int, seed: int, epoch: int, global_batch: int, process_index: int, process_count: int
) -> np.ndarray:
    """[rows] int64: each row's key in this process's stream for ``epoch``, -1 for rows of other
    processes and of the dropped tail. Cached across an epoch's read tasks."""
    local = global_batch // process_count
    pos = np.empty(rows, np.int64)
    pos[epoch_order(rows, seed, epoch)] = np.arange(rows)
    mine = (pos < rows // global_batch * global_batch) & ((pos % global_batch) // local == process_index)
    return np.where(mine, pos // global_batch * local + pos % local, -1)


def _keep_mine(table: pa.Table, **keys_args) -> pa.Table:
    """This process's rows of a block, with their ``key``, without ``row`` (a Ray Data map task)."""
    keys = local_keys(**keys_args)[table.column("row").to_numpy()]
    mine = keys >= 0
    return table.drop_columns(["row"]).filter(pa.array(mine)).append_column("key", pa.array(keys[mine]))


def _fill(
    tables: Iterator[pa.Table],
    key: str,
    total: int,
    columns: dict[str, dict[str, Any]],
    what: str,
    stop: threading.Event | None = None,
) -> dict[str, np.ndarray] | None:
    """Write each row of ``tables`` at its ``key`` into decoded ``{column: [total, *shape]}`` arrays;
    None if ``stop`` was set first. RuntimeError naming ``what`` if a key is missing or repeated."""
    out = {name: np.empty((total, *c["shape"]), c["dtype"]) for name, c in columns.items()}
    filled = np.zeros(total, bool)
    for table in tables:
        if stop is not None and stop.is_set():
            return None  # leaving the loop shuts the Ray Data execution down
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


def decoded_bytes(manifest: Manifest, split: str) -> int:
    """Bytes of ``split``'s rows as ``split_arrays`` holds them (decoded dtypes)."""
    row = sum(
        int(np.prod(c["shape"], dtype=np.int64)) * np.dtype(c["dtype"]).itemsize
        for c in manifest.columns.values()
    )
    return manifest.split(split).rows * row


@dataclass(frozen=True)
class ProcessShare:
    """What one process reads of a split each epoch (``epoch_arrays``)."""

    root: str
    fs: pafs.FileSystem
    manifest: Manifest
    split: str
    global_batch: int
    seed: int
    process_index: int = 0
    process_count: int = 1
    prefetch_blocks: int = 2


def epoch_arrays(
    share: ProcessShare, epoch: int, stop: threading.Event | None = None
) -> dict[str, np.ndarray] | None:
    """This process's rows of one epoch in batch order, ``{column: [(N // G) * L, *shape]}``; None if
    ``stop`` was set first. RuntimeError if a key is missing or repeated."""
    rows, local = share.manifest.split(share.split).rows, share.global_batch // share.process_count
    keys_args = {
        "rows": rows,
        "seed": share.seed,
        "epoch": epoch,
        "global_batch": share.global_batch,
        "process_index": share.process_index,
        "process_count": share.process_count,
    }
    ds = parquet_dataset(share.root, share.split, share.fs, share.manifest)
    ds.context.execution_options.preserve_order = False  # blocks may come in any order: rows go by key
    ds = ds.map_batches(_keep_mine, batch_size=None, batch_format="pyarrow", fn_kwargs=keys_args)
    tables = ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=share.prefetch_blocks)
    expected = rows // share.global_batch * local
    return _fill(tables, "key", expected, share.manifest.columns, f"epoch {epoch}", stop)


class _Ahead:
    """``fn(stop)`` run on a daemon thread; ``fn`` returns early once ``stop`` is set."""

    def __init__(self, fn: Callable[[threading.Event], Any]):
        self._stop, self._value, self._error = threading.Event(), None, None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name="jaxray-next-epoch")
        self._thread.start()

    def _run(self, fn: Callable[[threading.Event], Any]) -> None:
        try:
            self._value = fn(self._stop)
        except BaseException as err:  # noqa: BLE001 - re-raised where the result is taken
            self._error = err

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value

    def cancel(self, timeout_s: float = 60.0) -> None:
        """Ask ``fn`` to stop and wait for it (at most ``timeout_s``)."""
        self._stop.set()
        self._thread.join(timeout_s)


def parquet_batches(
    path_or_uri: str,
    split: str,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    prefetch_batches: int = 2,
    filesystem: pafs.FileSystem | None = None,
    cache_bytes: int = CACHE_BYTES,
) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches of this process, equal to ``train_batches(train_source(dataset, arrays),
    global_batch, seed, process_index, process_count)`` over the natural-order arrays:
    ``{"tokens": [L, T] int32}`` or ``{"image": [L, 784] float32, "label": [L] int32}``,
    L = global_batch / process_count (views of the epoch buffer: do not write). Needs ``ray.init``.
    ``cache_bytes``: read a split of rows that fits once; 0 reads every epoch (text is always read
    once). Raises ManifestError, ValueError (as ``train_batches``, or negative ``cache_bytes``),
    RuntimeError if an epoch comes back incomplete."""
    fs, root = resolve(path_or_uri, filesystem)
    manifest = read_manifest(root, fs)
    rows = manifest.split(split).rows
    if rows < global_batch:
        raise ValueError(f"batch size {global_batch} is larger than the {rows} rows of the dataset")
    if global_batch % process_count:
        raise ValueError(f"batch size {global_batch} does not divide over {process_count} processes")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in 0..{process_count - 1}")
    if cache_bytes < 0:
        raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
    if manifest.seq_len is not None or decoded_bytes(manifest, split) <= cache_bytes:
        # Text is read whole: a window may start at any byte (``train_source``).
        source = train_source(manifest.dataset, split_arrays(root, split, fs, manifest))
        yield from train_batches(source, global_batch, seed, process_index, process_count)
        return
    share = ProcessShare(
        root, fs, manifest, split, global_batch, seed, process_index, process_count, prefetch_batches
    )
    yield from _epochs_ahead(share, rows // global_batch, global_batch // process_count)


def _epochs_ahead(share: ProcessShare, per_epoch: int, local: int) -> Iterator[dict[str, np.ndarray]]:
    """Batches of ``local`` rows, ``per_epoch`` per epoch, each epoch read on a background thread."""
    pending = _Ahead(functools.partial(epoch_arrays, share, 0))
    try:
        for epoch in itertools.count():
            arrays = pending.result()
            pending = _Ahead(functools.partial(epoch_arrays, share, epoch + 1))
            for k in range(per_epoch):
                yield {name: a[k * local : (k + 1) * local] for name, a in arrays.items()}
    finally:  # closed (or dropped) by the consumer: stop reading the next epoch
        pending.cancel()
