"""The `python -m jaxray.bench serve` driver (jaxray/bench/serving.py): stopping the server and
everything it started, the report, and the command's errors for bad input (before any process
starts). The end-to-end run against the real Serve app is tested elsewhere."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from jaxray.bench import serving

ROOT = Path(__file__).resolve().parents[2]


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


def test_stop_server_leaves_no_process_behind():
    proc = _stubborn_server()
    tree = psutil.Process(proc.pid).children(recursive=True)
    how = serving.stop_server(proc, grace_s=1.0)
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
        preexec_fn=serving._default_sigint,
    )
    time.sleep(0.3)  # past the interpreter's start, so SIGINT is a KeyboardInterrupt
    assert serving.stop_server(proc, grace_s=10.0).endswith("exited on SIGINT (as Ctrl-C)")
    assert proc.returncode == -signal.SIGINT  # Python exits so after an unhandled KeyboardInterrupt


def test_the_server_gets_sigint_even_when_this_process_ignores_it(tmp_path):
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as for a command a script starts with '&'
    try:
        proc = serving.start_server(
            [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
            tmp_path / "server.log",
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 10
    while "up" not in (tmp_path / "server.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)  # a process group of its own
    assert serving.stop_server(proc, grace_s=10.0).endswith("exited on SIGINT (as Ctrl-C)")


def test_serve_command_passes_only_given_options():
    cmd = serving.serve_command(
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


def _row(clients: int, tok_s: float, **extra) -> dict:
    return {
        "clients": clients,
        "duration_s": 20.0,
        "requests": 10,
        "rps": 1.0,
        "new_tokens": 640,
        "new_tokens_per_s": tok_s,
        "p50_ms": 100.0,
        "p95_ms": 200.0,
        "p99_ms": 300.0,
        "mean_ms": 120.0,
        "errors_4xx": 0,
        "errors_5xx": 0,
        "dropped": 0,
        "errors_other": 0,
        "first_error": "",
        "client_cpu_pct": 5.0,
        **extra,
    }


def test_report_summary_and_chart(tmp_path):
    rows = [_row(1, 100.0), _row(4, 300.0), _row(16, 450.0), _row(64, 460.0, dropped=1, first_error="reset")]
    report = serving.build_report(rows, [])
    assert report.summary["scaling_16_vs_1"] == pytest.approx(4.5)
    assert report.summary["zero_errors_64"] is False and report.summary["dropped_64"] == 1
    assert not report.failed
    serving.chart(report.rows, tmp_path / "serve_load.png")
    assert (tmp_path / "serve_load.png").stat().st_size > 0
    failed = serving.build_report([_row(1, 0.0, requests=0, first_error="HTTP 500: x")], [])
    assert "HTTP 500: x" in failed.rows[0]["error"] and failed.summary["scaling_16_vs_1"] is None


def bench_serve(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxray.bench", "serve", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--checkpoint", "no/such/run"], "--checkpoint"),
        ([], "one of the arguments --checkpoint --url is required"),
        (["--checkpoint", ".", "--url", "http://127.0.0.1:8000"], "not allowed with argument"),
        (["--checkpoint", ".", "--clients", "1,0"], "--clients"),
        (["--checkpoint", ".", "--port", "70000"], "--port"),
        (["--url", "127.0.0.1:8000"], "--url"),
    ],
)
def test_bench_serve_rejects_bad_input_before_starting_anything(args, message):
    proc = bench_serve(*args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert "starting:" not in proc.stderr


def test_bench_serve_refuses_a_port_already_taken(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = bench_serve("--checkpoint", tmp_path, "--port", port, "--out", tmp_path / "out")
    assert proc.returncode == 2 and f"--port {port}: something already listens" in proc.stderr
    assert "starting:" not in proc.stderr and not (tmp_path / "out" / "summary.json").exists()


def test_bench_serve_url_must_be_healthy(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        proc = bench_serve("--url", f"http://127.0.0.1:{port}", "--out", tmp_path / "out")
    assert proc.returncode == 2 and "GET /healthz did not answer 200" in proc.stderr


class _Info(BaseHTTPRequestHandler):
    body = b"{}"

    def do_GET(self):  # noqa: N802 - the http.server API
        self.send_response(200 if self.path == "/info" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):  # keep the test output quiet
        pass


@pytest.fixture
def info_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Info)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_served_counts_reads_the_apps_info(info_server):
    url = f"http://127.0.0.1:{info_server.server_address[1]}"
    _Info.body = json.dumps(
        {
            "model": {},
            "server": {
                "served": {"batches": 9, "requests": 40, "largest_batch": 4},
                "engine": {"decode_calls": 5, "rows_decoded": 40, "mean_rows": 8.0},
            },
        }
    ).encode()
    assert serving.served_counts(url) == {"decode_calls": 5, "rows_decoded": 40}
    _Info.body = json.dumps({"server": {"served": {"requests": 40}}}).encode()  # an app without the counts
    assert serving.served_counts(url) is None
    _Info.body = b"not json"
    assert serving.served_counts(url) is None


def test_batch_stats_between_two_counts():
    before, after = {"rows_decoded": 40, "decode_calls": 5}, {"rows_decoded": 200, "decode_calls": 15}
    assert serving.batch_stats(before, after) == {"decode_calls": 10, "mean_rows": 16.0}
    assert serving.batch_stats(after, after) == {"decode_calls": 0, "mean_rows": None}
    assert serving.batch_stats(None, after) == {"decode_calls": None, "mean_rows": None}
