"""The README's cluster flow: `ray start --head` from the venv, then `ray job submit` of the smoke sweep
with token auth (Ray 2.60). Starts its own head on free ports and ends only the processes it started."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.fixture
def head(real_dir, tmp_path):
    dashboard, gcs = free_port(), free_port()
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    for name in ("RAY_ADDRESS", "JAXRAY_DATA_DIR"):  # the README's flow passes --data-dir instead
        env.pop(name, None)
    cmd = [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=4",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--ray-client-server-port={free_port()}",
           f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
           "--disable-usage-stats"]
    proc = subprocess.Popen(cmd, env=env, stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_for(f"http://127.0.0.1:{dashboard}/api/version", 120)
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        forget_cluster(gcs)


def forget_cluster(gcs_port: int) -> None:
    """Remove the address file our head left behind (only if it is ours), so no later `ray.init`
    tries to join the cluster this test just stopped."""
    marker = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    if marker.is_file() and marker.read_text().strip().endswith(f":{gcs_port}"):
        marker.unlink()


def test_job_submit_runs_the_smoke_sweep(head, tmp_path, real_dir):
    address, env = head
    out = tmp_path / "out"
    proc = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
                           "python", "-m", "jaxray.tune", "--config", "tune_configs/smoke.yaml",
                           "--data-dir", str(real_dir), "--out", str(out)],
                          env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-2000:])
    assert "succeeded" in proc.stdout
    rows = json.loads((out / "summary.json").read_text())
    assert len(rows) == 3 and not any(r.get("error") for r in rows)
