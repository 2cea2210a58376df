"""The Ray Serve application: one replica holding a compiled ``jaxray.inference.engine.Engine``.

The routes (``/generate``, ``/v1/completions``, ``/healthz``, ``/info``) are the replica's methods,
on the FastAPI app of ``jaxray.serve.routes``, which lists them and holds the HTTP side they share.

The replica loads and compiles every (bucket, batch size) program in ``__init__``, before Serve
routes traffic to it, so the first request runs the same compiled code as the tenth. Concurrent
requests meet in ``@serve.batch`` async generators (stream and non-stream requests alike), whose
groups ``jaxray.serve.scheduler`` admits into one running batch (continuous batching,
``jaxray.inference.batcher``) on one worker thread, so the event loop keeps answering /healthz
while it decodes.

``serve run serve/config.yaml`` calls ``app_builder``; ``python -m jaxray.serve`` calls ``build_app``.
Both restore the weights once in the calling process (``check_restores``) before anything is
deployed, so a damaged checkpoint is refused there, naming the file. The deployment's options
(``deployment``) make faults short: a replica whose constructor raises is not started again (the
deploy fails with its exception), a replica that dies is noticed within seconds and replaced, a
full queue answers 503 with Retry-After, and a stopped replica is killed after a few seconds.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at runtime, and Serve's
# class-based views cannot resolve string annotations such as "HttpRequest" from this module.
import asyncio
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jax
import ray
from fastapi.responses import StreamingResponse
from pydantic import (
    ValidationError,
)
from ray import serve
from ray.serve import Application
from starlette.requests import Request as HttpRequest

from jaxray.inference.artifact_loader import read_artifact_manifest
from jaxray.inference.engine import Request
from jaxray.inference.load import check_source, describe_source, is_artifact, load_engine
from jaxray.inference.settings import EngineSettings
from jaxray.serve.routes import (
    Counted,
    api,
    body_schema,
    completion_events,
    decoded,
    drain,
    generate_events,
    read_body,
)
from jaxray.serve.scheduler import Scheduler
from jaxray.serve.schema import (
    ApiError,
    CompletionRequest,
    GenerateRequest,
    GenerateResponse,
    Limits,
    completion_object,
    parse,
    served_model,
)
from jaxray.serve.settings import AppArgs, args_error, with_checkpoint

logger = logging.getLogger("ray.serve")
ENGINE_FIELDS = ("prompt", "max_new_tokens", "temperature", "top_k", "seed")
MERGED_BATCHES = 16  # Serve batches in flight at once, merged by the scheduler
# Deployment options for short faults (see the module docstring and docs/serving.md).
CONSTRUCTOR_TRIES = 1  # a replica whose __init__ raises fails the deploy at once, with its exception
HEALTH_CHECK_PERIOD_S = 2.0  # how often Serve checks the replica: a dead one is noticed this soon
RETRY_AFTER_S = 1  # the Retry-After of a 503 for a full queue
SHUTDOWN_WAIT_S = 0.5  # a stopping replica checks this often whether its requests are done ...
SHUTDOWN_TIMEOUT_S = 3.0  # ... and is killed after this


def pin_compute(cpus: int | None) -> list[int]:
    """Restrict the calling thread, and so every thread it starts later, to ``cpus`` of the CPUs this
    process may use (None: all but one, at least one); returns them (sorted).

    Called before JAX's backend starts: XLA creates its CPU compute threads then, inheriting this
    mask and sized by it (the affinity mask is how JAX's maintainers advise limiting XLA's CPU
    threads, jax-ml/jax#1539). On a 2-core machine a 16-row decode chunk took 27 ms on one pinned
    core against 33 ms on both (the second compute thread cost more in synchronisation than it
    gave), and the core left free runs Serve's HTTP proxy and Ray. Where the OS has no affinity
    call (macOS) nothing is pinned and [] is returned. Raises ValueError when ``cpus`` exceeds the
    CPUs available.
    """
    if not hasattr(os, "sched_setaffinity"):
        return []
    available = sorted(os.sched_getaffinity(0))
    count = max(1, len(available) - 1) if cpus is None else cpus
    if not 1 <= count <= len(available):
        raise ValueError(
            f"compute_cpus must be in 1..{len(available)} (the CPUs this replica may use), got {cpus}"
        )
    os.sched_setaffinity(0, available[:count])
    return available[:count]


@serve.deployment
@serve.ingress(api)
class JaxrayServer:
    """One replica: the engine, its compiled programs, and the HTTP routes over them.

    checkpoint: an absolute path ``jaxray.inference.load.load_engine`` accepts; settings: the
    engine's; max_batch_size: requests decoded together (<= max(settings.batch_sizes));
    batch_wait_s: how long the first request of a batch waits for company; compute_cpus: CPUs for
    JAX's compute threads (``pin_compute``).
    """

    def __init__(
        self,
        checkpoint: str,
        settings: EngineSettings,
        max_batch_size: int,
        batch_wait_s: float,
        compute_cpus: int | None = None,
    ):
        self.started = time.monotonic()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.compute_cpus = pin_compute(compute_cpus)
        self.engine = load_engine(checkpoint, settings)
        report = self.engine.compile()
        logger.info(
            "jaxray: compiled %d programs in %.1f s (buckets %s, batch sizes %s) for %s on %s",
            report["programs"],
            report["compile_s"],
            self.engine.buckets,
            settings.batch_sizes,
            checkpoint,
            jax.devices(),
        )
        self.model_name = Path(checkpoint).name
        self.limits = Limits(
            settings.max_new_tokens, settings.max_prompt_bytes, self.engine.config.vocab_size
        )
        self.batching = {
            "max_batch_size": max_batch_size,
            "batch_wait_ms": batch_wait_s * 1e3,
            "compute_cpus": self.compute_cpus,
        }
        self._batch.set_max_batch_size(max_batch_size)
        self._batch.set_batch_wait_timeout_s(batch_wait_s)
        self.scheduler = Scheduler(self.engine, max_batch_size)
        self._draining: set[asyncio.Task] = set()  # references keep the drain tasks from being collected
        self.served = {"batches": 0, "requests": 0, "largest_batch": 0}

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        # Which replica answered and since when: a replaced replica shows as a new id.
        return {"status": "ok", "replica": self.replica, "up_s": round(time.monotonic() - self.started, 1)}

    @api.get("/info")
    async def info(self) -> dict[str, Any]:
        return {
            **self.engine.info(),
            "model": served_model(self.engine.config.model_dump()),
            "server": {
                **self.batching,
                "limits": vars(self.limits),
                "served": dict(self.served),
                "engine": self.scheduler.stats(),
            },
        }

    @api.post("/generate", response_model=GenerateResponse, openapi_extra=body_schema(GenerateRequest))
    async def generate(self, http: HttpRequest):
        start = time.perf_counter()
        req = parse(GenerateRequest, await read_body(http, self.limits.max_body_bytes), self.limits)
        engine_req = self._engine_request(req, req.new_tokens(self.limits), "max_new_tokens")
        chunks = Counted(self._tokens(engine_req))
        usage = {"prompt_tokens": self.engine.prompt_tokens(engine_req)}
        if req.stream:
            return StreamingResponse(generate_events(chunks, usage, start), media_type="text/event-stream")
        text = "".join([piece async for piece in decoded(chunks)])
        return GenerateResponse(
            text=text, new_tokens=chunks.count, **usage, latency_ms=(time.perf_counter() - start) * 1e3
        ).model_dump()

    @api.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(self, http: HttpRequest):
        req = parse(CompletionRequest, await read_body(http, self.limits.max_body_bytes), self.limits)
        engine_req = self._engine_request(req, req.new_tokens(self.limits), "max_tokens")
        chunks = Counted(self._tokens(engine_req))
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            events = completion_events(chunks, completion_id, self.model_name)
            return StreamingResponse(events, media_type="text/event-stream")
        text = "".join([piece async for piece in decoded(chunks)])
        prompt_tokens = self.engine.prompt_tokens(engine_req)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": chunks.count,
            "total_tokens": prompt_tokens + chunks.count,
        }
        # Generation stops only at the token budget (no stop sequences), hence "length".
        return completion_object(completion_id, self.model_name, text, "length", usage)

    def _engine_request(
        self, req: GenerateRequest | CompletionRequest, new_tokens: int, cap_field: str
    ) -> Request:
        """The engine's Request; ``Engine.check`` has the last word (ApiError naming the field)."""
        engine_req = Request(
            prompt=req.prompt.encode("utf-8"),
            max_new_tokens=new_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            seed=req.seed,
        )
        try:
            self.engine.check(engine_req)
        except ValueError as err:
            field = next((f for f in ENGINE_FIELDS if str(err).startswith(f)), "body")
            raise ApiError(400, cap_field if field == "max_new_tokens" else field, str(err)) from None
        return engine_req

    async def _tokens(self, request: Request) -> AsyncIterator[list[int]]:
        """This request's new tokens, a chunk at a time, as its batch produces them."""
        results = self._batch(request)
        try:
            async for tokens, done in results:
                if tokens:
                    yield tokens
                if done:
                    return
        finally:
            # Serve ends this request's result stream only at the batch's next yield or end: read
            # that last item in the background (so asyncio has no unretrieved StopAsyncIteration to
            # log) rather than hold the response until the longest request of the batch is done.
            task = asyncio.get_running_loop().create_task(drain(results))
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)

    # Several Serve batches may wait at once: the scheduler admits each into the running batch.
    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01, max_concurrent_batches=MERGED_BATCHES)
    async def _batch(self, requests: list[Request]) -> AsyncIterator[list]:
        """Serve calls this with the requests that arrived together (max size and wait reset in
        ``__init__``); each yield hands request i ``(tokens, done)``, and StopIteration (Serve's
        end-of-stream marker) after it was done."""
        self.served["batches"] += 1
        self.served["requests"] += len(requests)
        self.served["largest_batch"] = max(self.served["largest_batch"], len(requests))
        remaining = [r.max_new_tokens for r in requests]
        async for step in self.scheduler.run(requests):
            out: list[Any] = []
            for i, tokens in enumerate(step):
                if remaining[i] <= 0:
                    out.append(StopIteration)
                    continue
                remaining[i] -= len(tokens)
                out.append((tokens, remaining[i] <= 0))
            yield out


