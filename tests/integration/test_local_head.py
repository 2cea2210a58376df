"""cluster/README.md's local flow: cluster/local-up.sh, `ray job submit --runtime-env
cluster/runtime_env.yaml` of a sweep (token auth) as soon as local-up.sh returns, cluster/local-down.sh.
Two heads run on one machine at once, each on free ports of its own with its own pid file
(runs/ray-head-<dashboard port>.pid) and Ray temp folder: a one-trial sweep submitted to each at the
same time SUCCEEDS on both, and each job's driver joined the head it was submitted to (with one
shared temp folder, Ray's job supervisor gave a job the address of the latest head started on the
machine). local-down.sh of one head leaves no process of it alive and its
ports free, and the other head running."""

from __future__ import annotations

import re
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from ray_head import clean_up, free_port, head_ports, run_script, started_head, submit_sweep

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


def test_local_up_says_so_when_the_job_agent_never_answers():
    # The agent's port is taken, so the agent never comes up: local-up.sh must not return as if
    # the head could take jobs, and must say what it waited for.
    dashboard, gcs = free_port(), free_port()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        env, args = head_ports(dashboard, gcs, agent=taken.getsockname()[1])
        try:
            # The agent's wait is the test's (10 s from the dashboard's first answer); the head's own
            # start keeps its default (180 s), however loaded the machine.
            up = run_script("local-up.sh", {**env, "LOCAL_UP_AGENT_TIMEOUT_S": "10"}, *args)
            assert up.returncode != 0, up.stdout[-2000:]
            assert "job agent was not ready 10 s later" in up.stderr or "ray start exited" in up.stderr, (
                up.stderr[-4000:]
            )
        finally:
            clean_up(env, dashboard, gcs)


# One MLP trial of smoke.yaml's sizes, each head's job (smoke.yaml: test_tune_smoke.py).
ONE_TRIAL = """
experiment: one_trial
workers: {num_workers: 1, devices_per_worker: 1}
sweeps:
  - workload: mlp
    train: {steps: 10, log_every: 5}
    search_space: {global_batch: [128], width: [64]}
"""


def test_two_heads_take_jobs_at_once_and_local_down_ends_only_its_own(real_dir, tmp_path):
    config = tmp_path / "one_trial.yaml"
    config.write_text(ONE_TRIAL)
    with started_head() as first, started_head() as second:
        jobs = {"first": (first, str(config), 1), "second": (second, str(config), 1)}
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = {
                name: pool.submit(submit_sweep, head[0], head[1], real_dir, tmp_path / name, config_, n)
                for name, (head, config_, n) in jobs.items()
            }
            logs = {name: future.result() for name, future in futures.items()}
        for name, ((_, _, _, (_, gcs_port)), _, _) in jobs.items():
            joined = re.findall(r"jaxray: joined the Ray cluster at \S+:(\d+)", logs[name])
            assert joined == [str(gcs_port)], (name, gcs_port, logs[name][-3000:])

        (_, env, pgid, ports), (_, _, other_pgid, other_ports) = first, second
        assert head_processes(pgid, ports[1]), "found no process of the first head"
        down = run_script("local-down.sh", env)
        assert down.returncode == 0, (down.stdout, down.stderr)
        assert not (left := head_processes(pgid, ports[1])), f"outlived local-down.sh: {left}"
        assert all(port_free(p) for p in ports)
        assert head_processes(other_pgid, other_ports[1]), "local-down.sh of one head ended the other"
