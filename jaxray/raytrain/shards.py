"""What one Ray Train worker trains and evaluates on: rows ``[rank * L, (rank + 1) * L)`` of every
global batch (L = global_batch / world), from its Ray Train shard or the Parquet folder, and the
whole held-out set."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import ray.train

from jaxray.config import TrialConfig
from jaxray.data.batching import Arrays
from jaxray.data.parquet import parquet_batches, split_arrays
from jaxray.data.ray_data import shard_batches
from jaxray.data.workloads import held_out_split, parquet_folder

Batches = Iterator[dict[str, np.ndarray]]


def rank_batches(shard, global_batch: int, rank: int, world: int, prefetch_batches: int = 2) -> Batches:
    """This worker's rows of every global batch from an unsplit dataset iterator, endlessly; together
    the workers see what ``train_batches(arrays, global_batch)`` gives one process. Raises ValueError
    if the dataset holds fewer rows than one global batch."""
    local = global_batch // world
    for batch in shard_batches(shard, global_batch, prefetch_batches):
        yield {k: v[rank * local : (rank + 1) * local] for k, v in batch.items()}


def parquet_data(trial: TrialConfig, rank: int, world: int) -> tuple[Batches, Arrays, int]:
    """(this worker's training batches, the held-out split, the training rows) streamed from
    ``data.parquet`` (``jaxray.data.parquet.parquet_batches``)."""
    folder, manifest = parquet_folder(trial)
    batches = parquet_batches(
        folder,
        "train",
        trial.train.global_batch,
        trial.train.seed,
        rank,
        world,
        cache_bytes=trial.data.parquet_cache_mib << 20,
    )
    held_out = split_arrays(folder, held_out_split(trial.model.workload), manifest=manifest)
    return batches, held_out, manifest.split("train").rows


def collect(shard) -> Arrays:
    """Every row of an unsplit dataset shard as numpy arrays (the held-out set, small)."""
    parts = list(shard.iter_batches(batch_size=4096, batch_format="numpy"))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def worker_data(
    trial: TrialConfig, rank: int, world: int, train_rows: int | None
) -> tuple[Batches, Arrays, int | None]:
    """(training batches, held-out arrays, training rows if known) from ``data.parquet`` when set,
    else from Ray Train's ``train`` and ``eval`` shards."""
    if trial.data.parquet:
        return parquet_data(trial, rank, world)
    batches = rank_batches(ray.train.get_dataset_shard("train"), trial.train.global_batch, rank, world)
    return batches, collect(ray.train.get_dataset_shard("eval")), train_rows
