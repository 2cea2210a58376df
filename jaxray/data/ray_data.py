"""Ray Datasets of a run's training batches (the samples ``train_batches`` draws, drawn in Ray Data
tasks) and of held-out arrays, and the per-worker batch iterator over a dataset shard."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import ray.data
from ray.data.extensions import ArrowTensorArray

from jaxray.data.batching import Arrays, Source, check_batch, gather, num_samples, sample_ids


def to_dataset(arrays: Arrays) -> ray.data.Dataset:
    """A Ray Dataset with one column per array: multi-dimensional arrays become tensor columns."""
    columns = {k: ArrowTensorArray.from_numpy(v) if v.ndim > 1 else pa.array(v) for k, v in arrays.items()}
    return ray.data.from_arrow(pa.table(columns))


def train_dataset(source: Source, global_batch: int, seed: int, steps: int) -> ray.data.Dataset:
    """``steps`` global batches of ``source`` as a Ray Dataset of ``steps * global_batch`` rows, row q
    the sample at position q of ``train_batches(source, global_batch, seed)`` (a new order each epoch,
    from (seed, epoch)): a map task per ``CHUNK_STEPS`` batches draws its positions' samples
    (``sample_ids``) and cuts them from ``source``, put once in the object store. ValueError as
    ``check_batch``."""
    check_batch(num_samples(source), global_batch)
    ref = ray.put(source)
    total, chunk = steps * global_batch, CHUNK_STEPS * global_batch
    starts = ray.data.from_items(
        [{"start": s} for s in range(0, total, chunk)], override_num_blocks=-(-total // chunk)
    )
    kwargs = {"source": ref, "global_batch": global_batch, "seed": seed, "chunk": chunk, "total": total}
    # A draw is a copy of a few MB: its tasks reserve no CPU, so that workers holding every CPU of
    # their nodes are still fed (Ray Train leaves Ray Data none of theirs). One task at a time: one
    # process draws for a trial (each new one imports jaxray; a dozen at once took a 2-core machine
    # from the step: make demo 13.4 -> 11.7 min), still ~15-27M tokens/s here (docs/benchmarks.md).
    ds = starts.map_batches(
        _draw,
        batch_size=1,
        batch_format="numpy",
        fn_kwargs=kwargs,
        num_cpus=0,
        compute=ray.data.TaskPoolStrategy(size=1),
    )
    ds.context.execution_options.preserve_order = True  # blocks of several tasks in position order
    return ds


CHUNK_STEPS = 64  # global batches a map task draws: few tasks, each a few MB of windows


def _draw(
    rows: dict[str, np.ndarray], source, global_batch: int, seed: int, chunk: int, total: int
) -> dict[str, np.ndarray]:
    """A Ray Data map task: the samples at positions ``[start, start + chunk)`` (before ``total``)."""
    data, start = _held(source), int(rows["start"][0])
    positions = np.arange(start, min(start + chunk, total))
    return gather(data, sample_ids(num_samples(data), global_batch, seed, positions))


_HELD: dict = {}


def _held(ref) -> Source:
    """The source behind ``ref``, fetched once per process (zero-copy from the object store)."""
    if ref not in _HELD:
        _HELD.clear()
        _HELD[ref] = ray.get(ref)
    return _HELD[ref]


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
