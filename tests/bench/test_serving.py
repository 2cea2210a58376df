"""The `python -m jaxray.bench serve` driver (jaxray/bench/serving.py): the report and its chart,
the app's counts, and the command's errors for bad input (before any process starts). Starting and
stopping the server: test_server_process.py; the end-to-end run against the real Serve app is tested
elsewhere."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from jaxray.bench import serving
from jaxray.bench.charts import serve_load

ROOT = Path(__file__).resolve().parents[2]


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
    serve_load(report.rows, tmp_path / "serve_load.png")
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
