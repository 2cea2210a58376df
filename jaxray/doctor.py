"""``python -m jaxray.doctor``: which devices JAX sees, why only the CPU if so, and how a batch shards.

Exits 0 whenever it ran (a diagnosis, not a gate). jax is imported inside functions, after
``--cpu-devices`` has set XLA_FLAGS."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata

import numpy as np

from jaxray.argtypes import cpu_device_count, cpu_xla_flags

ENV_VARS = ("XLA_FLAGS", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")
CUDA_PLUGINS = ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt")
ACCELERATORS = {"cuda", "gpu", "rocm", "tpu"}  # JAX_PLATFORMS entries that let JAX leave the CPU
SMI_TIMEOUT_S = 20  # a wedged driver can hang nvidia-smi; the doctor must still finish
GPU_INSTALL = "in a jaxray checkout: pip install -c constraints.txt -e '.[gpu]'"
ROWS_PER_DEVICE, FEATURES, HIDDEN = 8, 784, 256  # a Fashion-MNIST MLP's input batch and first weight


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the doctor checked: the only input of ``cpu_only_reason`` and the body of ``--json``."""

    backend: str | None = None  # jax.default_backend(); None when no backend started
    backend_error: str | None = None  # why jax.devices() raised, e.g. JAX_PLATFORMS=cuda without a GPU
    # {"id", "platform", "device_kind", "process_index", "memory_bytes"} of every process's devices;
    # memory_bytes: an accelerator's own (HBM on a TPU chip or GPU) as its allocator reports it, else None
    devices: tuple[dict, ...] = ()
    process_count: int = 1
    jax_version: str = ""
    jaxlib_version: str = ""
    cuda_plugins: dict = dataclasses.field(default_factory=dict)  # installed distribution -> version
    cuda_version: str | None = None  # CUDA runtime the plugin loads, e.g. "12.8"
    cudnn_version: str | None = None
    nvidia_smi: str = "missing (not on PATH)"  # or "ok", or "failed: <why>"
    driver_cuda_version: str | None = None  # nvidia-smi's "CUDA Version": the newest the driver runs
    topology: str = ""  # `nvidia-smi topo -m`, or why there is none
    env: dict = dataclasses.field(default_factory=dict)  # ENV_VARS -> value, None when unset


def cpu_only_reason(facts: Facts) -> str | None:
    """Why JAX has no accelerator device, from checked facts; None when it has one. Checked in fix
    order: platform choice, install, driver, visibility, versions."""
    if any(d["platform"] != "cpu" for d in facts.devices):
        return None
    forced = facts.env.get("JAX_PLATFORMS")
    if forced and not {p.strip().lower() for p in forced.split(",")} & ACCELERATORS:
        return f"JAX_PLATFORMS={forced} forces the CPU: unset it (or set JAX_PLATFORMS=cuda)"
    if not facts.cuda_plugins:
        return f"CPU-only jaxlib: install the CUDA plugin ({GPU_INSTALL})"
    stale = {name: v for name, v in facts.cuda_plugins.items() if v != facts.jaxlib_version}
    if stale:  # JAX warns "... is not compatible with the installed jaxlib version" and skips the plugin
        return (
            f"CUDA plugin {stale} does not match jaxlib {facts.jaxlib_version}: reinstall it ({GPU_INSTALL})"
        )
    if facts.nvidia_smi != "ok":
        return (
            f"driver not visible (nvidia-smi {facts.nvidia_smi}): container without GPU access "
            "(--gpus all / nvidia runtime) or driver not installed"
        )
    if facts.env.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={facts.env['CUDA_VISIBLE_DEVICES']!r} hides every GPU: unset it"
    plugin_cuda = facts.cuda_version or "/".join(facts.cuda_plugins)
    return (
        f"driver/CUDA mismatch: compare nvidia-smi's CUDA version ({facts.driver_cuda_version or 'unknown'}) "
        f"with the plugin's ({plugin_cuda}); the driver must support at least the plugin's CUDA"
    )


