"""Training that survives the cluster, on a Ray cluster of a head and worker nodes on this machine
(``ray.cluster_utils.Cluster``, as Ray's own elastic tests): a 2-worker trial whose node is removed
after its first complete checkpoint, and one whose node gets a preemption notice (``ray drain-node``
with a deadline) and then goes. Each resumes on a replacement node from the newest complete checkpoint
(losing no steps on the notice) and ends bitwise equal to an uninterrupted run; its summary names
the cause. The workers pause at given steps (tests/faults.py) so that the node goes mid-run. The
lost node's trial keeps its checkpoints on object storage (moto's S3 server), the others in a
shared folder."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import faults
import jax
import numpy as np
import pyarrow.fs as pafs
import pytest
import ray
from private_ray import free_port
from ray.cluster_utils import Cluster
from s3_server import s3_server

from jaxray import checkpoint, storage
from jaxray.checkpoint import remote
from jaxray.config import parse_trial
from jaxray.data.workloads import load_arrays
from jaxray.raytrain.trainable import trial_datasets
from jaxray.raytrain.trainer import make_trainer

pytestmark = [pytest.mark.ray, pytest.mark.slow]
TRIAL = {
    "model": {"workload": "transformer", "width": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 32},
    "data": {"seq_len": 32},
    "train": {
        **{"global_batch": 8, "steps": 40, "learning_rate": 3e-3},
        **{"log_every": 5, "report_every": 10, "checkpoint_every": 10},
    },
    "workers": {"num_workers": 2, "max_failures": 1},
}
NODE_CPUS = 2  # one node holds the trial's two workers
WAIT_S = 240
COORDINATOR_REFRESH_S = 60  # three of its 20 s ticks: on a loaded machine 25 s once missed
BUCKET = "jaxray"
FAULT_FILE = Path(tempfile.gettempdir()) / f"jaxray-fault-{os.getpid()}.json"  # read by the workers


class Nodes:
    """The cluster and its one worker node (``current``), replaced by the tests."""

    def __init__(self) -> None:
        # A dashboard port of its own (tests/private_ray.py says why): `make test-all` runs these
        # tests beside the slow part, whose Rays have dashboards.
        head = {"num_cpus": 0, "include_dashboard": False, "dashboard_port": free_port()}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self.current = self.cluster.add_node(num_cpus=NODE_CPUS)
        ray.init(
            address=self.cluster.address, log_to_driver=False, runtime_env=faults.runtime_env(FAULT_FILE)
        )

    def replace(self, remove: bool = True) -> None:
        """Remove the worker node (its raylet and processes killed) unless ``remove`` is False, and
        add a new one."""
        old, self.current = self.current, self.cluster.add_node(num_cpus=NODE_CPUS)
        if remove:
            self.cluster.remove_node(old, allow_graceful=False)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server, started before the cluster: its nodes inherit the AWS_* variables (and a
    checkpoint cache of the test's own)."""
    env = pytest.MonkeyPatch()
    env.setenv(storage.CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
    try:
        with s3_server(BUCKET) as fs:
            yield fs
    finally:
        env.undo()


@pytest.fixture(scope="module")
def nodes(s3):
    found = Nodes()
    yield found
    ray.shutdown()
    found.cluster.shutdown()


@pytest.fixture(scope="module")
def datasets(real_dir, nodes):
    trial = trial_config(real_dir)
    train_arrays, held_out = load_arrays(trial)
    return trial_datasets(trial, (train_arrays, {k: v[:64] for k, v in held_out.items()}))


def trial_config(real_dir: Path, workers: dict | None = None):
    data = {**TRIAL["data"], "data_dir": str(real_dir)}
    return parse_trial({**TRIAL, "data": data, "workers": workers or TRIAL["workers"]})


def start_fit(
    real_dir,
    datasets,
    storage: Path,
    name: str,
    fault: dict | None = None,
    workers: dict | None = None,
    storage_uri: str | None = None,
) -> tuple[threading.Thread, dict]:
    """Runs the trial in a thread; the dict gets its ``result``."""
    trainer = None
    faults.set_fault(FAULT_FILE, fault)  # read by the workers when the trial starts
    trial = trial_config(real_dir, workers)
    trainer = make_trainer(trial, datasets, storage_path=storage, name=name, storage_uri=storage_uri)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=trainer.fit()), daemon=True)
    thread.start()
    return thread, out


