"""``python -m jaxray.serve`` on a private Ray, one run through its life, on the transformer trained
on real TinyShakespeare bytes by ``tests/conftest.py``: the terminal names the checkpoint and prints
the ready line (URL, compile time, routes) without Serve's "Connecting to existing Serve app" line;
when its replica is killed, Serve starts a replacement and the command goes on serving; Ctrl-C
(SIGINT to its whole process group, as a terminal sends it) ends the app, its private Ray included,
within 10 s, with exit status 0 (SIGTERM to the command alone, as kill or docker stop send it:
test_object_storage.py's server)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import aiohttp
import pytest
import requests
from serve_load import free_port, healthz, load, replica_pids, start_serving, stopped_by

from jaxray.reporting import checkpoint_line
from jaxray.serve.routes import ROUTES

pytestmark = [pytest.mark.ray, pytest.mark.slow]
CLIENT_TIMEOUT_S = 90.0  # past the proxy's 60 s request time-out: a request open this long hangs


def wait_for_a_new_replica(url: str, proc, before: dict) -> None:
    """Until /healthz answers 200 from a replica other than ``before["replica"]`` (180 s at most)."""
    deadline = time.monotonic() + 180
    status, after = healthz(url, CLIENT_TIMEOUT_S)
    while not (status == 200 and after.get("replica") not in (None, before["replica"])):
        assert proc.poll() is None, "".join(proc.lines) + proc.stdout.read()
        assert time.monotonic() < deadline, f"no new replica within 180 s: {status} {after}"
        time.sleep(1)
        status, after = healthz(url, CLIENT_TIMEOUT_S)


def test_ready_line_then_a_replaced_replica_then_ctrl_c(trained_transformer):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serving(trained_transformer, port)  # returns once the ready line came
    try:
        info = requests.get(f"{url}/info", timeout=30).json()
        lines = [line.rstrip("\n") for line in proc.lines]
        text = "\n".join(lines)
        assert lines[-1].startswith(f"jaxray is serving on {url} ("), text
        assert f"compiled in {info['compile_s']:.1f} s) routes: {ROUTES}" in lines[-1]
        assert checkpoint_line.describe(trained_transformer) in lines, text
        assert "Connecting to existing Serve app" not in text and "Started a local Ray" not in text
        assert "block_repeats" not in info["model"] and info["model"]["max_seq_len"] == 64

        _, before = healthz(url, CLIENT_TIMEOUT_S)
        [pid] = replica_pids(under=proc.pid)
        os.kill(pid, signal.SIGKILL)
        wait_for_a_new_replica(url, proc, before)
        samples = asyncio.run(load(url, 2, threading.Event(), CLIENT_TIMEOUT_S, lambda _: True))
        assert samples and {s.outcome for s in samples} == {"ok"}, [s.error for s in samples]
        assert proc.poll() is None
        read = asyncio.run(leave_mid_stream(url, 8))
        assert all(read) and max(read) > 2, read  # the others read their streams to the end
        time.sleep(2)  # Ray forwards the replica's log lines to the command's output

        rest = stopped_by(proc, lambda: os.killpg(proc.pid, signal.SIGINT))  # as a terminal's Ctrl-C
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Connecting to existing Serve app" not in rest
    # Clients that left mid-stream left no orphaned future of Serve's batching behind.
    assert "StopAsyncIteration" not in rest, rest[-3000:]


async def leave_mid_stream(url: str, clients: int) -> list[int]:
    """``clients`` /generate streams at once (batched together); the even ones close their
    connection after the first event. Returns the events each one read."""

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        body = {"prompt": "ROMEO:", "max_new_tokens": 64, "temperature": 0.8, "seed": i, "stream": True}
        async with session.post(f"{url}/generate", json=body) as reply:
            seen = 0
            async for line in reply.content:
                seen += line.startswith(b"data:")
                if seen and i % 2 == 0:
                    break
            return seen

    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(one(session, i) for i in range(clients)))
