"""Where the Ray cluster is (``init_ray``), and how a trial's workers become one JAX program: one JAX
process per worker; on GPU the JaxTrainer backend initialises ``jax.distributed``, on CPU
``cpu_program`` does (gloo collectives)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import ray
import ray.data
from ray.train.collective import broadcast_from_rank_zero

from jaxray import storage
from jaxray.config import ConfigError, WorkersConfig
from jaxray.config.experiment import ExperimentConfig
from jaxray.reporting import terminal
from jaxray.reporting.terminal import QUIET_ENV


def ray_address_file() -> Path:
    """Where ``ray start`` records its cluster's ``host:port``: ``ray/ray_current_cluster`` under
    ``$RAY_TMPDIR``, else ``$TMPDIR``, else ``/tmp``."""
    default = os.environ.get("TMPDIR", "/tmp") if sys.platform.startswith("linux") else "/tmp"
    return Path(os.environ.get("RAY_TMPDIR", default)) / "ray" / "ray_current_cluster"


def running_local_cluster(address_file: Path | None = None) -> str | None:
    """The ``host:port`` of a live ``ray start`` cluster on this machine (in ``address_file``), or None.
    A one-second TCP probe of the GCS port tells live from stale (``address="auto"`` would wait
    minutes for a dead one)."""
    try:
        address = (address_file or ray_address_file()).read_text().strip()
    except OSError:
        return None
    host, _, port = address.rpartition(":")
    if not host:
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
    except (OSError, ValueError):
        return None
    return address


def init_ray(exp: ExperimentConfig) -> tuple[bool, str | None]:
    """Join ``RAY_ADDRESS`` or a live local ``ray start`` cluster, else (or with ``RAY_ADDRESS=local``)
    start a private local Ray. Returns (joined a cluster, dashboard URL or None). Raises ConfigError
    naming the address when joining fails."""
    os.environ.update(QUIET_ENV)
    ray.data.DataContext.get_current().enable_progress_bars = False
    runtime_env = {"env_vars": QUIET_ENV}
    address = os.environ.get("RAY_ADDRESS")
    if (
        not address
        and (address := running_local_cluster())
        and (Path.home() / ".ray" / "auth_token").is_file()
    ):
        # A `ray start` cluster of Ray 2.60 uses token auth; this user's token is the key to it.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    joined = bool(address) and address != "local"
    if joined:
        try:
            context = ray.init(address=address, runtime_env=runtime_env)
        except Exception as err:  # Ray raises ConnectionError, RuntimeError or its own auth errors
            raise ConfigError(
                f"could not join the Ray cluster at {address}: {type(err).__name__}: {err}\n"
                f"With token auth set RAY_AUTH_MODE=token; to start a private local Ray "
                f"instead set RAY_ADDRESS=local"
            ) from None
        print(
            f"jaxray: joined the Ray cluster at {ray.get_runtime_context().gcs_address}", file=terminal.err()
        )
    else:  # one CPU for each trial driver and each worker; Tune queues what does not fit
        need = (exp.max_concurrent_trials or 1) * (1 + exp.workers.worker_range[1]) + 1
        context = ray.init(address="local", num_cpus=max(need, os.cpu_count() or 1), runtime_env=runtime_env)
    url = context.dashboard_url  # Ray gives host:port
    return joined, f"http://{url}" if url and "://" not in url else url or None


def check_storage(exp: ExperimentConfig) -> None:
    """ConfigError naming ``storage`` when it is set and cannot be written, before anything runs."""
    if exp.storage is None:
        return
    try:
        storage.check_writable(exp.storage)
    except OSError as err:
        raise ConfigError(
            f"storage: {err} (endpoint and credentials come from the environment, as pyarrow reads them)"
        ) from None


def check_accelerators(exp: ExperimentConfig, joined: bool) -> None:
    """With GPU or TPU workers, ConfigError for a cluster started here without enough of them (Tune
    would wait forever); a joined cluster may autoscale, so only warn."""
    w = exp.workers
    if w.accelerator == "cpu":
        return
    kind = w.accelerator.upper()
    have = int(ray.cluster_resources().get(kind, 0))
    if have >= w.devices_per_worker:
        return
    message = (
        f"workers.accelerator is {w.accelerator} and each worker needs {w.devices_per_worker} {kind}(s), "
        f"but the Ray cluster has {have}; set workers.accelerator: cpu to train on CPU"
    )
    if not joined:
        raise ConfigError(message)
    print(f"warning: {message}; waiting for the cluster to add {kind} nodes", file=terminal.err())


@contextlib.contextmanager
def cpu_program(workers: WorkersConfig, rank: int, world: int) -> Iterator[None]:
    """Inside: this worker is ``rank`` of a ``world``-process CPU JAX program when several workers
    train on CPU (rank 0's ``host:port`` broadcast by Ray Train); otherwise nothing. Enter before
    JAX's backend starts."""
    joined = world > 1 and workers.accelerator == "cpu"
    if joined:
        address = None
        if rank == 0:
            with socket.socket() as probe:
                probe.bind(("", 0))
                address = f"{ray.util.get_node_ip_address()}:{probe.getsockname()[1]}"
        address = broadcast_from_rank_zero(address)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(address, num_processes=world, process_id=rank)
    yield
    if joined:
        jax.distributed.shutdown()  # JaxTrainer's backend only shuts down what it started (GPU, TPU)


def check_local_devices(workers: WorkersConfig) -> None:
    """Raises ConfigError when this process sees other than ``workers.devices_per_worker`` devices."""
    found = jax.local_device_count()
    if found != workers.devices_per_worker:
        raise ConfigError(
            f"workers.devices_per_worker is {workers.devices_per_worker} but this worker "
            f"sees {found} {jax.default_backend()} device(s): {jax.local_devices()}"
        )


def describe_worker(rank: int) -> str:
    """One log line: Ray rank, JAX process index and count, local devices, GPU UUIDs."""
    line = (
        f"jaxray worker rank {rank}: JAX process {jax.process_index()} of {jax.process_count()}, "
        f"local devices {jax.local_devices()}"
    )
    if jax.default_backend() == "gpu":
        line += f", GPUs {gpu_uuids()}"
    return line


def gpu_uuids() -> list[str]:
    """UUIDs of the GPUs this process may use (``CUDA_VISIBLE_DEVICES`` order) from ``nvidia-smi``;
    [] when it cannot be asked."""
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    uuids = dict(line.split(", ", 1) for line in listing.strip().splitlines() if ", " in line)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [uuids.get(i.strip(), i.strip()) for i in visible.split(",")] if visible else list(uuids.values())
