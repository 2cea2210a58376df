"""The Ray Data path yields the same fixed-shape batches, in the same order, as the in-memory path."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxray.data.batching import train_batches
from jaxray.data.ray_data import shard_batches, to_dataset

pytestmark = pytest.mark.ray


def test_ray_batches_equal_in_memory_batches(local_ray):
    rng = np.random.default_rng(0)  # shape logic only: 10 rows of 3x2 "images" and labels
    arrays = {"image": rng.random((10, 3, 2), dtype=np.float32), "label": np.arange(10, dtype=np.int32)}
    ds = to_dataset(arrays)
    got = list(itertools.islice(shard_batches(ds.iterator(), 4), 5))  # two epochs and a bit, tail dropped
    want = list(itertools.islice(train_batches(arrays, 4), 5))
    for g, w in zip(got, want):
        assert (
            g["image"].shape == (4, 3, 2) and g["image"].dtype == np.float32 and g["label"].dtype == np.int32
        )
        np.testing.assert_array_equal(g["image"], w["image"])
        np.testing.assert_array_equal(g["label"], w["label"])


def test_a_shard_smaller_than_a_batch_is_an_error(local_ray):
    ds = to_dataset({"tokens": np.zeros((3, 8), np.int32)})
    with pytest.raises(ValueError, match="fewer rows than one batch of 4"):
        next(shard_batches(ds.iterator(), 4))
