"""Fashion-MNIST: verified IDX files (:mod:`jaxray.data.sources`) parsed into float32 arrays."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from jaxray.data.sources import DataFileError, read_verified

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

_IMAGES_MAGIC = 2051  # IDX: unsigned byte, 3 dimensions
_LABELS_MAGIC = 2049  # IDX: unsigned byte, 1 dimension


@dataclass(frozen=True)
class FashionMNIST:
    """The Fashion-MNIST splits in file order: ``train_images`` [60000, 784] float32 in [0, 1]
    (28x28 row-major), ``train_labels`` [60000] int32 in 0..9 (:data:`CLASS_NAMES`),
    ``test_images`` [10000, 784], ``test_labels`` [10000]."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def _check_size(raw: bytes, expected: int, name: str) -> None:
    if len(raw) != expected:
        problem = "is truncated" if len(raw) < expected else "has trailing bytes"
        raise DataFileError(f"{name} {problem}: its header promises {expected} bytes, but it has {len(raw)}.")


def _header(raw: bytes, n_fields: int, magic: int, name: str) -> tuple[int, ...]:
    # Magic first, so a swapped file is reported as such, not as a short header.
    if len(raw) >= 4 and (found := struct.unpack(">I", raw[:4])[0]) != magic:
        raise DataFileError(f"{name} is not the expected IDX file: magic number {found}, expected {magic}.")
    size = 4 * n_fields
    if len(raw) < size:
        raise DataFileError(f"{name} is truncated: an IDX header needs {size} bytes, but it has {len(raw)}.")
    return struct.unpack(f">{n_fields}I", raw[:size])[1:]


def parse_idx_images(raw: bytes, name: str) -> np.ndarray:
    """Decompressed IDX3 bytes -> [N, 28, 28] uint8, a read-only view of ``raw`` (``name``: for
    messages). DataFileError for a magic other than 2051, images not 28x28, or a payload not of
    N*28*28 bytes."""
    n, rows, cols = _header(raw, 4, _IMAGES_MAGIC, name)
    if (rows, cols) != (IMAGE_SIDE, IMAGE_SIDE):
        raise DataFileError(f"{name} holds {rows}x{cols} images, expected {IMAGE_SIDE}x{IMAGE_SIDE}.")
    _check_size(raw, 16 + n * rows * cols, name)
    return np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(n, rows, cols)


def parse_idx_labels(raw: bytes, name: str) -> np.ndarray:
    """Decompressed IDX1 bytes -> [N] uint8 in 0..9, a read-only view of ``raw``. DataFileError for
    a magic other than 2049, a payload not of N bytes, or a label outside 0..9."""
    (n,) = _header(raw, 2, _LABELS_MAGIC, name)
    _check_size(raw, 8 + n, name)
    labels = np.frombuffer(raw, dtype=np.uint8, offset=8)
    if n and labels.max() >= NUM_CLASSES:
        bad = int(np.argmax(labels >= NUM_CLASSES))
        raise DataFileError(
            f"{name} has label {labels[bad]} at index {bad}; labels must be in 0..{NUM_CLASSES - 1}."
        )
    return labels


def _load_split(prefix: str, data_dir: str | os.PathLike | None) -> tuple[np.ndarray, np.ndarray]:
    images_name = f"fashion-mnist/{prefix}-images-idx3-ubyte.gz"
    labels_name = f"fashion-mnist/{prefix}-labels-idx1-ubyte.gz"
    images = parse_idx_images(read_verified(images_name, data_dir), images_name)
    labels = parse_idx_labels(read_verified(labels_name, data_dir), labels_name)
    if len(images) != len(labels):
        raise DataFileError(
            f"{images_name} has {len(images)} images but {labels_name} has "
            f"{len(labels)} labels; they must match."
        )
    flat = images.reshape(len(images), IMAGE_SIDE * IMAGE_SIDE)
    return (flat.astype(np.float32) / np.float32(255.0), labels.astype(np.int32))


def load_fashion_mnist(data_dir: str | os.PathLike | None = None) -> FashionMNIST:
    """``data_dir`` searched first. DataFileError for a missing, corrupt or malformed file, or
    differing image and label counts."""
    train_images, train_labels = _load_split("train", data_dir)
    test_images, test_labels = _load_split("t10k", data_dir)
    return FashionMNIST(train_images, train_labels, test_images, test_labels)
