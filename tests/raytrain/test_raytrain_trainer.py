"""The JaxTrainer's worker environment: the CPU device count is forced before JAX starts there, and
the driver's own XLA_FLAGS are kept; its storage and run files; the recorded causes of restarts."""

from __future__ import annotations

import pytest

from jaxray.argtypes import cpu_xla_flags
from jaxray.config import WorkersConfig, parse_trial
from jaxray.raytrain.trainer import make_trainer, worker_env


def test_worker_env_sets_the_devices_before_jax_starts(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    cpu = worker_env(WorkersConfig(devices_per_worker=4))
    assert cpu["JAX_PLATFORMS"] == "cpu"
    assert cpu["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    gpu = worker_env(WorkersConfig(accelerator="gpu"))
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
    assert worker_env(WorkersConfig(accelerator="gpu"))["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
    # Given explicitly (the driver's, passed to the Tune actor that builds the trainer), they win.
    assert worker_env(WorkersConfig(), "")["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"


# make_trainer's storage: the run folder's train/ by default; a folder every node mounts
# (storage: file://...) written in place, like train/; object storage staged (integration tests).
STORAGE_TRIAL = parse_trial({"model": {"workload": "mlp", "width": 8}, "train": {"steps": 2, "log_every": 1}})


def test_a_mounted_folder_is_written_in_place_and_holds_the_run_files(tmp_path):
    local = make_trainer(STORAGE_TRIAL, {}, storage_path=tmp_path / "train", name="t")
    assert local.run_config.storage_path == str(tmp_path / "train")
    assert local.train_loop_config["trial_uri"] is None
    assert local.train_loop_config["attempts_file"] == str(tmp_path / "train" / "t.attempts.json")
    shared = (tmp_path / "shared").as_uri()
    mounted = make_trainer(STORAGE_TRIAL, {}, storage_path=tmp_path / "train", name="t", storage_uri=shared)
    assert mounted.run_config.storage_path == str(tmp_path / "shared")
    assert mounted.train_loop_config["trial_uri"] is None  # no staging: every worker writes in place
    assert mounted.train_loop_config["attempts_file"] == f"{shared}/t.attempts.json"


def test_a_resumed_attempt_records_why_the_earlier_run_ended(tmp_path):
    from jaxray.raytrain.failures import read_record, record_driver_lost

    attempts, failures = tmp_path / "t.attempts.json", tmp_path / "t.failures.json"
    attempts.write_text('{"attempts": 1, "workers": [1]}')
    record_driver_lost(failures, attempts, "interrupted")
    record_driver_lost(failures, attempts)  # the first recorded cause of an attempt's end counts
    attempts.write_text('{"attempts": 2, "workers": [1, 1]}')
    record_driver_lost(failures, attempts, "interrupted")
    assert read_record(failures) == {"1": {"cause": "interrupted"}, "2": {"cause": "interrupted"}}


def test_the_accelerator_maps_to_ray_trains_scaling_config():
    from jaxray.raytrain.trainer import scaling_config

    cpu = scaling_config(WorkersConfig(num_workers=2))
    assert (cpu.use_gpu, cpu.use_tpu, cpu.resources_per_worker) == (False, False, {"CPU": 1})
    gpu = scaling_config(WorkersConfig(accelerator="gpu", devices_per_worker=2))
    assert (gpu.use_gpu, gpu.resources_per_worker) == (True, {"GPU": 2})
    tpu = scaling_config(
        WorkersConfig(accelerator="tpu", num_workers=4, devices_per_worker=4, topology="4x4",
                      accelerator_type="TPU-V5LITEPOD")
    )  # fmt: skip
    assert (tpu.use_tpu, tpu.topology, tpu.accelerator_type) == (True, "4x4", "TPU-V5LITEPOD")
    assert tpu.resources_per_worker == {"TPU": 4}
    assert "JAX_PLATFORMS" not in worker_env(WorkersConfig(accelerator="tpu"))


def test_a_scaling_ray_refuses_is_a_config_error_before_ray_starts():
    from jaxray.config import ConfigError
    from jaxray.raytrain.trainer import check_scaling

    slice_ = WorkersConfig(
        accelerator="tpu",
        num_workers=2,
        devices_per_worker=4,
        topology="4x4",
        accelerator_type="TPU-V5LITEPOD",
    )
    with pytest.raises(ConfigError, match="workers: Ray Train refuses this scaling: .*num_workers"):
        check_scaling(slice_)
    check_scaling(WorkersConfig(num_workers=2))
