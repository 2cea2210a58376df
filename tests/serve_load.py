"""What the Serve tests share (imported by tests/integration/test_serve*.py): Serve on a private
local Ray, ``python -m jaxray.serve`` started as a user starts it, the replica processes
found by title, 16 closed-loop clients of the real load client, and ``/healthz`` read without
raising."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import psutil
import ray
import requests
from private_ray import free_port, init_private_ray
from ray import serve

from jaxray.bench.load import Sample, send

STOP_S = 10.0  # python -m jaxray.serve stops its app, and Ray, within this after SIGINT or SIGTERM
REPLICA_TITLE = "ServeReplica:jaxray:JaxrayServer"  # in the replica process's title
# Quick to compile: 4 programs (a start, a decode, two gathers), where the defaults' 3 batch sizes and
# prefix cache took 19 (tests/serve/test_app.py and tests/inference cover those).
SMALL_ENGINE = ["--buckets", "16", "--batch-sizes", "4", "--chunk", "8", "--prefix-cache-mib", "0"]


@contextmanager
def private_serve(env: dict[str, str] | None = None, **http_options) -> Iterator[str]:
    """Serve's proxy on a private local Ray (2 CPUs) at 127.0.0.1 and a free port, with more
    ``http_options``; ``env`` is set for the processes ray.init starts and removed after. Yields
    the proxy's URL; shuts Serve and Ray down at the end."""
    os.environ.update(env or {})
    init_private_ray(num_cpus=2)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port, **http_options})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        for name in env or {}:
            os.environ.pop(name)


def start_serving(checkpoint: Path, port: int, options: list[str] = SMALL_ENGINE) -> subprocess.Popen:
    """``python -m jaxray.serve --checkpoint checkpoint --port port *options`` on a private Ray, in
    its own process group (the test's Ctrl-C is not its Ctrl-C), stdout and stderr merged; returns
    once it printed that it is serving (its output so far in ``proc.lines``), else fails."""
    argv = [sys.executable, "-m", "jaxray.serve", "--checkpoint", str(checkpoint), "--port", str(port)]
    proc = subprocess.Popen(
        [*argv, *options],
        env={**os.environ, "RAY_ADDRESS": "local"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    proc.lines = []
    for line in proc.stdout:
        proc.lines.append(line)
        if line.startswith("jaxray is serving on"):
            return proc
    proc.kill()
    raise AssertionError("python -m jaxray.serve ended before serving:\n" + "".join(proc.lines[-40:]))


def replica_pids(title: str = REPLICA_TITLE, under: int | None = None) -> list[int]:
    """The pids of the descendants of ``under`` (default: this process) whose command line holds
    ``title``: the replicas of the Ray that process started, not those of a test running beside it."""
    procs = psutil.Process(under or os.getpid()).children(recursive=True)
    found = []
    for proc in procs:
        try:
            if title in " ".join(proc.cmdline()):
                found.append(proc.pid)
        except psutil.Error:  # ended meanwhile, or not ours to read
            continue
    return found


async def load(
    url: str,
    clients: int,
    stop: threading.Event,
    timeout_s: float,
    last: Callable[[Sample], bool] = lambda _: False,
) -> list[Sample]:
    """``clients`` closed-loop clients of the real load client (jaxray.bench.load.send, each
    request timing out after ``timeout_s``) until ``stop`` is set; a client whose answer is
    ``last`` sends no more and sets ``stop``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=clients)
    samples: list[Sample] = []

    async def client(i: int) -> None:
        k = 0
        while not stop.is_set():
            body = {"prompt": "ROMEO:", "max_new_tokens": 48, "temperature": 0.8, "seed": i * 1000 + k}
            samples.append(sample := await send(session, url, body, stream=False))
            if last(sample):
                stop.set()
            k += 1

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client(i) for i in range(clients)))
    return samples


def healthz(url: str, timeout_s: float) -> tuple[int, dict]:
    """(status, body) of ``/healthz``; (0, {}) when nothing listens, {} for a body that is not
    JSON (Serve's proxy answers in plain text while no replica can)."""
    try:
        response = requests.get(url + "/healthz", timeout=timeout_s)
    except requests.ConnectionError:
        return 0, {}
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, {}


def stopped_by(proc, send) -> str:
    """``send()`` a stop to the serving ``proc``; checks that it exits 0 saying "stopping" within
    ``STOP_S`` and that Ray's processes went with it. Returns its output from then on."""
    tree = psutil.Process(proc.pid).children(recursive=True)
    start = time.monotonic()
    send()
    rest, _ = proc.communicate(timeout=60)
    stopped = time.monotonic() - start
    assert proc.returncode == 0 and "stopping" in rest, rest[-3000:]
    assert stopped < STOP_S, f"took {stopped:.1f} s to stop the app:\n{rest[-3000:]}"
    _, alive = psutil.wait_procs(tree, timeout=10)
    left = []
    for p in alive:  # named, then not left behind for the next test
        with contextlib.suppress(psutil.NoSuchProcess):
            left.append(p.name())
            p.kill()
    assert not left, left  # Ray's processes went with it
    return rest
