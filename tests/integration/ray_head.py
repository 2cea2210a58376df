"""Helpers for the tests that start their own Ray heads with cluster/local-up.sh and submit sweeps to
them with `ray job submit` (test_local_head.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from private_ray import free_port

from jaxray.raytrain.cluster import ray_address_file
from jaxray.runs import run_folders

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's bin/: its `ray` and `python`


def wait_for(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError as err:
            if getattr(err, "code", None):  # an HTTP error (401 without a token) means it is up
                return
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {seconds} s")


def head_env() -> dict[str, str]:
    """This process's environment with the venv first on PATH, without RAY_ADDRESS (the job must go
    to the test's head) and JAXRAY_DATA_DIR (the README's flow passes --data-dir instead). The head
    stops without Ray's drain on SIGTERM, which after a job waits out its 30 s timeout."""
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    }
    for name in ("RAY_ADDRESS", "JAXRAY_DATA_DIR"):
        env.pop(name, None)
    return env


def forget_cluster(gcs_port: int) -> None:
    """Remove the address file our head left behind (only if it is ours), so no later `ray.init`
    tries to join the cluster this test just stopped."""
    marker = ray_address_file()
    if marker.is_file() and marker.read_text().strip().endswith(f":{gcs_port}"):
        marker.unlink()


def run_script(name: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / "cluster" / name), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def head_ports(dashboard: int, gcs: int, agent: int | None = None) -> tuple[dict[str, str], list[str]]:
    """(env, `ray start` arguments) of a head of local-up.sh on free ports of its own."""
    env = {**head_env(), "RAY_DASHBOARD_PORT": str(dashboard), "VENV": str(BIN.parent)}
    return env, [
        f"--port={gcs}",
        "--num-cpus=4",
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={agent or free_port()}",
        f"--metrics-export-port={free_port()}",
    ]


def clean_up(env: dict[str, str], dashboard: int, gcs: int) -> None:
    """local-down.sh if the head still has its pid file; then its log and its own Ray temp folder
    (local-up.sh's `ray-<dashboard port>` beside Ray's default one: session logs) go too."""
    pid_file = ROOT / "runs" / f"ray-head-{dashboard}.pid"
    if pid_file.exists():
        run_script("local-down.sh", env)
    forget_cluster(gcs)
    pid_file.with_suffix(".log").unlink(missing_ok=True)
    shutil.rmtree(ray_address_file().parent.with_name(f"ray-{dashboard}"), ignore_errors=True)


@contextlib.contextmanager
def started_head() -> Iterator[tuple[str, dict[str, str], int, tuple[int, int]]]:
    """(dashboard address, env, pgid, (dashboard port, GCS port)) of a head from local-up.sh on
    free ports; cleaned up on the way out (``clean_up``)."""
    dashboard, gcs = free_port(), free_port()
    env, args = head_ports(dashboard, gcs)
    up = run_script("local-up.sh", env, *args)
    try:
        assert up.returncode == 0, (up.stdout[-2000:], up.stderr[-4000:])
        pid_file = ROOT / "runs" / f"ray-head-{dashboard}.pid"
        assert (ROOT / "runs" / f"ray-head-{dashboard}.tempdir").read_text().strip() == str(
            ray_address_file().parent.with_name(f"ray-{dashboard}")
        )
        yield f"http://127.0.0.1:{dashboard}", env, int(pid_file.read_text()), (dashboard, gcs)
    finally:
        clean_up(env, dashboard, gcs)


def submit_sweep(
    address: str,
    env: dict[str, str],
    data_dir: Path,
    out: Path,
    config: str = "tune_configs/smoke.yaml",
    trials: int = 3,
) -> str:
    """`ray job submit --runtime-env cluster/runtime_env.yaml` (token auth) of ``python -m jaxray.tune
    --config config`` to ``address``, from the repository root. Checks that the job SUCCEEDED and
    wrote ``trials`` trial rows without errors; returns the job's output (`ray job submit` follows
    the driver's log)."""
    proc = subprocess.run(
        [
            str(BIN / "ray"),
            "job",
            "submit",
            "--address",
            address,
            "--runtime-env",
            "cluster/runtime_env.yaml",
            "--",
            "python",
            "-m",
            "jaxray.tune",
            "--config",
            config,
            "--data-dir",
            str(data_dir),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env={**env, "RAY_AUTH_MODE": "token"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-2000:])
    succeeded = re.search(r"Job '(\S+)' succeeded", proc.stdout)  # printed only for JobStatus.SUCCEEDED
    assert succeeded, proc.stdout[-4000:]
    rows = json.loads((run_folders(out)[0] / "summary.json").read_text())
    assert len(rows) == trials and not any(r.get("error") for r in rows)
    return proc.stdout
