"""``python -m jaxray.serve`` when its replica is killed: Serve starts a replacement and the command
goes on serving."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
from serve_load import free_port, healthz, load, replica_pids, start_serving

pytestmark = [pytest.mark.ray, pytest.mark.slow]
EXIT_S = 30.0  # from the kill to the command's exit (issue 15: "exits non-zero in under 30 s")
CLIENTS = 8
CLIENT_TIMEOUT_S = 90.0  # past the proxy's 60 s request time-out: a request open this long hangs
FAILED = "the app failed"  # the 503 of a request that waited for the replica that never came


def test_a_replica_replaced_normally_leaves_the_command_serving(trained_transformer):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serving(trained_transformer, port)
    try:
        _, before = healthz(url, CLIENT_TIMEOUT_S)
        [pid] = replica_pids(under=proc.pid)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 180
        status, after = healthz(url, CLIENT_TIMEOUT_S)
        while not (status == 200 and after.get("replica") not in (None, before["replica"])):
            assert proc.poll() is None, "".join(proc.lines) + proc.stdout.read()
            assert time.monotonic() < deadline, f"no new replica within 180 s: {status} {after}"
            time.sleep(1)
            status, after = healthz(url, CLIENT_TIMEOUT_S)
        samples = asyncio.run(load(url, 2, threading.Event(), CLIENT_TIMEOUT_S, lambda _: True))
        assert samples and {s.outcome for s in samples} == {"ok"}, [s.error for s in samples]
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, ("".join(proc.lines) + rest)[-4000:]
