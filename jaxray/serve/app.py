"""The Ray Serve deployment: replicas each holding a compiled ``Engine`` behind ``routes.api``, and
``app_builder`` (``serve run serve/config.yaml``, ``python -m jaxray.serve``), which checks the
weights before anything is deployed."""

# No `from __future__ import annotations`: FastAPI and Serve read the route annotations at runtime.
import asyncio
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import ray
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig
from starlette.requests import Request as HttpRequest

from jaxray import checkpoint
from jaxray.checkpoint import remote
from jaxray.inference.artifact_loader import read_artifact_manifest
from jaxray.inference.detokenize import Choice
from jaxray.inference.engine import Request
from jaxray.inference.load import check_source, describe_source, is_artifact, load_engine
from jaxray.inference.scheduler import Scheduler
from jaxray.serve import metrics, openai, playground, schema  # noqa: F401 - playground registers GET /
from jaxray.serve.routes import api, body_schema, drain, generate_events, guarded
from jaxray.serve.schema import ApiError, GenerateRequest, GenerateResponse, Limits, parse
from jaxray.serve.settings import AppArgs, args_error, with_checkpoint

logger = logging.getLogger("ray.serve")
ENGINE_FIELDS = ("prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed")
MERGED_BATCHES = 16  # Serve batches in flight at once, merged by the scheduler
# Deployment options for short faults (see docs/serving.md).
CONSTRUCTOR_TRIES = 1  # a replica whose __init__ raises fails the deploy at once, with its exception
HEALTH_CHECK_PERIOD_S = 2.0  # how often Serve checks the replica: a dead one is noticed this soon
RETRY_AFTER_S = 1  # the Retry-After of a 503 for a full queue
SHUTDOWN_WAIT_S = 0.5  # a stopping replica checks this often whether its requests are done ...
SHUTDOWN_TIMEOUT_S = 3.0  # ... and is killed after this


def pin_compute(cpus: int | None) -> list[int]:
    """Pin the calling thread (and threads it starts later, XLA's among them: jax-ml/jax#1539) to
    ``cpus`` CPUs (None: all but one); returns them sorted, [] where the OS has no affinity call.
    Raises ValueError when ``cpus`` exceeds the CPUs available."""
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
    """One replica: the engine, its compiled programs, and the HTTP routes over them. ``args`` as
    ``build_app`` resolves them (the checkpoint found, ``max_batch_size`` <= max(engine.batch_sizes));
    ``pin_cpus``: pin the compute threads (``pin_compute(args.compute_cpus)``); ``checkpoint_sha256``:
    for a checkpoint, the SHA-256 of the ``train_state.json`` that ``build_app`` checked."""

    def __init__(self, args: AppArgs, pin_cpus: bool = True, checkpoint_sha256: str | None = None):
        self.started, self.started_unix = time.monotonic(), time.time()
        self.replica = serve.get_replica_context().replica_id.unique_id
        cpus = pin_compute(args.compute_cpus) if pin_cpus else []  # before XLA starts its threads
        settings = args.engine
        source = args.checkpoint
        if remote.is_uri(source):  # fetched into this node's cache: the checkpoint checked, or none
            source = remote.open_uri(source, checkpoint_sha256)
        elif checkpoint_sha256 is not None:  # the folder build_app verified, unless it changed since
            source = checkpoint.trusted(source, checkpoint_sha256)
        self.engine = load_engine(source, settings)
        report = self.engine.compile()
        logger.info(
            "jaxray: compiled %d programs in %.1f s (buckets %s, batch sizes %s) for %s on %s",
            report["programs"],
            report["compile_s"],
            self.engine.buckets,
            settings.batch_sizes,
            remote.source(source),
            jax.devices(),
        )
        self.model_name = args.served_model_name
        self.limits = Limits(
            settings.max_new_tokens, settings.max_prompt_bytes, self.engine.config.vocab_size
        )
        batch, wait_ms = args.max_batch_size, args.batch_wait_ms
        self.batching = {"max_batch_size": batch, "batch_wait_ms": wait_ms, "compute_cpus": cpus}
        self._batch.set_max_batch_size(batch)
        self._batch.set_batch_wait_timeout_s(wait_ms / 1e3)
        self.scheduler = Scheduler(self.engine, batch)
        self._draining: set[asyncio.Task] = set()  # keeps drain tasks from being collected

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok", "replica": self.replica, "up_s": round(time.monotonic() - self.started, 1)}

    @api.get("/info")
    async def info(self) -> dict[str, Any]:
        server = {**self.batching, "limits": vars(self.limits), "engine": self.scheduler.stats()}
        return {**self.engine.info(), "server": server}

    @api.post("/generate", response_model=GenerateResponse, openapi_extra=body_schema(GenerateRequest))
    async def generate(self, http: HttpRequest):
        start = time.perf_counter()
        req, [choice], prompt_tokens = await self.choices(http, GenerateRequest)
        usage = {"prompt_tokens": prompt_tokens}
        if req.stream:
            events = guarded(generate_events(choice, usage, start))
            return StreamingResponse(events, media_type="text/event-stream")
        text = await choice.text()
        return GenerateResponse(
            text=text, new_tokens=choice.tokens, **usage, latency_ms=(time.perf_counter() - start) * 1e3
        ).model_dump()

    # The OpenAI surface (jaxray.serve.openai): each route hands the request to its function there.
    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return openai.models(self)

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> dict[str, Any]:
        return openai.models(self, model_id)

    @api.post("/v1/completions", openapi_extra=body_schema(openai.CompletionRequest))
    async def completions(self, http: HttpRequest):
        return await openai.answer(self, http, openai.CompletionRequest)

    @api.post("/v1/chat/completions", openapi_extra=body_schema(openai.ChatRequest))
    async def chat(self, http: HttpRequest):
        return await openai.answer(self, http, openai.ChatRequest)

    async def choices(self, http: HttpRequest, model: type[schema.SamplingRequest]) -> tuple:
        """(the ``model`` request in ``http``'s body, read no further than just past the limit that
        ``parse`` answers with 413; a ``Choice`` per engine request, ``n``, choice i seeded seed + i;
        the prompt tokens each reads). Raises ApiError naming the field."""
        body = bytearray()
        async for part in http.stream():
            body += part
            if len(body) > self.limits.max_body_bytes:
                break
        req = parse(model, bytes(body), self.limits)
        openai.check_model(self, req.model)
        prompt = schema.prompt_bytes(model, req, self.limits)
        seed = secrets.randbelow(schema.MAX_SEED + 1) if req.seed is None else req.seed
        budget = req.new_tokens(self.limits)
        seeds = [(seed + i) % (schema.MAX_SEED + 1) for i in range(req.n)]
        requests = [Request(prompt, budget, req.temperature, req.top_k, s, req.top_p) for s in seeds]
        try:  # the n requests differ only in their (wrapped) seeds
            self.engine.check(requests[0])
        except ValueError as err:
            field = next((f for f in ENGINE_FIELDS if str(err).startswith(f)), "body")
            field = {"max_new_tokens": model.budget_field, "prompt": model.prompt_field}.get(field, field)
            raise ApiError(400, field, str(err), schema.allowed(model, field, self.limits)) from None
        choices = [Choice(i, partial(self.tokens, r, model.route), req.stop) for i, r in enumerate(requests)]
        return req, choices, self.engine.prompt_tokens(requests[0])

    async def tokens(
        self, request: Request, route: str, ended: Callable[[], str | None] = lambda: None
    ) -> AsyncIterator[list[int]]:
        """A checked request's new tokens, a chunk at a time, as its batch produces them, recorded
        in the metrics of ``route`` from the first read; its end is "length" at the budget, else
        ``ended()`` when the reader closes it ("stop" at a stop sequence; None: "abort")."""
        timer = metrics.request_started(route, self.model_name)
        results, prompt_tokens = self._batch(request), self.engine.prompt_tokens(request)
        # Each read is a task of its own, awaited through a shield: a reader cancelled mid-read (its
        # client left) must not cancel Serve's future, or Serve's batching orphans the next one
        # ("Future exception was never retrieved: StopAsyncIteration"); ``drain`` ends the read.
        read: asyncio.Future | None = None
        finished = False  # the stream ended: nothing left to cancel
        try:
            while True:
                read = asyncio.ensure_future(anext(results))
                try:
                    tokens, done = await asyncio.shield(read)
                except StopAsyncIteration:
                    finished = True
                    break
                if tokens:
                    timer.tokens(len(tokens))
                    yield tokens
                if done:
                    finished = True
                    timer.finish(prompt_tokens, "length")
                    return
        finally:
            timer.finish(prompt_tokens, ended())  # a no-op once finished
            # A reader that stopped first frees the request's row; one still in Serve's queue is
            # dropped from it by cancelling its read (Serve leaves cancelled requests out of batches).
            if not finished and not self.scheduler.cancel(request) and read is not None:
                read.cancel()
            # Serve ends the stream only at the batch's next yield: drain it in the background.
            task = asyncio.get_running_loop().create_task(drain(results, read))
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)

    # Several Serve batches may wait at once: the scheduler admits each into the running batch.
    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01, max_concurrent_batches=MERGED_BATCHES)
    async def _batch(self, requests: list[Request]) -> AsyncIterator[list]:
        """Each yield hands request i ``(tokens, done)``, then StopIteration (Serve's end of stream)."""
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


