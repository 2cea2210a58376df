"""Fixed-shape batches: training batches from a sample source (rows of equal-length numpy arrays, or
windows at every offset of a token stream) in a new order each epoch; evaluation batches from
arrays, the tail padded and masked."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

Arrays = Mapping[str, np.ndarray]


@dataclass(frozen=True, eq=False)
class Windows:
    """A training text as samples: sample i is ``tokens[i : i + seq_len]`` (the model's inputs and
    shifted targets), for every offset i in 0..len(tokens) - seq_len, as nanoGPT's ``get_batch``
    draws them. ``tokens``: [T] int32, the training split only (no window reaches past it)."""

    tokens: np.ndarray
    seq_len: int

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or len(self.tokens) < self.seq_len:
            raise ValueError(f"Windows needs a 1-D stream of at least seq_len={self.seq_len} tokens")

    def __len__(self) -> int:
        return len(self.tokens) - self.seq_len + 1

    def gather(self, starts: np.ndarray) -> dict[str, np.ndarray]:
        """``{"tokens": [len(starts), seq_len] int32}``, the windows starting at ``starts``."""
        return {"tokens": self.tokens[np.asarray(starts)[:, None] + np.arange(self.seq_len)]}


# What training batches are drawn from: rows of arrays (the MLPs' images) or text windows.
Source = Arrays | Windows


def num_samples(source: Source) -> int:
    """Samples a training epoch draws from: rows, or window offsets."""
    return len(source) if isinstance(source, Windows) else num_rows(source)


def gather(source: Source, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Samples ``ids`` ([n] int) of ``source`` as a batch of arrays."""
    return source.gather(ids) if isinstance(source, Windows) else {k: v[ids] for k, v in source.items()}


def num_rows(arrays: Arrays) -> int:
    """Row count; ValueError if the columns disagree."""
    sizes = {k: len(v) for k, v in arrays.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"columns have different row counts: {sizes}")
    return next(iter(sizes.values()))


@functools.lru_cache(maxsize=4)
def epoch_order(samples: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch ``epoch``'s sample order, [samples] int64, read-only; every data path (memory, Ray
    Data, Parquet) uses it. Cached: a window epoch of TinyShakespeare is a million offsets."""
    order = np.random.default_rng([seed, epoch]).permutation(samples)
    order.flags.writeable = False
    return order


def sample_ids(samples: int, global_batch: int, seed: int | None, positions: np.ndarray) -> np.ndarray:
    """The sample ids at global ``positions`` ([n] int64; position q is row q % G of step q // G):
    epochs of ``samples // global_batch`` batches, the tail of each dropped, epoch e in the order
    ``epoch_order(samples, seed, e)`` (``seed`` None: natural order every epoch)."""
    span = samples // global_batch * global_batch  # samples an epoch uses
    epochs, within = np.divmod(np.asarray(positions, np.int64), span)
    if seed is None:
        return within
    ids = np.empty_like(within)
    for e in np.unique(epochs):
        here = epochs == e
        ids[here] = epoch_order(samples, seed, int(e))[within[here]]
    return ids


def check_batch(samples: int, batch_size: int, process_count: int = 1) -> None:
    """ValueError for fewer samples than one batch or a batch not divisible by ``process_count``."""
    if samples < batch_size:
        raise ValueError(f"batch size {batch_size} is larger than the {samples} samples of the dataset")
    if batch_size % process_count:
        raise ValueError(f"batch size {batch_size} does not divide over {process_count} processes")


def train_batches(
    source: Source, batch_size: int, seed: int | None = None, process_index: int = 0, process_count: int = 1
) -> Iterator[dict[str, np.ndarray]]:
    """Endless training batches of ``source``; each epoch's partial last batch is dropped. ``seed``
    None keeps the natural order, else epoch e follows ``epoch_order(n, seed, e)``. This process
    yields rows ``[p * local, (p + 1) * local)`` of each global batch. Raises ValueError as
    ``check_batch``."""
    n = num_samples(source)
    check_batch(n, batch_size, process_count)
    local = batch_size // process_count
    for step in itertools.count():
        start = step * batch_size + process_index * local
        yield gather(source, sample_ids(n, batch_size, seed, np.arange(start, start + local)))


def eval_batches(arrays: Arrays, global_batch: int) -> Iterator[dict[str, np.ndarray]]:
    """This process's rows of each ``global_batch``-row eval batch, the last zero-padded, each with
    ``"mask"`` [rows] float32 (1 real, 0 padding); ``global_batch`` must divide by process count."""
    import jax  # here, not above: Ray Data's processes import this module to draw, never to evaluate

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