def finish(thread: threading.Thread, out: dict):
    thread.join(WAIT_S)
    assert not thread.is_alive(), f"the trial did not finish within {WAIT_S} s"
    result = out["result"]
    assert result.error is None, result.error
    return result


def wait_complete(folder: Path) -> None:
    """Until ``folder`` is a complete checkpoint (its ``train_state.json`` written)."""
    deadline = time.monotonic() + WAIT_S
    while not (folder / checkpoint.TRAIN_STATE).is_file():
        if time.monotonic() >= deadline:  # the checkpoints that do exist say which case it was
            found = sorted(p.name for p in folder.parent.glob("checkpoint_*"))
            pytest.fail(f"{folder} never completed; beside it: {found}")
        time.sleep(0.5)


def final_params(result) -> list[np.ndarray]:
    ckpt = result.checkpoint  # on object storage: fetched (checked) into the local cache first
    local = isinstance(ckpt.filesystem, pafs.LocalFileSystem)
    path = ckpt.path if local else remote.fetch(f"{ckpt.filesystem.type_name}://{ckpt.path}")
    return [np.asarray(x) for x in jax.tree.leaves(checkpoint.restore(path)[1])]


@pytest.fixture(scope="module")
def uninterrupted(real_dir, datasets, tmp_path_factory):
    return finish(*start_fit(real_dir, datasets, tmp_path_factory.mktemp("whole"), "whole"))


def assert_same_model(result, reference) -> None:
    for x, y in zip(final_params(result), final_params(reference), strict=True):
        np.testing.assert_array_equal(x, y)
    assert result.metrics["final_train_loss"] == reference.metrics["final_train_loss"]


def test_a_lost_node_costs_at_most_one_checkpoint_interval(
    real_dir, datasets, nodes, uninterrupted, s3, tmp_path
):
    """The workers pause at step 21 (for up to 60 s): step 10's checkpoint is complete and reported,
    step 20's is still being written. Their node is removed and a new one joins: the trial resumes
    from step 10. ``storage`` is on S3: the workers stage each checkpoint on their node and Ray
    uploads it; on the new node the restart fetches step 10's back from the bucket, where the
    attempt count and the restart causes are too.
    (A shared folder: the preemption and elastic tests below.)"""
    fault = {"pause_at_steps": [21], "pause_s": 60}  # cut short by the node's removal
    uri = f"s3://{BUCKET}/lost"
    thread, out = start_fit(real_dir, datasets, tmp_path, "lost-s3", fault, storage_uri=uri)
    state = f"{BUCKET}/lost/lost-s3/checkpoint_step_00000010_attempt1/{checkpoint.TRAIN_STATE}"
    deadline = time.monotonic() + WAIT_S
    while s3.get_file_info(state).type != pafs.FileType.File:
        assert time.monotonic() < deadline, f"{state} never uploaded"
        time.sleep(0.5)
    time.sleep(4)  # within the pause: Ray Train's controller collects reports every 2 s
    nodes.replace()
    removed = time.monotonic()
    result = finish(thread, out)
    print(f"node removed -> trial finished: {time.monotonic() - removed:.1f} s")  # docs/cluster.md
    m = result.metrics
    assert (m["restarts"], m["resumed_from_step"], m["restart_causes"]) == (1, 10, "node lost")
    assert_same_model(result, uninterrupted)
    assert not list(tmp_path.glob("lost-s3/checkpoint_*"))  # nothing written beside the run files