def _run_smi(*args: str) -> tuple[str, str]:
    """(status, stdout) of ``nvidia-smi *args``; status: "ok", "missing (not on PATH)", "failed: <why>"."""
    if shutil.which("nvidia-smi") is None:
        return "missing (not on PATH)", ""
    try:
        proc = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"failed: {e}", ""
    if proc.returncode != 0:
        why = (proc.stdout + proc.stderr).strip().splitlines() or [f"exit {proc.returncode}"]
        return f"failed: {why[-1]}", ""
    return "ok", proc.stdout


def _installed(names: Sequence[str]) -> dict[str, str]:
    """{distribution: version} for those of ``names`` that pip installed."""
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def _cuda_versions() -> tuple[str | None, str | None]:
    """(CUDA runtime, cuDNN) versions, e.g. ("12.8", "9.8.0"); None where unknown. Tries the CUDA
    plugin's private ``_versions`` module, then the NVIDIA pip wheels' versions."""
    for module in ("jax_cuda13_plugin._versions", "jax_cuda12_plugin._versions"):
        try:
            v = importlib.import_module(module)
            cuda, cudnn = v.cuda_runtime_get_version(), v.cudnn_get_version()  # e.g. 12080, 90800
        except Exception:  # absent, renamed, or CUDA libraries that fail to load
            continue
        major, rest = divmod(cudnn, 10000 if cudnn >= 90000 else 1000)  # cuDNN 9 changed the encoding
        return f"{cuda // 1000}.{cuda % 1000 // 10}", f"{major}.{rest // 100}.{rest % 100}"
    wheels = _installed(
        ("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime", "nvidia-cudnn-cu12", "nvidia-cudnn-cu13")
    )
    cuda = next((v for k, v in wheels.items() if "runtime" in k), None)
    return cuda, next((v for k, v in wheels.items() if "cudnn" in k), None)


def _memory(device) -> int | None:
    """An addressable accelerator's memory in bytes (``compile_report.device_memory``), else None."""
    import jax  # deferred, as in collect

    from jaxray.train.compile_report import device_memory  # imports jax: deferred as well

    if device.platform == "cpu" or device.process_index != jax.process_index():
        return None
    size, source = device_memory(device)
    return size if source == "device" else None


def collect() -> Facts:
    """Query jax, pip metadata, nvidia-smi and the environment. Imports jax."""
    # deferred: main sets XLA_FLAGS before jax loads
    import jax
    import jaxlib  # deferred with jax, which it loads

    try:
        devices = jax.devices()
        backend, error = jax.default_backend(), None
    except Exception as e:  # RuntimeError, or a bare AssertionError for JAX_PLATFORMS=cuda without a plugin
        devices, backend, error = [], None, f"{type(e).__name__}: {e}".rstrip(": ")
    smi, header = _run_smi()
    topo_status, topo = _run_smi("topo", "-m")
    driver_cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    cuda, cudnn = _cuda_versions()
    fields = ("id", "platform", "device_kind", "process_index")
    return Facts(
        backend=backend,
        backend_error=error,
        process_count=jax.process_count() if devices else 1,
        devices=tuple({**{k: getattr(d, k) for k in fields}, "memory_bytes": _memory(d)} for d in devices),
        jax_version=jax.__version__,
        jaxlib_version=jaxlib.__version__,
        cuda_plugins=_installed(CUDA_PLUGINS),
        cuda_version=cuda,
        cudnn_version=cudnn,
        nvidia_smi=smi,
        driver_cuda_version=driver_cuda.group(1) if driver_cuda else None,
        topology=topo if topo_status == "ok" else f"nvidia-smi {topo_status}",
        env={k: os.environ.get(k) for k in ENV_VARS},
    )


