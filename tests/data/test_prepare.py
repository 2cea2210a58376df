"""``python -m jaxray.data prepare`` on the real files: natural order, the manifest and its checks,
and bad options refused (exit 2) before anything is read or written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxray.data.__main__ import main
from jaxray.data.columns import decode_column
from jaxray.data.manifest import ManifestError, read_manifest

# As the ts_parquet fixture (tests/data/conftest.py) writes it: 2000 rows a file, groups of 500.
TS_SEQ_LEN = 128


def _read_split(folder, split) -> pa.Table:
    manifest = read_manifest(str(folder))
    return pa.concat_tables([pq.read_table(folder / rel) for rel, _, _ in manifest.split(split).files])


def test_tinyshakespeare_is_written_in_natural_order(ts_parquet):
    folder, splits = ts_parquet
    manifest = read_manifest(str(folder), verify_checksums=True)
    assert (manifest.dataset, manifest.seq_len) == ("tinyshakespeare", TS_SEQ_LEN)
    assert manifest.columns == {"tokens": {"dtype": "int32", "shape": [TS_SEQ_LEN]}}
    train = manifest.split("train")
    assert train.rows == len(splits["train"]["tokens"]) == 7842
    assert [rows for _, rows, _ in train.files] == [2000, 2000, 2000, 1842]
    for split, arrays in splits.items():
        table = _read_split(folder, split)
        assert table.schema.field("tokens").type == pa.list_(pa.int32(), TS_SEQ_LEN)
        np.testing.assert_array_equal(table.column("row").to_numpy(), np.arange(len(arrays["tokens"])))
        tokens = table.column("tokens").combine_chunks().flatten().to_numpy().reshape(-1, TS_SEQ_LEN)
        np.testing.assert_array_equal(tokens, arrays["tokens"])
    first = pq.ParquetFile(folder / train.files[0][0])
    assert (manifest.raw["rows_per_file"], manifest.raw["row_group_rows"]) == (2000, 500)
    assert first.metadata.num_row_groups == 4
    meta = json.loads(first.schema_arrow.metadata[b"jaxray"])
    assert meta == {"dataset": "tinyshakespeare", "split": "train", "columns": manifest.columns}
    raw = manifest.raw
    assert raw["sources"] == {
        "tinyshakespeare.txt": "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    }
    assert raw["versions"]["pyarrow"] == pa.__version__
    assert not [p for p in folder.parent.iterdir() if p.name.endswith(".tmp")]  # the temp folder was renamed


def test_fashion_mnist_is_written_in_file_order(fm_parquet):
    folder, splits = fm_parquet
    manifest = read_manifest(str(folder))
    assert (manifest.dataset, manifest.seq_len) == ("fashion-mnist", None)
    assert {k: s.rows for k, s in manifest.splits.items()} == {"train": 60000, "test": 10000}
    assert [rows for _, rows, _ in manifest.split("train").files] == [16384, 16384, 16384, 10848]
    for split, arrays in splits.items():
        table = _read_split(folder, split)
        assert table.schema.field("label").type == pa.int32()
        image = table.column("image").combine_chunks().flatten().to_numpy().reshape(-1, 784)
        assert image.dtype == np.uint8 and manifest.columns["image"] == {
            "dtype": "float32",
            "shape": [784],
            "stored": "uint8",
        }
        # bit for bit
        np.testing.assert_array_equal(decode_column(image, manifest.columns["image"]), arrays["image"])
        np.testing.assert_array_equal(table.column("label").to_numpy(), arrays["label"])


@pytest.fixture
def ts_copy(ts_parquet, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(ts_parquet[0], folder)
    return folder


def _edit_manifest(folder, edit) -> None:
    path = folder / "manifest.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def test_manifest_errors_name_the_file(ts_copy, tmp_path):
    with pytest.raises(ManifestError, match=f"{tmp_path}/manifest.json does not exist"):
        read_manifest(str(tmp_path))
    part = ts_copy / "train" / "part-00001.parquet"
    part.write_bytes(part.read_bytes()[:-1] + b"!")
    read_manifest(str(ts_copy))  # only sizes and presence without verify_checksums
    with pytest.raises(ManifestError, match=f"{part} does not match the SHA-256"):
        read_manifest(str(ts_copy), verify_checksums=True)
    part.unlink()
    with pytest.raises(ManifestError, match=f"{part} is listed in .*manifest.json .* but does not exist"):
        read_manifest(str(ts_copy))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["splits"]["train"].update(rows=5), "split train: rows is 5 but its files hold 7842"),
        (
            lambda m: m.update(dataset="mnist"),
            "dataset is 'mnist', expected one of tinyshakespeare, fashion-mnist",
        ),
        (lambda m: m["splits"].pop("validation"), "splits must be train and validation"),
        (lambda m: m.update(format_version=9), "format_version is 9; this jaxray reads 1"),
    ],
)
def test_inconsistent_manifest_is_refused(ts_copy, edit, message):
    _edit_manifest(ts_copy, edit)
    with pytest.raises(ManifestError, match=f"{ts_copy}/manifest.json: {message}"):
        read_manifest(str(ts_copy))


def test_unknown_split_is_named(ts_parquet):
    with pytest.raises(ManifestError, match="no split 'test' \\(it has train, validation\\)"):
        read_manifest(str(ts_parquet[0])).split("test")


def _snapshot(folder):
    return sorted(
        (str(p.relative_to(folder)), p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*")
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--dataset", "mnist"],
            "argument --dataset: invalid choice: 'mnist' (choose from 'tinyshakespeare', 'fashion-mnist')",
        ),
        (
            ["--dataset", "tinyshakespeare", "--seq-len", "0"],
            "argument --seq-len: expected a positive integer, got 0",
        ),
        (["--dataset", "tinyshakespeare", "--seq-len", "1"], "argument --seq-len: expected an integer >= 2"),
        (
            ["--dataset", "fashion-mnist", "--seq-len", "64"],
            "argument --seq-len: applies to --dataset tinyshakespeare only",
        ),
        (
            ["--dataset", "fashion-mnist", "--rows-per-file", "10", "--row-group-rows", "20"],
            "argument --row-group-rows: 20 is more than --rows-per-file 10",
        ),
        (
            ["--dataset", "tinyshakespeare", "--rows-per-file", "-3"],
            "argument --rows-per-file: expected a positive integer",
        ),
    ],
)
def test_bad_options_exit_2_before_any_work(tmp_path, capsys, args, message):
    out = tmp_path / "new"
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare", "--out", str(out), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_existing_folder_is_never_overwritten(ts_parquet, capsys):
    folder = ts_parquet[0]
    before = _snapshot(folder)
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare", "--dataset", "tinyshakespeare", "--out", str(folder)])
    assert exit_info.value.code == 2
    assert f"argument --out: {folder} exists and is not empty" in capsys.readouterr().err
    assert _snapshot(folder) == before
    assert not [p for p in folder.parent.iterdir() if p.name.endswith(".tmp")]


def test_command_line_writes_an_empty_folder(real_dir, tmp_path):
    out = tmp_path / "ts"
    out.mkdir()  # an empty folder is fine
    env = {**os.environ, "JAXRAY_DATA_DIR": str(real_dir)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxray.data",
            "prepare",
            "--dataset",
            "tinyshakespeare",
            "--out",
            str(out),
            "--seq-len",
            "512",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (
        f"wrote {out}: tinyshakespeare, train 1960 rows in 1 files, validation 218 rows in 1 files"
        in done.stdout
    )
    assert read_manifest(str(out)).seq_len == 512
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ts"]
