"""Fashion-MNIST loading on the real files, and IDX parsing errors."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from jaxray.data import fashion_mnist
from jaxray.data.fashion_mnist import (
    CLASS_NAMES,
    FashionMNIST,
    load_fashion_mnist,
    parse_idx_images,
    parse_idx_labels,
)
from jaxray.data.sources import DataFileError, read_verified


@pytest.fixture(scope="module")
def fmnist(real_dir) -> FashionMNIST:
    return load_fashion_mnist(real_dir)


def test_class_names():
    assert len(CLASS_NAMES) == 10
    assert CLASS_NAMES[0] == "T-shirt/top" and CLASS_NAMES[9] == "Ankle boot"
    assert CLASS_NAMES[6] == "Shirt" and CLASS_NAMES[7] == "Sneaker"


def test_real_shapes_dtypes_ranges(fmnist):
    assert fmnist.train_images.shape == (60000, 784)
    assert fmnist.test_images.shape == (10000, 784)
    assert fmnist.train_labels.shape == (60000,)
    assert fmnist.test_labels.shape == (10000,)
    for images in (fmnist.train_images, fmnist.test_images):
        assert images.dtype == np.float32
        assert images.min() == 0.0 and images.max() == 1.0
    for labels, per_class in ((fmnist.train_labels, 6000), (fmnist.test_labels, 1000)):
        assert labels.dtype == np.int32
        # Fashion-MNIST is exactly balanced; this also checks labels are in 0..9.
        assert np.bincount(labels, minlength=10).tolist() == [per_class] * 10


def test_real_data_is_in_file_order(real_dir, fmnist):
    raw = gzip.decompress((real_dir / "fashion-mnist/train-labels-idx1-ubyte.gz").read_bytes())
    np.testing.assert_array_equal(fmnist.train_labels, np.frombuffer(raw, np.uint8, offset=8))
    raw = gzip.decompress((real_dir / "fashion-mnist/t10k-images-idx3-ubyte.gz").read_bytes())
    first = np.frombuffer(raw, np.uint8, count=784, offset=16)
    np.testing.assert_array_equal(fmnist.test_images[0] * 255, first.astype(np.float32))


def test_count_mismatch_between_images_and_labels(real_dir, monkeypatch):
    def swapped(name, data_dir=None):
        # Pair the train images with the (real, 10000-entry) test labels.
        return read_verified(name.replace("train-labels", "t10k-labels"), data_dir)

    monkeypatch.setattr(fashion_mnist, "read_verified", swapped)
    with pytest.raises(DataFileError, match="60000 images but .* has 10000 labels"):
        load_fashion_mnist(real_dir)


# Synthetic IDX bytes below: unit tests of the parser's shape and error checks.


def _images(n: int, rows: int = 28, cols: int = 28, magic: int = 2051) -> bytes:
    pixels = (np.arange(n * rows * cols) % 256).astype(np.uint8)
    return struct.pack(">4I", magic, n, rows, cols) + pixels.tobytes()


def _labels(values: list[int], magic: int = 2049) -> bytes:
    return struct.pack(">2I", magic, len(values)) + bytes(values)


def test_parse_images_shape():
    arr = parse_idx_images(_images(3), "imgs")
    assert arr.shape == (3, 28, 28) and arr.dtype == np.uint8
    assert arr[0, 0, :4].tolist() == [0, 1, 2, 3]


def test_parse_labels_shape():
    arr = parse_idx_labels(_labels([0, 9, 3]), "lbls")
    assert arr.dtype == np.uint8 and arr.tolist() == [0, 9, 3]


@pytest.mark.parametrize(
    "parse, raw, pattern",
    [
        (parse_idx_images, _labels([1, 2]), "magic number 2049, expected 2051"),
        (parse_idx_labels, _images(1), "magic number 2051, expected 2049"),
        (parse_idx_images, _images(2)[:-1], "truncated: .* 1584 bytes, but it has 1583"),
        (parse_idx_labels, _labels([1, 2, 3])[:-2], "truncated: .* 11 bytes, but it has 9"),
        (parse_idx_images, _images(2) + b"\0", "trailing bytes: .* 1584 bytes, but it has 1585"),
        (parse_idx_labels, _labels([1]) + b"xy", "trailing bytes: .* 9 bytes, but it has 11"),
        (parse_idx_images, b"\x00\x00\x08", "truncated: an IDX header needs 16 bytes"),
        (parse_idx_images, _images(1, rows=14, cols=56), "14x56 images, expected 28x28"),
        (parse_idx_labels, _labels([0, 10]), "label 10 at index 1"),
    ],
)
def test_parse_errors_name_the_file(parse, raw, pattern):
    with pytest.raises(DataFileError, match=pattern) as exc:
        parse(raw, "some/file-ubyte")
    assert "some/file-ubyte" in str(exc.value)