def deployment(args: AppArgs) -> serve.Deployment:
    """``JaxrayServer`` with the options of ``args`` (``num_replicas``, or ``autoscaling_config`` checked
    as Ray's ``AutoscalingConfig``: ValueError naming a bad key) and those that keep faults short."""
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
    uri = remote.is_uri(args.checkpoint)  # fetched here to check it, by each replica to serve it
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
    # Replicas get the checkpoint resolved here, so a replacement serves the same one (a URI: each
    # replica fetches it into its node's cache, and refuses it if it changed since this check).
    source = check_source(path, args.engine)
    print(describe_source(source), file=sys.stderr, flush=True)  # which one, in the terminal
    # Weights checked without a restore: a checkpoint's SHA-256 digests once, here (check_source;
    # the replicas take it by its train_state.json's digest); an artifact is loaded, unless exported
    # for another platform (then left to the replica).
    if (
        is_artifact(source)
        and jax.export.default_export_platform() in read_artifact_manifest(source)["platforms"]
    ):
        load_engine(source, args.engine)  # only the check is wanted: the replica loads its own
    # Replicas on one node would all pin the same CPUs: more than one runs unpinned, unless asked.
    pin = args.compute_cpus is not None or (args.autoscaling_config is None and args.num_replicas == 1)
    fetched = remote.source(source)  # a URI, or a run folder whose best checkpoint is on storage
    remote_source = uri or remote.is_uri(fetched)
    resolved = args.checkpoint if uri else fetched if remote_source else str(source)
    pinned = None if is_artifact(source) else remote.manifest_sha256(source)
    return server.bind(
        args.model_copy(update={"checkpoint": resolved, "max_batch_size": max_batch}), pin, pinned
    )


def app_builder(args: dict[str, Any]) -> Application:
    """``import_path`` for ``serve run``: validates ``args`` (AppArgs, ``with_checkpoint``) and builds
    the app. Raises ValueError naming the bad argument, CheckpointError / ArtifactError the file."""
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