def test_a_preemption_notice_saves_and_loses_no_steps(real_dir, datasets, nodes, uninterrupted, tmp_path):
    """At the pause of step 21 (20 s) the node is drained with the preemption reason and a 60 s deadline
    and a replacement joins. At step 25 (the next logged step) the workers see the notice and save;
    at the pause of step 26 (up to 60 s) the node goes: the trial resumes from step 25."""
    fault = {"pause_at_steps": [21, 26], "pause_s": [20, 60]}  # the second cut short by the removal
    thread, out = start_fit(real_dir, datasets, tmp_path, "preempted", fault)
    wait_complete(tmp_path / "preempted" / "checkpoint_step_00000010_attempt1")
    node_id = nodes.current.node_id
    drain = [str(Path(sys.executable).with_name("ray")), "drain-node", "--address", nodes.cluster.address]
    drain += ["--node-id", node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "test"]
    subprocess.run([*drain, "--deadline-remaining-seconds", "60"], check=True, timeout=60)
    drained_at = time.monotonic()
    drained = nodes.current
    nodes.replace(remove=False)
    wait_complete(tmp_path / "preempted" / "checkpoint_step_00000025_attempt1")
    time.sleep(4)  # as for the lost node: the report of that save reaches Ray's controller
    saved = time.monotonic()
    nodes.cluster.remove_node(drained, allow_graceful=False)
    result = finish(thread, out)
    print(  # docs/cluster.md
        f"drained -> saved: {saved - drained_at:.1f} s (within a 20 s pause); "
        f"node removed -> trial finished: {time.monotonic() - saved:.1f} s"
    )
    m = result.metrics
    assert (m["restarts"], m["resumed_from_step"], m["restart_causes"]) == (1, 25, "preempted")
    assert_same_model(result, uninterrupted)


def test_an_elastic_group_shrinks_without_a_node_and_grows_back(
    real_dir, datasets, nodes, uninterrupted, tmp_path
):
    """``num_workers: [1, 2]`` on two 1-CPU nodes. After step 10's checkpoint one node is removed and
    none replaces it: the group goes on with 1 worker and the same global batch from step 10 (each
    worker's share doubled) and checkpoints step 20; then a node joins and Ray's resize check (every
    5 s here) brings the group back to 2 workers from step 20. The losses stay within 1e-4 of the
    fixed-size run's (the same batches; only the reductions' order differs)."""
    nodes.cluster.remove_node(nodes.current)
    one, two = (nodes.cluster.add_node(num_cpus=1) for _ in range(2))
    # Ray Train's elastic policy counts the nodes that Ray Data's autoscaling coordinator saw at its
    # last refresh (every 20 s): without this wait the group may start with 1 worker and resize.
    time.sleep(COORDINATOR_REFRESH_S)
    workers = {"num_workers": [1, 2], "max_failures": 1, "elastic_resize_monitor_interval_s": 5}
    # Both pauses end early: the first with the lost node, the second with the resize.
    fault = {"pause_at_steps": [21, 31], "pause_attempts": [1, 2], "pause_s": 90}
    thread, out = start_fit(real_dir, datasets, tmp_path, "elastic", fault, workers=workers)
    wait_complete(tmp_path / "elastic" / "checkpoint_step_00000010_attempt1")
    time.sleep(4)
    nodes.cluster.remove_node(two, allow_graceful=False)
    lost = time.monotonic()
    wait_complete(tmp_path / "elastic" / "checkpoint_step_00000020_attempt2")
    print(f"node removed -> step 20 saved by 1 worker: {time.monotonic() - lost:.1f} s")  # docs/cluster.md
    added = time.monotonic()
    nodes.current = nodes.cluster.add_node(num_cpus=1)
    result = finish(thread, out)
    print(f"node added -> trial finished: {time.monotonic() - added:.1f} s")  # docs/cluster.md
    m = result.metrics
    assert (m["restarts"], m["resumed_from_step"]) == (2, 20)
    assert (m["restart_causes"], m["workers_by_attempt"]) == ("node lost, resized", "2, 1, 2")
    # Attempt 2's checkpoint was written by one JAX process.
    shards = list(
        (tmp_path / "elastic" / "checkpoint_step_00000020_attempt2" / "params").glob("ocdbt.process_*")
    )
    assert len(shards) == 1
    np.testing.assert_allclose(m["final_train_loss"], uninterrupted.metrics["final_train_loss"], rtol=1e-4)
    np.testing.assert_allclose(m["val_loss"], uninterrupted.metrics["val_loss"], rtol=1e-4)
    # As a whole: Adam's normalised updates carry the reductions' rounding into the smallest params.
    got, want = (np.concatenate([x.ravel() for x in final_params(r)]) for r in (result, uninterrupted))
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
    nodes.cluster.remove_node(one)
