"""cluster/README.md's local flow: cluster/local-up.sh, `ray job submit --runtime-env
cluster/runtime_env.yaml` of the smoke sweep (token auth), cluster/local-down.sh. The job SUCCEEDED,
and after local-down.sh no process of that head is alive and its ports are free. The head gets free
ports and its own pid file (runs/ray-head-<dashboard port>.pid), so no other Ray on the machine is
touched."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest
from ray_head import BIN, ROOT, forget_cluster, free_port, head_env, submit_smoke

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def head_processes(pgid: int, gcs_port: int) -> dict[int, str]:
    """pid -> command line of every live process in the head's process group or pointed at its GCS
    (raylet and workers carry ``--gcs-address=IP:port``)."""
    gcs = re.compile(rf"gcs[-_]address[= ]\S*:{gcs_port}\b")
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended while we looked
            continue
        state, group = stat[0], int(stat[2])
        if state != "Z" and (group == pgid or gcs.search(cmdline)):
            found[int(proc.name)] = cmdline[:200]
    return found


def port_free(port: int) -> bool:
    """Whether nothing listens on ``port`` on any address (SO_REUSEADDR: TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def run_script(name: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / "cluster" / name), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def local_head():
    """(dashboard address, env, pgid, ports) of a head from local-up.sh; local-down.sh on the way out
    if the test did not run it."""
    dashboard, gcs = free_port(), free_port()
    env = {**head_env(), "RAY_DASHBOARD_PORT": str(dashboard), "VENV": str(BIN.parent)}
    pid_file = ROOT / "runs" / f"ray-head-{dashboard}.pid"
    up = run_script(
        "local-up.sh",
        env,
        f"--port={gcs}",
        "--num-cpus=4",
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--metrics-export-port={free_port()}",
    )
    try:
        assert up.returncode == 0, (up.stdout[-2000:], up.stderr[-4000:])
        yield f"http://127.0.0.1:{dashboard}", env, int(pid_file.read_text()), (dashboard, gcs)
    finally:
        if pid_file.exists():
            run_script("local-down.sh", env)
        forget_cluster(gcs)
        pid_file.with_suffix(".log").unlink(missing_ok=True)


def test_local_up_submit_local_down(local_head, real_dir, tmp_path):
    address, env, pgid, ports = local_head
    submit_smoke(address, env, ["--runtime-env", "cluster/runtime_env.yaml"], real_dir, tmp_path / "out")
    assert head_processes(pgid, ports[1]), "found no process of the head"
    down = run_script("local-down.sh", env)
    assert down.returncode == 0, (down.stdout, down.stderr)
    assert not (left := head_processes(pgid, ports[1])), f"outlived local-down.sh: {left}"
    assert all(port_free(p) for p in ports)
