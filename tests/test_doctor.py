"""jaxray.doctor: the CPU-only reason from facts (no GPU needed) and the CLI on 4 forced CPU devices."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from jaxray import doctor
from jaxray.doctor import Facts, cpu_only_reason

CPU = ({"id": 0, "platform": "cpu", "device_kind": "cpu", "process_index": 0},)
GPU = ({"id": 0, "platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3", "process_index": 0},)
PLUGIN = {"jax-cuda12-plugin": "0.10.2", "jax-cuda12-pjrt": "0.10.2"}


def facts(**changes) -> Facts:
    """CPU-only facts where every check passes (plugin matches, driver visible); tests break one."""
    base = Facts(
        backend="cpu",
        devices=CPU,
        jaxlib_version="0.10.2",
        cuda_plugins=PLUGIN,
        cuda_version="12.8",
        nvidia_smi="ok",
        driver_cuda_version="12.2",
        env={"JAX_PLATFORMS": None},
    )
    return dataclasses.replace(base, **changes)


def test_no_reason_with_an_accelerator():
    assert cpu_only_reason(facts(devices=CPU + GPU, cuda_plugins={})) is None


@pytest.mark.parametrize("platforms", ["cpu", "CPU", " cpu "])
def test_jax_platforms_forcing_cpu(platforms):
    assert cpu_only_reason(facts(env={"JAX_PLATFORMS": platforms})).startswith(
        f"JAX_PLATFORMS={platforms} forces"
    )


def test_jax_platforms_allowing_cuda_is_not_the_reason():
    assert "JAX_PLATFORMS" not in cpu_only_reason(facts(env={"JAX_PLATFORMS": "cuda,cpu"}))


def test_no_plugin_is_a_cpu_only_jaxlib():
    assert cpu_only_reason(facts(cuda_plugins={})).startswith("CPU-only jaxlib: install the CUDA plugin")


def test_no_plugin_when_the_cuda_backend_failed_to_start():
    f = facts(
        backend=None,
        backend_error="AssertionError",
        devices=(),
        cuda_plugins={},
        env={"JAX_PLATFORMS": "cuda"},
    )
    assert cpu_only_reason(f).startswith("CPU-only jaxlib")


def test_plugin_not_matching_jaxlib():
    reason = cpu_only_reason(facts(cuda_plugins={"jax-cuda12-plugin": "0.9.2"}))
    assert "0.9.2" in reason and "jaxlib 0.10.2" in reason


@pytest.mark.parametrize("smi", ["missing (not on PATH)", "failed: NVIDIA-SMI has failed"])
def test_driver_not_visible(smi):
    reason = cpu_only_reason(facts(nvidia_smi=smi))
    assert reason.startswith("driver not visible") and "--gpus all" in reason and smi in reason


@pytest.mark.parametrize("visible", ["", "-1"])
def test_cuda_visible_devices_hiding_every_gpu(visible):
    assert "hides every GPU" in cpu_only_reason(facts(env={"CUDA_VISIBLE_DEVICES": visible}))


def test_driver_cuda_mismatch_names_both_versions():
    reason = cpu_only_reason(facts())
    assert reason.startswith("driver/CUDA mismatch") and "(12.2)" in reason and "(12.8)" in reason


def test_nvidia_smi_missing_failing_or_hanging(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert doctor._run_smi() == ("missing (not on PATH)", "")
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed'\nexit 9\n")
    smi.chmod(0o755)
    assert doctor._run_smi("topo", "-m") == ("failed: NVIDIA-SMI has failed", "")
    smi.write_text("#!/bin/sh\nsleep 5\n")
    monkeypatch.setattr(doctor, "SMI_TIMEOUT_S", 0.2)
    assert doctor._run_smi()[0].startswith("failed: ")


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        doctor.parse_args(["--cpu-devices", "0"])
    assert e.value.code == 2


def run_doctor(*args: str) -> subprocess.CompletedProcess:
    """``python -m jaxray.doctor --cpu-devices 4 *args`` on the CPU backend, without the caller's
    XLA_FLAGS."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxray.doctor", "--cpu-devices", "4", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_cli_shows_four_devices_and_the_sharding():
    out = run_doctor().stdout
    assert "devices:        4 over 1 process(es)" in out
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=4" in out
    assert "mesh: Mesh('data': 4" in out
    assert "batch [32, 784] float32" in out and all(f"CPU {i}" in out for i in range(4))  # one row block each
    assert "weight [784, 256] float32" in out and "CPU 0,1,2,3" in out  # replicated: one block, all devices


def test_cli_json():
    report = json.loads(run_doctor("--json").stdout)
    assert report["device_count"] == 4 and report["backend"] == "cpu"
    assert report["mesh_shape"] == {"data": 4, "fsdp": 1, "tensor": 1} and report["batch_shard_shape"] == [
        8,
        784,
    ]
    assert report["weight_shard_shape"] == [784, 256] and report["weight_spec"] == "P()"
    assert report["cpu_only_reason"].startswith("JAX_PLATFORMS=cpu forces")
