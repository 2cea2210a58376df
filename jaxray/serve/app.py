"""The Ray Serve application: ``app_builder`` (``serve run``, ``python -m jaxray.serve``) checks the
arguments and weights before anything is deployed, then binds ``replica.JaxrayServer``."""

# No `from __future__ import annotations`: kept like the route modules Serve reads.
import os
import sys
from pathlib import Path
from typing import Any

import jax
import ray
from pydantic import ValidationError
from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig

from jaxray import checkpoint, storage
from jaxray.inference.artifact_loader import read_artifact_manifest, read_verified
from jaxray.inference.load import check_source, describe_source, is_artifact
from jaxray.serve.replica import JaxrayServer
from jaxray.serve.settings import AppArgs, args_error, with_checkpoint

# Deployment options for short faults (see docs/serving.md).
CONSTRUCTOR_TRIES = 1  # a replica whose __init__ raises fails the deploy at once, with its exception
HEALTH_CHECK_PERIOD_S = 2.0  # how often Serve checks the replica: a dead one is noticed this soon
RETRY_AFTER_S = 1  # the Retry-After of a 503 for a full queue
SHUTDOWN_WAIT_S = 0.5  # a stopping replica checks this often whether its requests are done ...
SHUTDOWN_TIMEOUT_S = 3.0  # ... and is killed after this


def deployment(args: AppArgs) -> serve.Deployment:
    """``JaxrayServer`` with ``args``' replica policy (``autoscaling_config`` checked as Ray's
    ``AutoscalingConfig``: ValueError naming a bad key) and the options that keep faults short."""
    policy: dict[str, Any] = {"num_replicas": args.num_replicas}
    if args.autoscaling_config is not None:
        if unknown := sorted(set(args.autoscaling_config) - set(AutoscalingConfig.model_fields)):
            allowed = ", ".join(AutoscalingConfig.model_fields)
            raise ValueError(f"autoscaling_config: unknown key(s) {', '.join(unknown)}; allowed: {allowed}")
        try:
            AutoscalingConfig.model_validate(args.autoscaling_config)
        except ValidationError as err:
            raise ValueError(f"autoscaling_config: {args_error(err)}") from None
        policy = {"autoscaling_config": args.autoscaling_config}
    return JaxrayServer.options(
        **policy,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        backpressure_config={"status_code": 503, "retry_after_s": RETRY_AFTER_S},
        max_constructor_retry_count=CONSTRUCTOR_TRIES,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_S,
        graceful_shutdown_timeout_s=SHUTDOWN_TIMEOUT_S,
        **({"ray_actor_options": {"num_gpus": args.num_gpus}} if args.num_gpus else {}),
    )


def build_app(args: AppArgs) -> Application:
    """The bound application for ``args``, its weights checked here first. Raises ValueError (bad path,
    max_batch_size or setting), CheckpointError / ArtifactError naming a damaged file."""
    uri = storage.is_uri(args.checkpoint)  # fetched here to check it, by each replica to serve it
    path = args.checkpoint if uri else Path(args.checkpoint).expanduser().absolute()
    if not uri and not path.exists():
        raise ValueError(
            f"checkpoint {args.checkpoint} does not exist (looked for {path}; relative paths are "
            f"read from {os.getcwd()})"
        )
    largest = max(args.engine.batch_sizes)
    max_batch = args.max_batch_size or largest
    if max_batch > largest:
        raise ValueError(
            f"max_batch_size {max_batch} exceeds the largest compiled batch size {largest} "
            f"(engine.batch_sizes {args.engine.batch_sizes})"
        )
    if max_batch > args.max_ongoing_requests:
        raise ValueError(
            f"max_batch_size {max_batch} exceeds max_ongoing_requests {args.max_ongoing_requests}: "
            f"a batch could never fill"
        )
    server = deployment(args)  # checks the replica policy before any restore
    # Resolved here, so a replacement replica serves the same one (a URI: fetched into each node's
    # cache, refused if it changed since this check).
    source = check_source(path, args.engine)
    print(describe_source(source), file=sys.stderr, flush=True)  # which one, in the terminal
    # Checked without a restore: a checkpoint's digests by check_source; an artifact's files against its
    # manifest, without JAX (a backend started here would be forked by ray.init's processes).
    if is_artifact(source):
        read_verified(Path(source), read_artifact_manifest(source))
    # Replicas on one node would all pin the same CPUs: more than one runs unpinned, unless asked.
    pin = args.compute_cpus is not None or (args.autoscaling_config is None and args.num_replicas == 1)
    fetched = checkpoint.source(source)  # a URI, or a run folder whose best checkpoint is on storage
    remote_source = uri or storage.is_uri(fetched)
    resolved = args.checkpoint if uri else fetched if remote_source else str(source)
    pinned = None if is_artifact(source) else checkpoint.manifest_sha256(source)
    return server.bind(
        args.model_copy(update={"checkpoint": resolved, "max_batch_size": max_batch}), pin, pinned
    )


def app_builder(args: dict[str, Any]) -> Application:
    """``import_path`` for ``serve run``: ``build_app`` of ``args`` validated (AppArgs, ``with_checkpoint``).
    Raises ValueError naming the bad argument, CheckpointError / ArtifactError the file."""
    try:
        parsed = AppArgs.model_validate(with_checkpoint(args))
    except ValidationError as err:
        raise ValueError(f"serve args: {args_error(err)}") from None
    in_build_task = ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    if in_build_task or Path(sys.argv[0]).name == "serve":
        # Check on the CPU, leaving the GPUs to the replica (a no-op once JAX has started).
        jax.config.update("jax_platforms", "cpu")
    try:
        return build_app(parsed)
    except ValueError as err:  # the build task's own output reaches the `serve run` terminal
        print(f"jaxray: cannot serve: {err}", file=sys.stderr, flush=True)
        raise


def deploy_failure(name: str) -> str:
    """Why Serve's application ``name`` failed to deploy (``serve.status()`` messages); '' if none."""
    app = serve.status().applications.get(name)
    if app is None:
        return ""
    lines = [app.message] if app.message else []
    lines += [f"{d}: {status.message}" for d, status in app.deployments.items() if status.message]
    return "\n".join(lines)
