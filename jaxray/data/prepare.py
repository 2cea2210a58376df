"""Write a workload's real data as Parquet for Ray Data (``python -m jaxray.data prepare``).

Row i of a split's files is row i of the unshuffled arrays (``row`` column = i); epochs are ordered
at read time (``jaxray.data.parquet``), so one folder serves every seed."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxray.data.batching import Arrays, num_rows
from jaxray.data.columns import column_specs, stored
from jaxray.data.manifest import FORMAT, FORMAT_VERSION, MANIFEST, SPLITS
from jaxray.data.sources import REGISTRY
from jaxray.data.workloads import DEFAULT_SEQ_LEN, natural_splits
from jaxray.storage import file_sha256

DATASETS = tuple(SPLITS)
DEFAULT_ROWS_PER_FILE = 8192
DEFAULT_ROW_GROUP_ROWS = 1024  # a row group is what a reader decodes at once: small enough to stream


def out_problem(out: Path) -> str | None:
    """Why ``out`` cannot receive a prepared folder (it exists and is not an empty directory), else None."""
    if out.is_dir():
        return None if not any(out.iterdir()) else f"{out} exists and is not empty; choose a new folder"
    if out.exists():
        return f"{out} exists and is not a folder"
    return None


def to_table(arrays: Arrays, start: int, stop: int, metadata: bytes) -> pa.Table:
    """Rows ``[start, stop)`` as an Arrow table: ``row`` int64, then each array as a plain column
    (1-D) or a fixed_size_list of its flattened row; schema metadata ``{b"jaxray": metadata}``."""
    columns = {"row": pa.array(np.arange(start, stop, dtype=np.int64))}
    for name, a in arrays.items():
        part = np.ascontiguousarray(a[start:stop])
        if part.ndim == 1:
            columns[name] = pa.array(part)
        else:
            flat = part.reshape(len(part), -1)
            columns[name] = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])
    return pa.table(columns).replace_schema_metadata({b"jaxray": metadata})


def write_split(
    arrays: Arrays, folder: Path, root: Path, rows_per_file: int, row_group_rows: int, metadata: bytes
) -> dict[str, Any]:
    """Write ``arrays`` as ``folder/part-NNNNN.parquet`` files of ``rows_per_file`` rows (the last may
    be shorter) -> the split's manifest entry {"rows", "files": [{"path", "rows", "bytes", "sha256"}]}."""
    folder.mkdir(parents=True)
    n, files = num_rows(arrays), []
    for i, start in enumerate(range(0, n, rows_per_file)):
        stop = min(n, start + rows_per_file)
        path = folder / f"part-{i:05d}.parquet"
        pq.write_table(to_table(arrays, start, stop, metadata), path, row_group_size=row_group_rows)
        files.append(
            {
                "path": path.relative_to(root).as_posix(),
                "rows": stop - start,
                "bytes": path.stat().st_size,
                "sha256": file_sha256(path),
            }
        )
    return {"rows": n, "files": files}


def prepare(
    dataset: str,
    out: str | os.PathLike,
    data_dir: str | None = None,
    seq_len: int = DEFAULT_SEQ_LEN,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
) -> dict:
    """Write ``dataset`` under a temporary name, then rename it to ``out`` -> the manifest written.
    Raises ValueError if ``out`` exists and is not an empty folder, DataFileError if a source file is
    missing or damaged."""
    out = Path(out).absolute()
    problem = out_problem(out)
    if problem:
        raise ValueError(problem)
    splits = natural_splits(dataset, data_dir, seq_len)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    prefix = "tinyshakespeare" if dataset == "tinyshakespeare" else "fashion-mnist/"
    try:
        columns = column_specs(splits["train"])
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "dataset": dataset,
            "seq_len": seq_len if dataset == "tinyshakespeare" else None,
            "order": "natural: row i is row i of the unshuffled arrays; shuffled per epoch at read time",
            "columns": columns,
            "rows_per_file": rows_per_file,
            "row_group_rows": row_group_rows,
            "splits": {},
            # SHA-256 of each source file's decompressed content, as ``read_verified`` checked it
            "sources": {name: known.sha256 for name, known in REGISTRY.items() if name.startswith(prefix)},
            "versions": {"jaxray": metadata.version("jaxray"), "pyarrow": pa.__version__},
        }
        for split, arrays in splits.items():
            meta = json.dumps({"dataset": dataset, "split": split, "columns": columns}).encode()
            manifest["splits"][split] = write_split(
                stored(arrays, columns), tmp / split, tmp, rows_per_file, row_group_rows, meta
            )
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp made it private; the folder should read like any other
        os.rename(tmp, out)  # atomic; replaces only an empty folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
