"""cluster/README.md's local flow: cluster/local-up.sh, `ray job submit --runtime-env
cluster/runtime_env.yaml` of the smoke sweep (token auth), cluster/local-down.sh. The job SUCCEEDED,
and after local-down.sh no process of that head is alive and its ports are free. The head gets free
ports and its own pid file (runs/ray-head-<dashboard port>.pid), so no other Ray on the machine is
touched. local-up.sh returns only once the job API can take a job."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest
from ray_head import BIN, ROOT, clean_up, free_port, head_ports, run_script, started_head, submit_smoke

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


@pytest.fixture
def local_head():
    """(dashboard address, env, pgid, ports) of a head from local-up.sh; local-down.sh on the way out
    if the test did not run it."""
    with started_head() as head:
        yield head


def test_a_job_is_taken_as_soon_as_local_up_returns(local_head):
    # Before local-up.sh waited for the job agent, a submission right away could fail with "No
    # available agent to submit job".
    address, env, _, _ = local_head
    proc = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", address, "--", "python", "-c", "print('taken')"],
        cwd=ROOT,
        env={**env, "RAY_AUTH_MODE": "token"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "taken" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-2000:])


def test_local_up_says_so_when_the_job_agent_never_answers():
    # The agent's port is taken, so the agent never comes up: local-up.sh must not return as if
    # the head could take jobs, and must say what it waited for.
    dashboard, gcs = free_port(), free_port()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        env, args = head_ports(dashboard, gcs, agent=taken.getsockname()[1])
        try:
            up = run_script("local-up.sh", {**env, "LOCAL_UP_TIMEOUT_S": "45"}, *args)
            assert up.returncode != 0, up.stdout[-2000:]
            assert "job agent was not ready within 45 s" in up.stderr or "ray start exited" in up.stderr, (
                up.stderr[-4000:]
            )
        finally:
            clean_up(env, dashboard, gcs)


def test_local_up_submit_local_down(local_head, real_dir, tmp_path):
    address, env, pgid, ports = local_head
    submit_smoke(address, env, ["--runtime-env", "cluster/runtime_env.yaml"], real_dir, tmp_path / "out")
    assert head_processes(pgid, ports[1]), "found no process of the head"
    down = run_script("local-down.sh", env)
    assert down.returncode == 0, (down.stdout, down.stderr)
    assert not (left := head_processes(pgid, ports[1])), f"outlived local-down.sh: {left}"
    assert all(port_free(p) for p in ports)
