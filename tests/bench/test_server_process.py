"""Starting and stopping the server that `python -m jaxray.bench serve` measures
(jaxray/bench/server_process.py): nothing it started is left behind, SIGINT reaches it as Ctrl-C
even when this process ignores SIGINT, and its command line passes on only the options given."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from jaxray.bench import server_process


def _stubborn_server() -> subprocess.Popen:
    """A leader (the 'server') with a child in its group and a grandchild in a session of its own (as
    Ray's workers are); both children ignore SIGINT and SIGTERM."""
    stubborn = ["sh", "-c", "trap '' INT TERM; sleep 60"]
    script = (
        f"import subprocess, time; subprocess.Popen({stubborn!r}); "
        f"subprocess.Popen({stubborn!r}, start_new_session=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(psutil.Process(proc.pid).children(recursive=True)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


@pytest.mark.slow  # a real server start (11 s); CI runs it
def test_stop_server_leaves_no_process_behind():
    proc = _stubborn_server()
    tree = psutil.Process(proc.pid).children(recursive=True)
    how = server_process.stop_server(proc, grace_s=1.0)
    assert "SIGKILL" in how and how.endswith("none is left"), how
    assert not [p for p in tree if _running(p)]
    assert not [p for p in psutil.process_iter() if _running(p) and _pgid(p) == proc.pid]


def _running(p: psutil.Process) -> bool:  # a zombie has exited: only its parent has not read its status yet
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _pgid(p: psutil.Process) -> int:
    try:
        return os.getpgid(p.pid)
    except ProcessLookupError:
        return -1


def test_stop_server_on_sigint_like_ctrl_c():
    # SIGINT back to its default in the child: a test run started in the background inherits it ignored.
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        start_new_session=True,
        preexec_fn=server_process._default_sigint,
    )
    time.sleep(0.3)  # past the interpreter's start, so SIGINT is a KeyboardInterrupt
    assert server_process.stop_server(proc, grace_s=10.0).endswith("exited on SIGINT (as Ctrl-C)")
    assert proc.returncode == -signal.SIGINT  # Python exits so after an unhandled KeyboardInterrupt


def test_the_server_gets_sigint_even_when_this_process_ignores_it(tmp_path):
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as for a command a script starts with '&'
    try:
        proc = server_process.start_server(
            [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
            tmp_path / "server.log",
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 10
    while "up" not in (tmp_path / "server.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)  # a process group of its own
    assert server_process.stop_server(proc, grace_s=10.0).endswith("exited on SIGINT (as Ctrl-C)")


def test_serve_command_passes_only_given_options():
    cmd = server_process.serve_command(
        "runs/demo",
        8001,
        {"max_batch_size": 16, "batch_wait_ms": None, "batch_sizes": (1, 8, 16), "chunk": None},
    )
    assert cmd[1:] == [
        "-m",
        "jaxray.serve",
        "--checkpoint",
        "runs/demo",
        "--host",
        "127.0.0.1",
        "--port",
        "8001",
        "--max-batch-size",
        "16",
        "--batch-sizes",
        "1,8,16",
    ]
