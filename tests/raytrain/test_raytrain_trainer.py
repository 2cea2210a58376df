"""The JaxTrainer's worker environment: the CPU device count is forced before JAX starts there."""

from __future__ import annotations

from jaxray.config import WorkersConfig
from jaxray.raytrain.trainer import worker_env


def test_worker_env_sets_the_devices_before_jax_starts():
    cpu = worker_env(WorkersConfig(devices_per_worker=4))
    assert cpu["JAX_PLATFORMS"] == "cpu"
    assert cpu["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    gpu = worker_env(WorkersConfig(use_gpu=True))
    assert gpu["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and "XLA_FLAGS" not in gpu
    assert cpu["RAY_DATA_DISABLE_PROGRESS_BARS"] == gpu["RAY_DATA_DISABLE_PROGRESS_BARS"] == "1"
