"""Fixed-shape batches from in-memory arrays (dicts of equal-length numpy arrays): training batches
drop the partial tail, evaluation batches pad it and carry a mask."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping

import jax
import numpy as np

Arrays = Mapping[str, np.ndarray]


def num_rows(arrays: Arrays) -> int:
    """Row count; ValueError if the columns disagree."""
    sizes = {k: len(v) for k, v in arrays.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"columns have different row counts: {sizes}")
    return next(iter(sizes.values()))


def epoch_order(rows: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch ``epoch``'s row order, [rows] int64; every data path (memory, Parquet) uses it."""
    return np.random.default_rng([seed, epoch]).permutation(rows)


def train_batches(
    arrays: Arrays, batch_size: int, seed: int | None = None, process_index: int = 0, process_count: int = 1
) -> Iterator[dict[str, np.ndarray]]:
    """Endless training batches; each epoch's partial last batch is dropped. ``seed`` None keeps
    the arrays' order, else epoch e follows ``epoch_order(n, seed, e)``. This process yields rows
    ``[p * local, (p + 1) * local)`` of each global batch. Raises ValueError for fewer rows than one
    batch or a ``batch_size`` not divisible by ``process_count``."""
    n = num_rows(arrays)
    per_epoch = n // batch_size
    if per_epoch == 0:
        raise ValueError(f"batch size {batch_size} is larger than the {n} rows of the dataset")
    if batch_size % process_count:
        raise ValueError(f"batch size {batch_size} does not divide over {process_count} processes")
    local = batch_size // process_count
    for epoch in itertools.count():
        order = None if seed is None else epoch_order(n, seed, epoch)
        for i in range(per_epoch):
            start = i * batch_size + process_index * local
            rows = slice(start, start + local) if order is None else order[start : start + local]
            yield {k: v[rows] for k, v in arrays.items()}


def eval_batches(arrays: Arrays, global_batch: int) -> Iterator[dict[str, np.ndarray]]:
    """This process's rows of each ``global_batch``-row eval batch, the last zero-padded, each with
    ``"mask"`` [rows] float32 (1 real, 0 padding); ``global_batch`` must divide by process count."""
    n = num_rows(arrays)
    processes, index = jax.process_count(), jax.process_index()
    local = global_batch // processes
    for start in range(0, n, global_batch):
        rows = slice(start + index * local, start + (index + 1) * local)
        batch = {k: _pad(v[rows], local) for k, v in arrays.items()}
        real = max(0, min(n, rows.stop) - rows.start)
        batch["mask"] = _pad(np.ones(real, np.float32), local)
        yield batch


def _pad(x: np.ndarray, rows: int) -> np.ndarray:
    if len(x) == rows:
        return x
    return np.concatenate([x, np.zeros((rows - len(x), *x.shape[1:]), x.dtype)])
