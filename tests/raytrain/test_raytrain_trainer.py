"""The JaxTrainer's worker environment: the CPU device count is forced before JAX starts there, and
the driver's own XLA_FLAGS are kept."""

from __future__ import annotations

import pytest

from jaxray.config import WorkersConfig
from jaxray.raytrain.trainer import cpu_xla_flags, worker_env


def test_worker_env_sets_the_devices_before_jax_starts(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    cpu = worker_env(WorkersConfig(devices_per_worker=4))
    assert cpu["JAX_PLATFORMS"] == "cpu"
    assert cpu["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    gpu = worker_env(WorkersConfig(use_gpu=True))
    assert gpu["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and "XLA_FLAGS" not in gpu
    assert cpu["RAY_DATA_DISABLE_PROGRESS_BARS"] == gpu["RAY_DATA_DISABLE_PROGRESS_BARS"] == "1"


@pytest.mark.parametrize(
    "user, expected",
    [
        ("", "--xla_force_host_platform_device_count=2"),
        (
            "--xla_cpu_enable_fast_math=false",
            "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=2",
        ),
        (
            "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8  --xla_cpu_enable_fast_math=0",
            "--xla_dump_to=/tmp/d --xla_cpu_enable_fast_math=0 --xla_force_host_platform_device_count=2",
        ),
    ],
)
def test_cpu_workers_keep_the_users_xla_flags(user, expected):
    assert cpu_xla_flags(2, user) == expected
    assert worker_env(WorkersConfig(devices_per_worker=2), user)["XLA_FLAGS"] == expected


def test_the_drivers_xla_flags_are_the_default(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    assert (
        worker_env(WorkersConfig())["XLA_FLAGS"]
        == "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=1"
    )
    assert worker_env(WorkersConfig(use_gpu=True))["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
    # Given explicitly (the driver's, passed to the Tune actor that builds the trainer), they win.
    assert worker_env(WorkersConfig(), "")["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
