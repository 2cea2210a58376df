"""``parquet_batches`` through Ray Data gives ``train_batches``' batches, row for row and in order,
for every process, epoch after epoch, whatever the Parquet files' sizes."""

from __future__ import annotations

import itertools
import json
import shutil
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxray.config import ConfigError, parse_trial
from jaxray.config.experiment import load_experiment
from jaxray.data.batching import train_batches
from jaxray.data.manifest import MANIFEST, ManifestError, read_manifest
from jaxray.data.parquet import parquet_batches, parquet_dataset, split_arrays
from jaxray.data.prepare import to_table
from jaxray.data.workloads import parquet_folder, train_source
from jaxray.parallel.checks import plan_experiment
from jaxray.storage import file_sha256, resolve
from jaxray.tune import check_batches, first_trials

pytestmark = pytest.mark.ray
SEED = 7


def within(seconds: float, fn):
    """``fn()``'s result; fails the test if it takes longer than ``seconds`` (a rank waiting forever)."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            result["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"no result within {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def assert_same_batches(folder, arrays, global_batch, process_count, batches):
    for p in range(process_count):
        # A generator: nothing is read until ``within`` takes from it.
        stream = parquet_batches(str(folder), "train", global_batch, SEED, p, process_count)
        got = within(300, lambda s=stream: list(itertools.islice(s, batches)))
        source = train_source(read_manifest(str(folder)).dataset, arrays)
        want = itertools.islice(train_batches(source, global_batch, SEED, p, process_count), batches)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.keys() == w.keys(), i
            for k in w:
                assert g[k].dtype == w[k].dtype and g[k].shape == w[k].shape, (p, i, k)
                np.testing.assert_array_equal(g[k], w[k], err_msg=f"process {p}, batch {i}, {k}")


@pytest.mark.parametrize("process_count", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_tinyshakespeare_batches_equal_train_batches(local_ray, ts_parquet, process_count):
    folder, splits = ts_parquet
    # 7842 rows, global batch 1024: 7 batches an epoch (the 674-row tail dropped); 16 = 2 epochs and 2.
    assert_same_batches(folder, splits["train"], 1024, process_count, 16)


@pytest.mark.slow  # ~5 s; text's rows take the same path in make test
def test_fashion_mnist_batches_equal_train_batches(local_ray, fm_parquet):
    folder, splits = fm_parquet
    # 60000 rows, global batch 8192: 7 batches an epoch; both processes, into the second epoch.
    assert_same_batches(folder, splits["train"], 8192, 2, 9)


def test_split_arrays_and_decoded_bytes(local_ray, fm_parquet):
    folder, splits = fm_parquet
    got = split_arrays(str(folder), "test")
    for name, want in splits["test"].items():
        assert got[name].dtype == want.dtype
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    manifest = read_manifest(str(folder))
    assert manifest.decoded_bytes("train") == 60_000 * (784 * 4 + 4)


def test_a_split_larger_than_the_memory_given_is_refused_naming_both_sizes(fm_parquet, tmp_path):
    folder = str(fm_parquet[0])
    with pytest.raises(
        ManifestError, match=r"split train decodes to 180 MiB, more than data.parquet_cache_mib \(100 MiB\)"
    ):
        next(parquet_batches(folder, "train", 1024, SEED, max_bytes=100 << 20))
    # A sweep refuses it before Ray starts: check_batches reads every sweep's folder through this.
    (tmp_path / "fashion-mnist").symlink_to(folder)
    trial = {"model": {"workload": "mlp"}, "data": {"parquet": str(tmp_path), "parquet_cache_mib": 100}}
    with pytest.raises(ManifestError, match="decodes to 180 MiB, more than data.parquet_cache_mib"):
        parquet_folder(parse_trial(trial))


def test_uneven_files_give_every_process_the_same_batches(local_ray, ts_parquet, tmp_path):
    """Files of 1, 5, 1794, 3 and 6039 rows (and row groups of 7): both processes still get exactly
    7 batches an epoch, equal to train_batches, in bounded time (into the second epoch)."""
    source, splits = ts_parquet
    arrays = splits["train"]
    manifest = json.loads((source / MANIFEST).read_text())
    (tmp_path / "train").mkdir()
    files = []
    cuts = [0, 1, 6, 1800, 1803, len(arrays["tokens"])]
    for i, (start, stop) in enumerate(itertools.pairwise(cuts)):
        path = tmp_path / "train" / f"part-{i:05d}.parquet"
        pq.write_table(to_table(arrays, start, stop, b"{}"), path, row_group_size=7)
        fs, local = resolve(str(path))
        files.append({"path": f"train/{path.name}", "rows": stop - start, "sha256": file_sha256(local, fs)})
    manifest["splits"]["train"] = {"rows": cuts[-1], "files": files}
    (tmp_path / "validation").symlink_to(source / "validation")
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    assert_same_batches(tmp_path, arrays, 1024, 2, 8)


def test_parquet_dataset_reads_a_uri_in_natural_order(local_ray, ts_parquet):
    folder, splits = ts_parquet
    ds = parquet_dataset(f"file://{folder}", "validation")
    batch = ds.take_batch(10_000, batch_format="pyarrow")
    np.testing.assert_array_equal(
        batch.column("row").to_numpy(), np.arange(len(splits["validation"]["tokens"]))
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"global_batch": 8000}, "batch size 8000 is larger than the 7842 rows"),
        ({"global_batch": 1000, "process_count": 3}, "batch size 1000 does not divide over 3 processes"),
        ({"global_batch": 1024, "process_index": 2, "process_count": 2}, "process_index 2 is not in 0..1"),
    ],
)
def test_impossible_sizes_are_refused(ts_parquet, kwargs, message):
    with pytest.raises(ValueError, match=message):
        next(parquet_batches(str(ts_parquet[0]), "train", seed=SEED, **kwargs))


def test_a_file_changed_after_prepare_is_refused_before_ray(fm_parquet, tmp_path):
    """check_batches (before Ray) reads each sweep's folder with its checksums: a part file rewritten
    after ``prepare`` (the same rows, other labels) is refused, naming it."""
    copy = tmp_path / "fashion-mnist"
    shutil.copytree(fm_parquet[0], copy)
    part = sorted((copy / "train").glob("*.parquet"))[0]
    table = pq.read_table(part)
    labels = pa.array((table.column("label").to_numpy() + 1) % 10, pa.int32())
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", labels), part)
    trial = parse_trial({"model": {"workload": "mlp"}, "data": {"parquet": str(tmp_path)}})
    parquet_folder(trial)  # the workers' read: the names and sizes only
    config = tmp_path / "c.yaml"
    config.write_text(
        f"experiment: t\ndata: {{parquet: {tmp_path}}}\nsweeps:\n  - workload: mlp\n"
        "    search_space: {global_batch: [64]}\n"
    )
    exp = load_experiment(config)
    with pytest.raises(ConfigError, match=f"data.parquet: {part} does not match the SHA-256 recorded"):
        check_batches(exp, first_trials(plan_experiment(exp, str(config))), {})


def test_a_relative_folder_is_made_absolute_where_the_config_is_parsed(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    data = parse_trial({"model": {"workload": "mlp"}, "data": {"parquet": "pq", "data_dir": "d"}}).data
    assert (data.parquet, data.data_dir) == (str(tmp_path / "pq"), str(tmp_path / "d"))
    assert (
        parse_trial({"model": {"workload": "mlp"}, "data": {"parquet": "gs://b/pq"}}).data.parquet
        == "gs://b/pq"
    )


def test_a_blank_folder_is_none():
    data = parse_trial({"model": {"workload": "mlp"}, "data": {"parquet": "", "data_dir": ""}}).data
    assert (data.parquet, data.data_dir) == (None, None)
