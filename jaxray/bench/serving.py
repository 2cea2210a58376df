"""``python -m jaxray.bench serve``: the Serve app under HTTP load, measured from a second process.

Three processes on loopback: this one (the driver), ``python -m jaxray.serve`` (started here in its
own process group, unless ``--url`` names an app already running) and ``python -m
jaxray.bench.loadtest`` (the clients, so their CPU time is neither the driver's nor the server's).
The report has one row per concurrency level (see ``jaxray.bench.loadtest`` for how each figure is
counted), ``summary.scaling_16_vs_1`` (new tokens/s at 16 clients / at 1) and, when 64 clients ran,
``summary.zero_errors_64`` (no 5xx and no dropped connection at 64 clients).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from jaxray.bench.output import Report, row_value
from jaxray.reporting.sweep import log2_batch_axis, save_figure

HOST = "127.0.0.1"
STOP_GRACE_S = 30.0  # Serve and Ray get this long to shut down on SIGINT before they are signalled
COLUMNS = [
    ("clients", "clients", ""),
    ("requests", "requests", ""),
    ("req/s", "rps", ".2f"),
    ("new tok/s", "new_tokens_per_s", ",.1f"),
    ("p50 ms", "p50_ms", ",.0f"),
    ("p95 ms", "p95_ms", ",.0f"),
    ("p99 ms", "p99_ms", ",.0f"),
    ("4xx", "errors_4xx", ""),
    ("5xx", "errors_5xx", ""),
    ("dropped", "dropped", ""),
    ("decode calls", "decode_calls", ""),
    ("mean rows", "mean_rows", ".1f"),
    ("replica CPU %", "replica_cpu_pct", ".0f"),
    ("server CPU %", "server_cpu_pct", ".0f"),
    ("client CPU %", "client_cpu_pct", ".0f"),
]
SERVER_OPTIONS = (
    "max_batch_size",
    "batch_wait_ms",
    "batch_sizes",
    "chunk",
    "num_gpus",
)  # passed on only when given


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
            times, title = (
                p.cpu_times(),
                " ".join(p.cmdline()[:1]),
            )  # Ray workers set their title, e.g. ray::ProxyActor
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


def chart(rows: list[dict], path: Path) -> None:
    """New tokens/s and p95 latency (ms) against concurrent clients (log2 axis)."""
    import matplotlib.pyplot as plt  # jaxray.reporting.sweep has set the Agg backend

    fig, (tok_ax, lat_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in (
        (tok_ax, "new_tokens_per_s", "new tokens/s"),
        (lat_ax, "p95_ms", "p95 latency (ms)"),
    ):
        points = sorted((r["clients"], row_value(r, key)) for r in rows if row_value(r, key) is not None)
        if points:
            ax.plot(*zip(*points), marker="o")
            log2_batch_axis(ax, [p[0] for p in points])
        ax.set(xlabel="concurrent clients (log2)", ylabel=label, title=f"{label} vs clients")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    fig.suptitle("jaxray Serve under closed-loop HTTP load")
    save_figure(fig, path)


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
        charts={"serve_load.png": chart},
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
        f"CPU columns in % of one core ({os.cpu_count()} cores: {100 * (os.cpu_count() or 1)}% is all of them): "
        "replica = Serve's replica, server = every process python -m jaxray.serve started (replica, HTTP "
        "proxy, Ray), over the level's whole run (blank with --url); client = the load generator over the "
        "measured window.",
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
