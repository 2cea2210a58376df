"""python -m jaxray.serve --checkpoint PATH: serve a trained transformer over HTTP with Ray Serve.

Options, port and weights are checked before Ray starts (exit 2); a replica that fails to start
ends the command (exit 1). Ctrl-C or SIGTERM removes the app and stops what it started."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import yaml
from pydantic import ValidationError

from jaxray.argtypes import add_field_options, cli_parser, given_options, port, positive_float
from jaxray.inference.settings import add_engine_options, engine_overrides
from jaxray.serve.settings import OPTIONS as REPLICA_OPTIONS
from jaxray.serve.settings import AppArgs, args_error, with_checkpoint

APP_NAME = "jaxray"
IMPORT_PATH = "jaxray.serve.app:app_builder"  # the application of a config file (serve/config.yaml)
# Serve's http_options where neither the options nor --config give them.
HTTP = {"host": "127.0.0.1", "port": 8000, "request_timeout_s": 60.0}


def build_parser() -> argparse.ArgumentParser:
    p = cli_parser("python -m jaxray.serve", __doc__.split("\n\n")[0])
    p.add_argument(
        "--checkpoint",
        help="a checkpoint folder (or its URI: s3://, gs://), runs/<experiment> (its best transformer), "
        "or an export artifact",
    )
    p.add_argument(
        "--config",
        help="a Serve config file such as serve/config.yaml: its http_options and the args of its "
        f"{IMPORT_PATH} application, which the options given here override",
    )
    p.add_argument("--host", help=f"address to listen on (0.0.0.0: every interface; default {HTTP['host']})")
    p.add_argument("--port", type=port, help=f"HTTP port (default {HTTP['port']})")
    p.add_argument(
        "--request-timeout-s",
        type=positive_float,
        help=f"seconds before Serve's proxy answers a request still unanswered with 408 "
        f"(default {HTTP['request_timeout_s']:g})",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="Ray's and Serve's own INFO output too (default: their warnings and errors only)",
    )
    add_field_options(p, AppArgs, REPLICA_OPTIONS, REPLICA_OPTIONS)  # each None unless given
    add_engine_options(p)
    return p


def read_config(path: str, error: Callable[[str], NoReturn]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(http_options, args) of the Serve config ``path``, whose one ``IMPORT_PATH`` application has
    valid AppArgs, else ``error`` (exit 2)."""
    from ray.serve.schema import ServeDeploySchema  # deferred: ray is heavy; --help stays fast

    try:
        config = ServeDeploySchema.model_validate(yaml.safe_load(Path(path).read_text()))
    except (OSError, yaml.YAMLError, ValueError) as err:  # pydantic's ValidationError is a ValueError
        error(f"--config {path}: {err}")
    apps = [a for a in config.applications if a.import_path == IMPORT_PATH]
    if len(apps) != 1:
        error(f"--config {path}: expected one application of import_path {IMPORT_PATH}, found {len(apps)}")
    args = with_checkpoint(apps[0].args)  # as app_builder reads them: $JAXRAY_CHECKPOINT, runs/demo
    try:
        AppArgs.model_validate(args)
    except ValidationError as err:
        error(f"--config {path}: args: {args_error(err)}")
    return config.http_options.model_dump(), args


def app_args(args: argparse.Namespace, error: Callable[[str], NoReturn], base: dict[str, Any]) -> AppArgs:
    """The validated AppArgs (options over ``base``); ``error`` (exit 2) names a bad option."""
    if not (args.checkpoint or base.get("checkpoint")):
        error("one of --checkpoint or --config is required")
    try:
        given = {**base, "checkpoint": args.checkpoint or base["checkpoint"]}
        given |= given_options(args, REPLICA_OPTIONS)
        parsed = AppArgs(**{**given, "engine": {**base.get("engine", {}), **engine_overrides(args)}})
    except ValidationError as err:
        error(args_error(err, option=True))
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if args.compute_cpus and available and args.compute_cpus > available:  # the replica runs on this machine
        error(f"--compute-cpus: at most {available} (the CPUs available here), got {args.compute_cpus}")
    mib = parsed.engine.prefix_cache_mib
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    if mib and mib > memory:  # the pool lives in the replica's device memory, no larger than this machine's
        error(f"--prefix-cache-mib: at most {memory} (this machine's memory, MiB), got {mib}")
    return parsed


