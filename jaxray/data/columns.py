"""How a prepared folder's columns are stored in Parquet and read back (no Ray needed)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from jaxray.data.batching import Arrays

STORED = {"image": "uint8"}  # Fashion-MNIST pixels are written as their IDX bytes


def column_specs(arrays: Arrays) -> dict[str, dict[str, Any]]:
    """{column: {"dtype": "int32"|"float32", "shape": [per-row dims]}} (what readers return), plus
    ``"stored": "uint8"`` for a column written as bytes (``STORED``)."""
    specs = {k: {"dtype": str(v.dtype), "shape": list(v.shape[1:])} for k, v in arrays.items()}
    for name in specs.keys() & STORED.keys():
        specs[name]["stored"] = STORED[name]
    return specs


def stored(arrays: Arrays, columns: dict[str, dict[str, Any]]) -> Arrays:
    """``arrays`` as written: ``uint8`` columns back to their bytes (round(x * 255)). Raises
    ValueError if decoding those bytes would not give the original floats exactly."""
    out = dict(arrays)
    for name, spec in columns.items():
        if spec.get("stored") == "uint8":
            out[name] = np.rint(arrays[name] * np.float32(255.0)).astype(np.uint8)
            if not np.array_equal(decode_column(out[name], spec), arrays[name]):
                raise ValueError(
                    f"column {name} is not a multiple of 1/255 everywhere: cannot store it as uint8"
                )
    return out


def decode_column(values: np.ndarray, spec: dict[str, Any]) -> np.ndarray:
    """Stored values [rows, *shape] -> what readers return: ``uint8`` bytes become float32 ``x / 255``."""
    if spec.get("stored") == "uint8":
        return values.astype(np.float32) / np.float32(255.0)
    return values


def column_values(table: pa.Table, name: str, spec: dict[str, Any]) -> np.ndarray:
    """Column ``name`` (plain or fixed_size_list) of an Arrow table -> [rows, *shape] numpy of the
    manifest dtype (zero-copy where Arrow allows: no nulls, one chunk, no decoding)."""
    column = table.column(name)
    array = column.combine_chunks()
    if spec["shape"]:
        array = array.flatten()  # the values of the rows in this (possibly sliced) array
    return decode_column(array.to_numpy(zero_copy_only=False).reshape(len(column), *spec["shape"]), spec)
