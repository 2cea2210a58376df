"""Ray Datasets from the workload arrays (same dtypes, shapes and order), and the per-worker batch
iterator over a dataset shard."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import ray.data
from ray.data.extensions import ArrowTensorArray

from jaxray.data.batching import Arrays


def to_dataset(arrays: Arrays) -> ray.data.Dataset:
    """A Ray Dataset with one column per array: multi-dimensional arrays become tensor columns."""
    columns = {k: ArrowTensorArray.from_numpy(v) if v.ndim > 1 else pa.array(v) for k, v in arrays.items()}
    return ray.data.from_arrow(pa.table(columns))


def shard_batches(shard, batch_size: int, prefetch_batches: int = 2) -> Iterator[dict[str, np.ndarray]]:
    """Endless ``[batch_size, ...]`` numpy batches of a dataset shard iterator, in the dataset's order,
    each epoch's partial last batch dropped. ValueError if the shard holds less than a batch."""
    while True:
        produced = 0
        for batch in shard.iter_batches(
            batch_size=batch_size, batch_format="numpy", drop_last=True, prefetch_batches=prefetch_batches
        ):
            produced += 1
            yield batch
        if not produced:
            raise ValueError(f"the dataset shard has fewer rows than one batch of {batch_size}")
