"""Fashion-MNIST loading on the real files."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from jaxray.data.fashion_mnist import CLASS_NAMES, FashionMNIST, load_fashion_mnist


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