def print_facts(facts: Facts) -> None:
    """The human-readable report of ``facts``, with the reason when JAX found no accelerator."""
    print(f"backend:        {facts.backend or 'none: ' + str(facts.backend_error)}")
    print(f"devices:        {len(facts.devices)} over {facts.process_count} process(es)")
    for d in facts.devices:
        memory = f", {d['memory_bytes'] / 2**30:.2f} GiB" if d.get("memory_bytes") else ""
        print(f"  id {d['id']}: {d['platform']} {d['device_kind']!r} process {d['process_index']}{memory}")
    kinds = sorted({d["device_kind"] for d in facts.devices if d["platform"] == "tpu"})
    if kinds:
        print(f"TPU chips:      {sum(d['platform'] == 'tpu' for d in facts.devices)} ({', '.join(kinds)})")
    print(f"jax / jaxlib:   {facts.jax_version} / {facts.jaxlib_version}")
    print(f"CUDA plugins:   {facts.cuda_plugins or 'none'}")
    print(f"CUDA / cuDNN:   {facts.cuda_version or 'n/a'} / {facts.cudnn_version or 'n/a'}")
    driver = f" (driver runs CUDA <= {facts.driver_cuda_version})" if facts.driver_cuda_version else ""
    print(f"nvidia-smi:     {facts.nvidia_smi}{driver}")
    for key, value in facts.env.items():
        print(f"{key}={value if value is not None else '(unset)'}")
    reason = cpu_only_reason(facts)
    if reason:
        print(f"\nNo accelerator found. Likely reason: {reason}")
    print(f"\n$ nvidia-smi topo -m\n{facts.topology.rstrip()}")


def check_mesh(show: bool) -> dict:
    """Build the data mesh and place a batch and a weight on it; ``show`` prints how they shard."""
    import jax  # deferred: jax must not load before main has set XLA_FLAGS

    # deferred: imports jax
    from jaxray.parallel.mesh import batch_sharding, make_mesh, replicated, shard_batch

    mesh = make_mesh()
    rows = ROWS_PER_DEVICE * jax.local_device_count()  # this process's rows; shard_batch assembles the rest
    batch = shard_batch(mesh, {"x": np.zeros((rows, FEATURES), np.float32)})["x"]
    weight = jax.device_put(np.zeros((FEATURES, HIDDEN), np.float32), replicated(mesh))
    if show:  # visualize_array_sharding draws 1-D/2-D arrays only, which both are
        print(f"\nmesh: {mesh}")
        print(f"\nbatch {list(batch.shape)} float32, {batch_sharding(mesh).spec}:")
        jax.debug.visualize_array_sharding(batch)
        print(f"\nweight {list(weight.shape)} float32, {replicated(mesh).spec}:")
        jax.debug.visualize_array_sharding(weight)
    return {
        "mesh_shape": dict(mesh.shape),
        "batch_shape": list(batch.shape),
        "batch_shard_shape": list(batch.sharding.shard_shape(batch.shape)),
        "batch_spec": str(batch_sharding(mesh).spec),
        "weight_shape": list(weight.shape),
        "weight_shard_shape": list(weight.sharding.shard_shape(weight.shape)),
        "weight_spec": str(replicated(mesh).spec),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jaxray.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    parser.add_argument(
        "--cpu-devices",
        type=cpu_device_count,
        metavar="N",
        help="force N host (CPU) devices, to preview a multi-device mesh on a laptop",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_devices:  # the user's own XLA_FLAGS kept; must precede `import jax`
        os.environ["XLA_FLAGS"] = cpu_xla_flags(args.cpu_devices, os.environ.get("XLA_FLAGS", ""))
    facts = collect()
    if not args.json:
        print_facts(facts)
    # Mesh problems are findings to report, not reasons to crash the diagnosis.
    try:
        mesh = check_mesh(show=not args.json) if facts.devices else {}
    except Exception as e:
        mesh = {"mesh_error": f"{type(e).__name__}: {e}"}
        if not args.json:
            print(f"\nmesh failed: {mesh['mesh_error']}")
    if args.json:
        extra = {"device_count": len(facts.devices), "cpu_only_reason": cpu_only_reason(facts)}
        print(json.dumps(dataclasses.asdict(facts) | extra | mesh))
    return 0


if __name__ == "__main__":
    sys.exit(main())
