"""Fashion-MNIST: verified IDX files (:mod:`jaxray.data.sources`) parsed into float32 arrays."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from jaxray.data.sources import read_verified

CLASS_NAMES: tuple[str, ...] = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
NUM_CLASSES = len(CLASS_NAMES)
IMAGE_SIDE = 28


@dataclass(frozen=True)
class FashionMNIST:
    """The Fashion-MNIST splits in file order: ``train_images`` [60000, 784] float32 in [0, 1]
    (28x28 row-major), ``train_labels`` [60000] int32 in 0..9 (:data:`CLASS_NAMES`),
    ``test_images`` [10000, 784], ``test_labels`` [10000]."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def _load_split(prefix: str, data_dir: str | os.PathLike | None) -> tuple[np.ndarray, np.ndarray]:
    """(images [N, 784] float32 in [0, 1], labels [N] int32) of a split's IDX files, whose SHA-256
    ``read_verified`` pins: their headers (16 and 8 bytes) and sizes are known."""
    images = read_verified(f"fashion-mnist/{prefix}-images-idx3-ubyte.gz", data_dir)
    labels = read_verified(f"fashion-mnist/{prefix}-labels-idx1-ubyte.gz", data_dir)
    flat = np.frombuffer(images, np.uint8, offset=16).reshape(-1, IMAGE_SIDE * IMAGE_SIDE)
    labels = np.frombuffer(labels, np.uint8, offset=8).astype(np.int32)
    return flat.astype(np.float32) / np.float32(255.0), labels


def load_fashion_mnist(data_dir: str | os.PathLike | None = None) -> FashionMNIST:
    """``data_dir`` searched first. DataFileError for a missing or corrupt file (``read_verified``)."""
    train_images, train_labels = _load_split("train", data_dir)
    test_images, test_labels = _load_split("t10k", data_dir)
    return FashionMNIST(train_images, train_labels, test_images, test_labels)