def check_port(host: str, port: int) -> str | None:
    """None if ``host:port`` can be listened on, else why not."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            # As servers bind: a port in TIME_WAIT is free to listen on.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as err:
        return f"cannot listen on {host}:{port}: {err.strerror or err}"
    return None


def init_ray(verbose: bool = False) -> bool:
    """Join the cluster ``RAY_ADDRESS`` names (True), else start a private local Ray (False). Unless
    ``verbose``, Ray's and Serve's loggers show warnings and errors only."""
    import ray  # deferred: ray is heavy; --help and option errors stay fast

    level = logging.INFO if verbose else logging.WARNING
    logging.getLogger("ray.serve").setLevel(level)  # ray.serve's logger has a level of its own
    address = os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        if (Path.home() / ".ray" / "auth_token").is_file():  # a `ray start` cluster of Ray 2.60 uses it
            os.environ.setdefault("RAY_AUTH_MODE", "token")
        ray.init(address=address, logging_level=level)
        return True
    # Serve's throughput mode: measurably faster on 2 cores (`python -m jaxray.bench serve`).
    os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    ray.init(address="local", include_dashboard=False, logging_level=level)
    return False


def ready_message(host: str, port: int) -> str:
    """The ready line (URL, compile time, routes), a curl example and how to stop."""
    from jaxray.serve.metrics import metrics_url  # deferred: FastAPI comes with it (loaded by main already)
    from jaxray.serve.routes import ROUTES  # deferred: as metrics_url

    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    with urllib.request.urlopen(f"{url}/info", timeout=30) as reply:
        compiled = json.load(reply)
    body = json.dumps({"prompt": "ROMEO:", "max_new_tokens": 64, "temperature": 0})
    return (
        f"jaxray is serving on {url} ({compiled['programs']} programs compiled in "
        f"{compiled['compile_s']:.1f} s) routes: {ROUTES}\n"
        f"  curl -s {url}/generate -H 'Content-Type: application/json' -d '{body}'\n"
        f"  playground: {url}/   metrics (Prometheus): {metrics_url()}\n"
        f"Ctrl-C stops it."
    )


def main(argv: list[str] | None = None) -> int:
    # Background jobs start with SIGINT ignored: restore it so `kill -INT PID` stops the app.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = build_parser()
    args = parser.parse_args(argv)
    from jaxray.serve.app import build_app  # deferred: loads Ray and JAX, after --help has exited

    def fail(message: str) -> NoReturn:  # as argparse's errors, without its usage block
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    given, base = read_config(args.config, fail) if args.config else ({}, {})
    options = {key: getattr(args, key) or given.get(key) or value for key, value in HTTP.items()}
    if problem := check_port(options["host"], options["port"]):
        fail(f"--port: {problem}")
    settings = app_args(args, fail, base)
    if settings.generation_timeout_s is None:  # end streams with an error event before Serve cuts them
        timeout = options["request_timeout_s"]  # a quarter left for the proxy and a busy replica's loop
        settings = settings.model_copy(update={"generation_timeout_s": 0.75 * timeout})
    try:  # checks the path, the batch limits and the checkpoint, restored once; starts nothing
        app = build_app(settings)
    except ValueError as err:
        fail(str(err))
    joined = init_ray(args.verbose)
    # After ray.init, whose own handler would exit mid-call: SIGTERM stops the app as Ctrl-C does.
    sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return _serve(app, options, args.verbose, settings.num_gpus, joined)
    finally:
        signal.signal(signal.SIGTERM, sigterm)


def _serve(app, http: dict[str, Any], verbose: bool, num_gpus: float, joined: bool) -> int:
    """Deploy ``app`` on Serve's ``http`` options and wait for Ctrl-C; the exit status (too few GPUs:
    2 on the private Ray, a warning on a joined cluster). Then remove our app and stop Ray."""
    import ray  # deferred: ray is heavy; --help and option errors stay fast
    from ray import serve  # deferred: as ray

    try:
        if num_gpus > (have := ray.cluster_resources().get("GPU", 0)):
            message = f"--num-gpus {num_gpus:g}: the Ray cluster has {have:g} GPU(s)"
            if not joined:  # bad input, found once Ray is up
                print(f"error: {message}; use --num-gpus 0 to serve on this machine's CPU", file=sys.stderr)
                return 2
            print(f"warning: {message}; the replica waits for the cluster to add GPU nodes", file=sys.stderr)
        logs = None if verbose else {"log_level": "WARNING"}  # Serve's LoggingConfig (default INFO)
        serve.start(http_options=http, logging_config=logs)
        serve.run(app, name=APP_NAME, route_prefix="/", logging_config=logs)
        print(ready_message(http["host"], http["port"]), flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr, flush=True)
        return 0
    except RuntimeError as err:  # serve.run: a replica failed to start; Serve's status says why
        from jaxray.serve.app import deploy_failure  # deferred: loaded already, by main()

        print(f"error: {err}\n{deploy_failure(APP_NAME)}".rstrip(), file=sys.stderr)
        return 1
    finally:
        try:
            if joined:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()


if __name__ == "__main__":
    import jax  # deferred: only here, before JAX starts, so that main() called from tests is unaffected

    # Weights are restored here only to check them: on the CPU.
    jax.config.update("jax_platforms", "cpu")
    sys.exit(main())
