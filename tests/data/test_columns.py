"""How columns are stored and read back (jaxray/data/columns.py), on the real Fashion-MNIST images."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from jaxray.data.columns import column_specs, column_values, decode_column, stored
from jaxray.data.fashion_mnist import load_fashion_mnist


@pytest.fixture(scope="module")
def images(real_dir) -> dict[str, np.ndarray]:
    fm = load_fashion_mnist(real_dir)
    return {"image": fm.test_images[:256], "label": fm.test_labels[:256]}


def test_images_are_stored_as_bytes_and_read_back_bit_for_bit(images):
    specs = column_specs(images)
    assert specs == {
        "image": {"dtype": "float32", "shape": [784], "stored": "uint8"},
        "label": {"dtype": "int32", "shape": []},
    }
    written = stored(images, specs)
    assert written["image"].dtype == np.uint8 and written["label"] is images["label"]
    np.testing.assert_array_equal(decode_column(written["image"], specs["image"]), images["image"])
    flat = pa.FixedSizeListArray.from_arrays(pa.array(written["image"].reshape(-1)), 784)
    table = pa.table({"image": flat, "label": pa.array(written["label"])})
    np.testing.assert_array_equal(column_values(table, "image", specs["image"]), images["image"])
    np.testing.assert_array_equal(column_values(table, "label", specs["label"]), images["label"])


def test_a_float_that_is_not_a_byte_over_255_is_refused(images):
    specs = column_specs(images)
    nudged = {**images, "image": images["image"] + np.float32(1e-3)}
    with pytest.raises(ValueError, match="not a multiple of 1/255"):
        stored(nudged, specs)
