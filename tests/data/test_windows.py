"""Training windows at every offset of the training text, in a new order each epoch, the same from
every data path (in memory, Ray Data from arrays, Ray Data from Parquet) for one seed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxray.data.batching import Windows, epoch_order, num_samples, train_batches
from jaxray.data.parquet import parquet_batches
from jaxray.data.ray_data import shard_batches, train_dataset
from jaxray.data.shakespeare import load_shakespeare
from jaxray.data.sources import read_verified
from jaxray.data.workloads import natural_splits, train_source

SEED = 3


@pytest.fixture(scope="module")
def text(real_dir):
    """(Windows of TinyShakespeare's training split at seq_len 128, the natural splits)."""
    splits = natural_splits("tinyshakespeare", str(real_dir), 128)
    return train_source("tinyshakespeare", splits["train"]), splits


def test_windows_start_anywhere_and_reorder_every_epoch():
    stream = Windows(np.arange(50, dtype=np.int32), 8)
    assert num_samples(stream) == 43
    per_epoch = 43 // 4
    batches = list(itertools.islice(train_batches(stream, 4, SEED), 3 * per_epoch))
    starts = [b["tokens"][:, 0] for b in batches]
    for b, s in zip(batches, starts):  # each row is 8 consecutive tokens from its start
        np.testing.assert_array_equal(b["tokens"], s[:, None] + np.arange(8))
    epochs = [np.concatenate(starts[e * per_epoch : (e + 1) * per_epoch]) for e in range(3)]
    for e in epochs:
        assert len(set(e.tolist())) == len(e) == per_epoch * 4  # no offset twice in an epoch
        assert any(s % 8 for s in e)  # not only multiples of seq_len
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    again = list(itertools.islice(train_batches(stream, 4, SEED), 3 * per_epoch))
    for a, b in zip(again, batches):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])  # reproducible from the seed


def test_rows_reorder_every_epoch_too():
    arrays = {"x": np.arange(12)}
    got = [b["x"].tolist() for b in itertools.islice(train_batches(arrays, 4, SEED), 6)]
    assert sorted(sum(got[:3], [])) == list(range(12)) == sorted(sum(got[3:], []))
    assert got[:3] != got[3:]
    np.testing.assert_array_equal(np.concatenate(got[:3]), epoch_order(12, SEED, 0))


@pytest.mark.parametrize("processes", [2, 4])
def test_a_global_batch_is_the_same_whatever_the_process_count(text, processes):
    source, _ = text
    whole = list(itertools.islice(train_batches(source, 64, SEED), 5))
    parts = [
        list(itertools.islice(train_batches(source, 64, SEED, p, processes), 5)) for p in range(processes)
    ]
    for i, w in enumerate(whole):
        np.testing.assert_array_equal(np.concatenate([p[i]["tokens"] for p in parts]), w["tokens"])


def test_no_training_window_reaches_the_validation_text(text, real_dir):
    source, splits = text
    raw = np.frombuffer(read_verified("tinyshakespeare.txt", str(real_dir)), np.uint8)
    n_train = len(splits["train"]["tokens"]) * 128
    # The training text is the file's first n_train bytes; validation starts right after it.
    np.testing.assert_array_equal(source.tokens, raw[:n_train])
    np.testing.assert_array_equal(splits["validation"]["tokens"][0], raw[n_train : n_train + 128])
    last = source.gather(np.array([num_samples(source) - 1]))["tokens"][0]
    np.testing.assert_array_equal(last, raw[n_train - 128 : n_train])  # ends on the boundary
    with pytest.raises(IndexError):
        source.gather(np.array([num_samples(source)]))  # one further would cross it
    assert len(load_shakespeare(128, None, str(real_dir)).validation) == len(splits["validation"]["tokens"])


@pytest.mark.ray
def test_every_path_gives_the_same_batches(local_ray, text, ts_parquet):
    """In memory, Ray Data from the arrays, and Ray Data from a prepared Parquet folder, for one seed,
    into the second epoch (a small global batch: 7,842 x 128 bytes make ~1,000,000 offsets)."""
    source, _ = text
    steps = 6
    small = Windows(source.tokens[: 128 * 40], 128)  # 4,993 offsets: 2 epochs of 2 batches of 2,048
    for src in (source, small):
        want = list(itertools.islice(train_batches(src, 2048 if src is small else 64, SEED), steps))
        g = 2048 if src is small else 64
        ds = train_dataset(src, g, SEED, steps)
        got = list(itertools.islice(shard_batches(ds.iterator(), g), steps))
        assert len(got) == steps
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a["tokens"], b["tokens"])
    folder, _ = ts_parquet
    got = list(itertools.islice(parquet_batches(str(folder), "train", 64, SEED), steps))
    want = list(itertools.islice(train_batches(source, 64, SEED), steps))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
