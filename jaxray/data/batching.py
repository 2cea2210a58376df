"""Fixed-shape batches from in-memory arrays: training batches drop the partial tail (so the jitted
step never recompiles), evaluation batches pad it and carry a mask (so no example is dropped).

Arrays are dicts of equal-length numpy arrays, e.g. ``{"image": [N, 784], "label": [N]}`` or
``{"tokens": [N, T]}``.
"""
from __future__ import annotations

import itertools
from typing import Iterator, Mapping

import jax
import numpy as np

Arrays = Mapping[str, np.ndarray]


def num_rows(arrays: Arrays) -> int:
    """Row count; ValueError if the columns disagree."""
    sizes = {k: len(v) for k, v in arrays.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"columns have different row counts: {sizes}")
    return next(iter(sizes.values()))


def train_batches(arrays: Arrays, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """Endless ``[batch_size, ...]`` batches in the arrays' order, epoch after epoch; partial tail dropped.

    Raises ValueError if there are fewer rows than one batch.
    """
    n = num_rows(arrays)
    per_epoch = n // batch_size
    if per_epoch == 0:
        raise ValueError(f"batch size {batch_size} is larger than the {n} rows of the dataset")
    for i in itertools.cycle(range(per_epoch)):
        yield {k: v[i * batch_size:(i + 1) * batch_size] for k, v in arrays.items()}


def eval_batches(arrays: Arrays, global_batch: int) -> Iterator[dict[str, np.ndarray]]:
    """This process's rows of each ``global_batch``-row eval batch, the last one zero-padded.

    Every batch gains ``"mask"`` [rows] float32 (1 real, 0 padding). With P processes each yields
    rows ``[p * global_batch / P, (p + 1) * global_batch / P)`` of every global batch, the rows its
    own devices hold under the ``data`` sharding; ``global_batch`` must be divisible by P.
    """
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