def check_restores(path: Path, settings: EngineSettings) -> None:
    """Load the weights ``path`` serves once, in this process, as the replica will (every file
    checked against its recorded SHA-256), so a damaged checkpoint or artifact is refused before
    anything is deployed. An artifact exported only for another platform than this process's (a
    GPU export, checked on a CPU driver) is left to the replica. Raises CheckpointError /
    ArtifactError (ValueErrors) naming the path and the file, ValueError naming a setting."""
    if (
        is_artifact(path)
        and jax.export.default_export_platform() not in read_artifact_manifest(path)["platforms"]
    ):
        return
    engine = load_engine(path, settings)
    del engine  # only the check was wanted: the replica loads its own


def deployment(args: AppArgs) -> serve.Deployment:
    """``JaxrayServer`` with the options of ``args`` and those that keep faults short (the
    module docstring)."""
    return JaxrayServer.options(
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
    """The bound application for ``args``, once its weights restored here (``check_restores``).
    Raises ValueError if the checkpoint path does not exist or ``max_batch_size`` exceeds the
    largest compiled batch size or ``max_ongoing_requests``; CheckpointError / ArtifactError (both
    ValueErrors) naming the file when the checkpoint or artifact is incomplete or damaged."""
    path = Path(args.checkpoint).expanduser().absolute()
    if not path.exists():
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
    # A wrong workload or artifact settings: refused before Ray starts. The replicas get the
    # checkpoint resolved here, so a replacement serves the same one.
    source = check_source(path, args.engine)
    print(describe_source(source), file=sys.stderr, flush=True)  # which one, in the terminal
    check_restores(source, args.engine)
    server = deployment(args)
    return server.bind(str(source), args.engine, max_batch, args.batch_wait_ms / 1e3, args.compute_cpus)


def app_builder(args: dict[str, Any]) -> Application:
    """``import_path: jaxray.serve.app:app_builder`` for ``serve run``: validates ``args`` (see
    AppArgs; without a ``checkpoint``, ``$JAXRAY_CHECKPOINT`` or ``runs/demo``: ``with_checkpoint``)
    and builds the app. Raises ValueError naming the bad argument, CheckpointError /
    ArtifactError (ValueErrors) naming the damaged file (``build_app``). Under ``serve run
    serve/config.yaml`` Serve builds in a task of its own and reports the application as
    DEPLOY_FAILED with that message, nothing deployed, but Ray 2.60's command then only sleeps
    (``ray/serve/scripts.py``, ``run``: ``deploy_apps(config, _blocking=False)``, then
    ``while True: time.sleep(10)``). ``serve run jaxray.serve.app:app_builder checkpoint=PATH
    [key=value ...]`` builds in the command's own process before Ray starts: the error ends it
    (exit 1) in seconds."""
    try:
        parsed = AppArgs.model_validate(with_checkpoint(args))
    except ValidationError as err:
        raise ValueError(f"serve args: {args_error(err)}") from None
    in_build_task = ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    if in_build_task or Path(sys.argv[0]).name == "serve":
        # Serve's build task (serve run <config>), or Ray's serve command, which builds the app of
        # an import path itself and stays up to deploy it: check on the CPU, leaving the GPUs to
        # the replica. A no-op where JAX has already started.
        jax.config.update("jax_platforms", "cpu")
    try:
        return build_app(parsed)
    except ValueError as err:  # the build task's own output reaches the `serve run` terminal
        print(f"jaxray: cannot serve: {err}", file=sys.stderr, flush=True)
        raise


def deploy_failure(name: str) -> str:
    """Why Serve's application ``name`` failed to deploy, from ``serve.status()``: the application's
    and its deployments' status messages (a replica constructor's traceback among them); '' when
    there are none."""
    app = serve.status().applications.get(name)
    if app is None:
        return ""
    lines = [app.message] if app.message else []
    lines += [f"{d}: {status.message}" for d, status in app.deployments.items() if status.message]
    return "\n".join(lines)
