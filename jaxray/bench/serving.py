"""``python -m jaxray.bench serve``: the Serve app under HTTP load, measured from a second process.

Three processes on loopback: this one (the driver), ``python -m jaxray.serve`` (started and stopped
by ``jaxray.bench.server_process`` in its own process group, unless ``--url`` names an app already
running) and ``python -m jaxray.bench.loadtest`` (the clients, so their CPU time is neither the
driver's nor the server's).
The report has one row per concurrency level (see ``jaxray.bench.loadtest`` for how each figure is
counted), ``summary.scaling_16_vs_1`` (new tokens/s at 16 clients / at 1) and, when 64 clients ran,
``summary.zero_errors_64`` (no 5xx and no dropped connection at 64 clients).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from jaxray.bench.charts import serve_load
from jaxray.bench.columns import columns
from jaxray.bench.output import Report, row_value
from jaxray.bench.server_process import SERVER_OPTIONS, check_port, healthy, serve_app, serve_command

COLUMNS = columns(
    "clients requests rps new_tokens_per_s p50_ms p95_ms p99_ms errors_4xx errors_5xx dropped decode_calls"
    " mean_rows replica_cpu_pct server_cpu_pct client_cpu_pct"
)


def loadtest_command(url: str, args, clients: int) -> list[str]:
    """The ``python -m jaxray.bench.loadtest ... --json`` line of one level, from the load options."""
    cmd = [
        sys.executable,
        "-m",
        "jaxray.bench.loadtest",
        "--url",
        url,
        "--json",
        "--clients",
        str(clients),
        "--duration",
        str(args.duration),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--prompt",
        args.prompt,
        "--temperature",
        str(args.temperature),
        "--seed",
        str(args.seed),
        "--timeout",
        str(args.timeout),
    ]
    return cmd + (["--top-k", str(args.top_k)] if args.top_k is not None else [])


def run_loadtest(url: str, args, clients: int) -> dict:
    """One level of the load test as a second process (its progress line passes through to stderr);
    returns its row. Raises RuntimeError when it fails or prints no JSON."""
    limit = args.duration + 2 * args.timeout + 60  # warm-ups and the tail may each take a timeout
    try:
        proc = subprocess.run(
            loadtest_command(url, args, clients),
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            timeout=limit,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the load test with {clients} clients took longer than {limit:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"python -m jaxray.bench.loadtest exited with code {proc.returncode}")
    try:
        return json.loads(proc.stdout)["rows"][0]
    except (ValueError, KeyError, IndexError):
        raise RuntimeError(f"the load test printed no result: {proc.stdout[-500:]!r}") from None


def cpu_seconds(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the server ``root_pid`` and every process it
    started, by role: "replica" (Ray's ServeReplica workers), "proxy" (Serve's HTTP proxy), "server"
    (all of them, Ray's own processes included). Processes that exit meanwhile are skipped."""
    try:
        root = psutil.Process(root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    totals = {"replica": 0.0, "proxy": 0.0, "server": 0.0}
    for p in processes:
        try:
            # Ray workers set their title, e.g. ray::ProxyActor
            times, title = p.cpu_times(), " ".join(p.cmdline()[:1])
        except psutil.Error:
            continue
        used = times.user + times.system
        totals["server"] += used
        for role, marker in (("replica", "ray::ServeReplica"), ("proxy", "ray::ProxyActor")):
            totals[role] += used if title.startswith(marker) else 0.0
    return totals


def served_counts(url: str) -> dict[str, int] | None:
    """{"decode_calls", "rows_decoded"} the app's engine has run so far, from its ``GET /info``
    (``server.engine``); None when /info cannot be read or lacks them."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/info", timeout=10) as resp:
            engine = json.load(resp)["server"]["engine"]
        return {"decode_calls": int(engine["decode_calls"]), "rows_decoded": int(engine["rows_decoded"])}
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
        return None


def batch_stats(before: dict | None, after: dict | None) -> dict:
    """The decode calls run between two ``served_counts`` and their mean number of live requests
    (None when a count is missing or no call ran)."""
    if before is None or after is None:
        return {"decode_calls": None, "mean_rows": None}
    calls = after["decode_calls"] - before["decode_calls"]
    rows = after["rows_decoded"] - before["rows_decoded"]
    return {"decode_calls": calls, "mean_rows": rows / calls if calls > 0 else None}


def measure(url: str, args, server_pid: int | None) -> list[dict]:
    """Every level in turn, one load-test process each. Each row also has the decode calls the
    replica ran during the level and their mean live requests (``batch_stats``, warm-ups included), and with
    ``server_pid`` (an app started here) the CPU its processes used in % of one core
    (``replica_cpu_pct``, ``proxy_cpu_pct``, ``server_cpu_pct``; over the level's whole run: start-up,
    warm-ups and tail included)."""
    rows = []
    for clients in args.clients:
        counts0, cpu0, start = (
            served_counts(url),
            cpu_seconds(server_pid) if server_pid else {},
            time.monotonic(),
        )
        row = run_loadtest(url, args, clients)
        wall, cpu1 = time.monotonic() - start, cpu_seconds(server_pid) if server_pid else {}
        row.update(
            {f"{role}_cpu_pct": 100 * (cpu1[role] - cpu0[role]) / wall for role in cpu0 if role in cpu1}
        )
        row.update(batch_stats(counts0, served_counts(url)))
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    """The headline figures: scaling_16_vs_1 (new tokens/s at 16 clients / at 1; None unless both
    ran) and, when 64 clients ran, zero_errors_64 (True when they saw no 5xx and no dropped
    connection)."""
    by_clients = {r["clients"]: r for r in rows}
    one, sixteen = (row_value(by_clients.get(n, {}), "new_tokens_per_s") for n in (1, 16))
    summary = {
        "scaling_16_vs_1": sixteen / one if one and sixteen is not None else None,
        "scaling_target": 4.0,
    }
    if 64 in by_clients:
        r = by_clients[64]
        summary.update(
            zero_errors_64=r["errors_5xx"] == 0 and r["dropped"] == 0,
            errors_5xx_64=r["errors_5xx"],
            dropped_64=r["dropped"],
            duration_s_64=r["duration_s"],
        )
    return summary


def machine_note() -> str:
    """The CPU this ran on, e.g. 'Intel(R) Xeon(R) Processor, 2 logical CPUs, Linux 6.1'."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"


def build_report(levels: list[dict], notes: list[str]) -> Report:
    """The bench report of the levels' rows (``measure``). A level where no request answered 200
    is a failed row (``error``), so it cannot replace earlier results."""
    rows = []
    for r in levels:
        row = {"case": f"{r['clients']} clients", **r}
        if not r["requests"]:
            row["error"] = f"no request answered 200 (first error: {r['first_error'] or 'none'})"
        rows.append(row)
    return Report(
        name="serve",
        title="Serve: HTTP load test (closed-loop clients on loopback)",
        rows=rows,
        columns=COLUMNS,
        notes=notes,
        charts={"serve_load.png": serve_load},
        summary=summarize(rows),
    )


def notes_for(args, app: dict, server_cmd: list[str] | None, summary: dict) -> list[str]:
    """What the reader needs to judge the figures: machine, settings, how it was counted, results."""
    server = (
        " ".join(["python", *server_cmd[1:]]) if server_cmd else f"an app already running at {app['url']}"
    )
    if app.get("startup_s") is not None:
        server += f" (healthy {app['startup_s']:.0f} s after start)"
    notes = [
        f"Machine: {machine_note()}; the server, the load generator and this driver share it.",
        f"Server: {server}.",
        f"Load: python -m jaxray.bench.loadtest in its own process; {args.duration:g} s measured per level "
        f"after one warm-up request per client; every request asks for {args.max_new_tokens} new tokens "
        f"after the prompt {args.prompt!r} (temperature {args.temperature:g}, top_k {args.top_k or 'all'}, "
        f"its own seed); a request over {args.timeout:g} s counts as dropped.",
        "req/s and new tok/s count each request for the part of it inside the measured window; latency is "
        "client-side (request sent to body read); errors count every request, warm-ups included.",
        f"CPU columns in % of one core ({os.cpu_count()} cores: {100 * (os.cpu_count() or 1)}% is all "
        "of them): replica = Serve's replica, server = every process python -m jaxray.serve started "
        "(replica, HTTP proxy, Ray), over the level's whole run (blank with --url); client = the load "
        "generator over the measured window.",
        "decode calls and mean rows: the engine's decode calls during the level (warm-ups included; "
        "chunk tokens each) and their mean number of live requests (continuous batching), from the app's "
        "GET /info (server.engine).",
    ]
    if summary.get("scaling_16_vs_1") is not None:
        notes.append(f"16 vs 1 client: {summary['scaling_16_vs_1']:.2f}x the new tokens/s (target >= 4x).")
    if "zero_errors_64" in summary:
        notes.append(
            f"64 clients for {summary['duration_s_64']:.0f} s: {summary['errors_5xx_64']} 5xx, "
            f"{summary['dropped_64']} dropped ({'pass' if summary['zero_errors_64'] else 'FAIL'})."
        )
    if app.get("stopped"):
        notes.append(f"Shut-down: {app['stopped']}.")
    return notes


def run(args) -> tuple[Report, Path | None]:
    """Start the app (unless ``args.url``), load it from a second process, stop the app; returns the
    report and the server's log (None with ``--url``). The log is written to a temporary folder:
    a run that fails must not touch the results folder. Raises ValueError (port taken, ``--url`` not healthy)
    or RuntimeError (the app or the load test failed)."""
    if args.url:
        if not healthy(args.url, timeout_s=10.0):
            raise ValueError(f"--url {args.url}: GET /healthz did not answer 200")
        app, command, log = {"url": args.url}, None, None
        levels = measure(args.url, args, None)
    else:
        command = serve_command(args.checkpoint, args.port, {k: getattr(args, k) for k in SERVER_OPTIONS})
        check_port(args.port)  # before the temporary folder: a run that cannot start leaves nothing
        log = Path(tempfile.mkdtemp(prefix="jaxray-bench-serve-")) / "serve.log"
        with serve_app(command, args.port, log, args.startup_timeout) as app:
            levels = measure(app["url"], args, app["pid"])
        print(app["stopped"], file=sys.stderr)
    report = build_report(levels, [])
    report.notes = notes_for(args, app, command, report.summary)
    return report, log
