"""``python -m jaxray.serve`` stops fast: Ctrl-C (SIGINT to its whole process group, as a terminal
sends it) ends a serving app, its private Ray included, within 10 s, with exit status 0."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import requests
from serve_load import free_port, start_serving

pytestmark = [pytest.mark.ray, pytest.mark.slow]
STOP_S = 10.0


def test_ctrl_c_stops_the_app_and_its_ray_within_10_s(trained_transformer):
    sig = signal.SIGINT
    port = free_port()
    proc = start_serving(trained_transformer, port)
    try:
        assert requests.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json()["status"] == "ok"
        tree = psutil.Process(proc.pid).children(recursive=True)
        start = time.monotonic()
        os.killpg(proc.pid, sig)  # as a terminal's Ctrl-C: every process of the group gets it
        rest, _ = proc.communicate(timeout=60)
        stopped = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"{sig.name}: exit {proc.returncode} after {stopped:.1f} s")
    assert proc.returncode == 0 and "stopping" in rest, rest[-3000:]
    assert stopped < STOP_S, f"{sig.name} took {stopped:.1f} s to stop the app:\n{rest[-3000:]}"
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, [p.cmdline() for p in alive]  # Ray's processes went with it
