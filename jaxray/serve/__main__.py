"""python -m jaxray.serve --checkpoint PATH: serve a trained transformer over HTTP with Ray Serve.

Every option is checked (and the port tried) before Ray starts. Joins the cluster ``RAY_ADDRESS``
names (``RAY_ADDRESS=auto``: a ``ray start`` cluster on this machine), otherwise starts a private
local Ray in-process. Prints the URL and a curl example once the replica has compiled; Ctrl-C
(SIGINT) removes the app and stops what it started. SIGTERM does not: Ray 2.60's native
failure-signal handler in this process aborts it (exit 134) and Ray's dashboard and runtime-env
agents linger for about a minute; send SIGINT from supervisors.

  python -m jaxray.serve --checkpoint runs/demo --port 8000 --max-batch-size 16 --batch-wait-ms 10
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from pydantic import ValidationError

from jaxray.argtypes import cli_parser, port
from jaxray.inference.settings import add_engine_options, engine_overrides
from jaxray.serve.settings import AppArgs, add_replica_options, replica_overrides

APP_NAME = "jaxray"


def build_parser() -> argparse.ArgumentParser:
    p = cli_parser("python -m jaxray.serve", __doc__.split("\n\n")[0])
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a checkpoint folder, runs/<experiment> (its best transformer), or an export artifact",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=8000, help="HTTP port")
    add_replica_options(p)
    add_engine_options(p)
    return p


def app_args(args: argparse.Namespace, parser_error: Callable[[str], NoReturn]) -> AppArgs:
    """The validated AppArgs; ``parser_error`` (exit 2) names the option of a bad value."""
    try:
        parsed = AppArgs(checkpoint=args.checkpoint, **replica_overrides(args), engine=engine_overrides(args))
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        option = "--" + str(first["loc"][-1] if first["loc"] else "args").replace("_", "-")
        parser_error(f"{option}: {first['msg']}")
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if args.compute_cpus and available and args.compute_cpus > available:  # the replica runs on this machine
        parser_error(
            f"--compute-cpus: at most {available} (the CPUs available here), got {args.compute_cpus}"
        )
    return parsed


def check_port(host: str, port: int) -> str | None:
    """None if ``host:port`` can be listened on, else why not."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            # As servers bind: a port whose last connections sit in TIME_WAIT is free to listen on.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as err:
        return f"cannot listen on {host}:{port}: {err.strerror or err}"
    return None


def init_ray() -> bool:
    """Join the cluster ``RAY_ADDRESS`` names (``auto``: the one ``ray start`` left on this machine);
    otherwise start a private local Ray. True if joined.

    Never joins on its own: another user's or another test's Ray on the same machine (with its own
    auth token) would make ``ray.init`` retry forever instead of serving.
    """
    import ray  # deferred: ray is heavy; --help and option errors stay fast

    address = os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        if (Path.home() / ".ray" / "auth_token").is_file():
            os.environ.setdefault(
                "RAY_AUTH_MODE", "token"
            )  # a `ray start` cluster of Ray 2.60 uses token auth
        ray.init(address=address)
        return True
    # Ray Serve's own throughput mode (fewer per-request log writes, gRPC to the replica): on 2
    # CPU cores Serve's per-request work costs about as much CPU as decoding 64 bytes, and this
    # mode raised the 16-client tokens/s of `python -m jaxray.bench serve`. Workers of the private
    # Ray started here inherit it; set it yourself before `ray start` / `serve run`.
    os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    ray.init(address="local", include_dashboard=False)
    return False


class GpuShortage(ValueError):
    """--num-gpus asks for more GPUs than the private Ray started here has."""


def check_gpus(num_gpus: float, joined: bool) -> None:
    """A replica that asks for more GPUs than the cluster has is never placed, and Serve would wait
    for it: refuse that on the private Ray started here (GpuShortage), warn on a joined cluster,
    which may add GPU nodes."""
    import ray  # deferred: ray is heavy; --help and option errors stay fast

    have = ray.cluster_resources().get("GPU", 0)
    if num_gpus <= have:
        return
    message = f"--num-gpus {num_gpus:g}: the Ray cluster has {have:g} GPU(s)"
    if not joined:
        raise GpuShortage(f"{message}; use --num-gpus 0 to serve on this machine's CPU")
    print(f"warning: {message}; the replica waits for the cluster to add GPU nodes", file=sys.stderr)


def ready_message(host: str, port: int) -> str:
    """The URL, the compile time the replica reported, and a curl example."""
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    with urllib.request.urlopen(f"{url}/info", timeout=30) as reply:
        compiled = json.load(reply)
    body = json.dumps({"prompt": "ROMEO:", "max_new_tokens": 64, "temperature": 0})
    return (
        f"jaxray is serving on {url} ({compiled['programs']} programs compiled in "
        f"{compiled['compile_s']:.1f} s)\n"
        f"  curl -s {url}/generate -H 'Content-Type: application/json' -d '{body}'\n"
        f"Ctrl-C stops it."
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from jaxray.serve.app import build_app  # deferred: loads Ray and JAX, after --help has exited

    if problem := check_port(args.host, args.port):
        parser.error(f"--port: {problem}")
    settings = app_args(args, parser.error)
    try:  # binding checks the path, the checkpoint and the batch limits; it starts nothing
        app = build_app(settings)
    except ValueError as err:
        parser.error(str(err))

    from ray import serve  # deferred: ray is heavy; --help and option errors stay fast

    joined = init_ray()
    try:
        check_gpus(settings.num_gpus, joined)
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(ready_message(args.host, args.port), flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr)
        return 0
    except GpuShortage as err:  # bad input, found once Ray is up
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as err:  # a replica that failed to start: Serve's message names why
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        _stop(joined)


def _stop(joined: bool) -> None:
    """Remove our app; stop Serve and Ray only if this process started them."""
    import ray  # deferred: ray is heavy; --help and option errors stay fast
    from ray import serve  # deferred: as ray

    try:
        serve.delete(APP_NAME) if joined else serve.shutdown()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
