"""Fixtures of the data tests."""

from __future__ import annotations

import gc

import pytest
import ray
from private_ray import init_private_ray


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray on 2 CPUs for one test module, shut down after it."""
    init_private_ray(num_cpus=2)
    # What jaxray.raytrain.trainer's DataConfig sets for the workers: without it Ray Data may hand blocks
    # over out of order (test_ray_data failed about once in several runs before).
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    yield
    # Dropped Ray Data iterators report their stats to Ray when finalized: finalize them while Ray is
    # up. Finalized after shutdown, that call started a new Ray in this process (Ray's auto-init),
    # whose dead GCS later ended the test process (CI at 8386ee4: the cluster tests, 60 s on).
    gc.collect()
    ray.shutdown()


# Small files on purpose: several files and row groups per split, the last file shorter.
TS_SEQ_LEN, TS_ROWS_PER_FILE, TS_ROW_GROUP = 128, 2000, 500


@pytest.fixture(scope="session")
def ts_parquet(real_dir, tmp_path_factory):
    """(folder, natural splits): TinyShakespeare at seq_len 128 (7842 train rows) as Parquet, 2000
    rows a file, and the same unshuffled arrays in memory."""
    from jaxray.data.prepare import prepare
    from jaxray.data.workloads import natural_splits

    out = tmp_path_factory.mktemp("parquet") / "ts"
    prepare("tinyshakespeare", out, str(real_dir), TS_SEQ_LEN, TS_ROWS_PER_FILE, TS_ROW_GROUP)
    return out, natural_splits("tinyshakespeare", str(real_dir), TS_SEQ_LEN)


@pytest.fixture(scope="session")
def fm_parquet(real_dir, tmp_path_factory):
    """(folder, natural splits): all of Fashion-MNIST as Parquet, 16384 rows a file (4 train files)."""
    from jaxray.data.prepare import prepare
    from jaxray.data.workloads import natural_splits

    out = tmp_path_factory.mktemp("parquet") / "fm"
    prepare("fashion-mnist", out, str(real_dir), rows_per_file=16384)
    return out, natural_splits("fashion-mnist", str(real_dir))
