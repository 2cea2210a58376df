"""The ``python -m jaxray.serve`` process that ``python -m jaxray.bench serve`` measures: its command
line and environment, starting it in a process group of its own, waiting for ``/healthz``, and
stopping it and every process it started (Ray's included) so that nothing outlives the run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

HOST = "127.0.0.1"
STOP_GRACE_S = 30.0  # Serve and Ray get this long to shut down on SIGINT before they are signalled
# bench serve's options that go on to python -m jaxray.serve, each only when given
SERVER_OPTIONS = ("max_batch_size", "batch_wait_ms", "batch_sizes", "chunk", "num_gpus")


def port_in_use(host: str, port: int) -> bool:
    """True when something accepts TCP connections on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def check_port(port: int) -> None:
    """Raise ValueError when something already listens on HOST:port: the run would measure it."""
    if port_in_use(HOST, port):
        raise ValueError(
            f"--port {port}: something already listens on {HOST}:{port}; pass --url to measure "
            "an app that is already running, or another --port"
        )


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """True when ``GET url/healthz`` answers 200 within ``timeout_s`` seconds."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/healthz", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_until_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> float:
    """Poll ``url/healthz`` until it answers 200; returns the seconds it took. Raises RuntimeError
    (with the end of the server's log) when the server exits first or ``timeout_s`` passes."""
    start = time.monotonic()
    while not healthy(url):
        if proc.poll() is not None:
            raise RuntimeError(
                f"python -m jaxray.serve exited with code {proc.returncode} before /healthz "
                f"answered; the end of {log}:\n{_log_tail(log)}"
            )
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(
                f"{url}/healthz did not answer 200 within {timeout_s:.0f} s (raise "
                f"--startup-timeout?); the end of {log}:\n{_log_tail(log)}"
            )
        time.sleep(0.5)
    return time.monotonic() - start


def _group_members(pgid: int) -> list[psutil.Process]:
    """The live processes of process group ``pgid``."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):  # exited while we looked
            continue
    return members


def _left(proc: subprocess.Popen, tree: list[psutil.Process]) -> list[psutil.Process]:
    """What is still running of the server: its process group and the processes it started
    (Ray's workers run in process groups of their own, so the group alone misses them)."""
    proc.poll()  # reaps the leader once it exited: a zombie leader would count as running
    alive = {p.pid: p for p in _group_members(proc.pid)}
    for p in tree:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.setdefault(p.pid, p)
        except psutil.Error:
            continue
    return list(alive.values())


def _wait_left(proc: subprocess.Popen, tree: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    """Wait up to ``seconds`` for the server's processes to go; returns those still running."""
    deadline = time.monotonic() + seconds
    while (left := _left(proc, tree)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _signal(processes: list[psutil.Process], sig: signal.Signals) -> None:
    for p in processes:
        try:
            p.send_signal(sig)
        except psutil.Error:  # gone meanwhile
            continue


def stop_server(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> str:
    """Stop the server ``proc`` and everything it started, then check nothing is left.

    First SIGINT to the server alone, as Ctrl-C: it removes the app and shuts down the Ray it
    started. What is left after ``grace_s`` seconds (its process group, and every descendant seen
    before the stop) gets SIGTERM, then SIGKILL 10 s later. Returns how it ended, for the notes;
    it names the processes still running if any survived even SIGKILL."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    if not (left := _wait_left(proc, tree, grace_s)):
        return "the server and every process it started exited on SIGINT (as Ctrl-C)"
    how = f"{len(left)} processes were still running {grace_s:.0f} s after SIGINT: sent SIGTERM"
    _signal(left, signal.SIGTERM)
    if left := _wait_left(proc, tree, 10.0):
        how += f", then SIGKILL to {len(left)}"
        _signal(left, signal.SIGKILL)
        left = _wait_left(proc, tree, 10.0)
    proc.wait()
    if left:
        names = ", ".join(f"{p.pid} {_name(p)}" for p in left)
        return f"{how}; STILL RUNNING: {names}"
    return f"{how}; none is left"


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"


def serve_command(checkpoint: str, port: int, options: dict) -> list[str]:
    """The ``python -m jaxray.serve`` command line; ``options`` maps SERVER_OPTIONS to values
    (None: the server's default)."""
    cmd = [
        sys.executable,
        "-m",
        "jaxray.serve",
        "--checkpoint",
        checkpoint,
        "--host",
        HOST,
        "--port",
        str(port),
    ]
    for name in SERVER_OPTIONS:
        value = options.get(name)
        if value is not None:
            text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
            cmd += [f"--{name.replace('_', '-')}", text]
    return cmd


def _default_sigint() -> None:
    """In the server's process before exec: SIGINT back to its default. A command started in the
    background by a script inherits SIGINT ignored, and Python then never raises KeyboardInterrupt,
    so the Ctrl-C shut-down ``stop_server`` asks for first would not happen. It may also inherit
    SIGINT blocked (a blocked signal stays blocked across exec), so it is unblocked too."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def server_env() -> dict[str, str]:
    """The server's environment: RAY_ADDRESS=local, so it starts a Ray of its own even when a ``ray
    start`` cluster runs here (the app measured is exactly the one started, and stopping it stops
    all of it)."""
    return {**os.environ, "RAY_ADDRESS": "local"}


def start_server(command: list[str], log: Path) -> subprocess.Popen:
    """Start ``command`` in a new session (so in a process group of its own), output to ``log``,
    in ``server_env()``, with SIGINT at its default whatever this process does with it."""
    with open(log, "w") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=server_env(),
            start_new_session=True,
            preexec_fn=_default_sigint,
        )


@contextmanager
def serve_app(command: list[str], port: int, log: Path, startup_timeout_s: float) -> Iterator[dict]:
    """Start ``command`` (a ``python -m jaxray.serve`` line) in its own process group with its
    output in ``log``, wait for /healthz, yield {"url", "pid", "startup_s"}; on exit stop it and
    everything it started (``stop_server``) and add "stopped" to the dict. Raises ValueError when
    the port is taken (it would measure another server), RuntimeError when the app does not come up.

    See ``server_env`` for the environment it runs in."""
    check_port(port)
    url = f"http://{HOST}:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting: {' '.join(command)} (log: {log})", file=sys.stderr)
    proc = start_server(command, log)
    info = {"url": url, "pid": proc.pid}
    try:
        info["startup_s"] = wait_until_healthy(url, proc, log, startup_timeout_s)
        yield info
    finally:
        info["stopped"] = stop_server(proc)
