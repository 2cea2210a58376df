"""One Ray Serve replica: a compiled ``Engine`` for what ``build_app`` checked, Serve's batching
feeding the scheduler that merges batches into its rows, and ``routes.api`` over its ``RequestPath``."""

# No `from __future__ import annotations`: FastAPI and Serve read the route annotations at runtime.
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import jax
from ray import serve
from starlette.requests import Request as HttpRequest

from jaxray import checkpoint, storage
from jaxray.inference.engine import Request
from jaxray.inference.load import load_engine
from jaxray.inference.scheduler import Scheduler
from jaxray.serve import metrics, openai
from jaxray.serve.requests import RequestPath
from jaxray.serve.routes import api, body_schema, generate
from jaxray.serve.schema import GenerateRequest, GenerateResponse, Limits
from jaxray.serve.settings import AppArgs

logger = logging.getLogger("ray.serve")
MERGED_BATCHES = 16  # Serve batches in flight at once, merged by the scheduler


def pin_compute(cpus: int | None) -> list[int]:
    """Pin the calling thread and those it starts later (XLA's: jax-ml/jax#1539) to ``cpus`` CPUs (None:
    all but one); returns them sorted ([]: no affinity call). ValueError past the CPUs available."""
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
    """One replica. ``args`` as ``build_app`` resolves them; ``pin_cpus``: ``pin_compute(args.compute_cpus)``;
    ``checkpoint_sha256``: for a checkpoint, the SHA-256 of the ``train_state.json`` build_app checked."""

    def __init__(self, args: AppArgs, pin_cpus: bool = True, checkpoint_sha256: str | None = None):
        self.started, self.started_unix = time.monotonic(), time.time()
        self.replica = serve.get_replica_context().replica_id.unique_id
        cpus = pin_compute(args.compute_cpus) if pin_cpus else []  # before XLA starts its threads
        settings, source = args.engine, args.checkpoint
        if storage.is_uri(source) or checkpoint_sha256 is not None:  # what build_app checked, unless changed
            source = checkpoint.open(source, pinned=checkpoint_sha256)
        self.engine = load_engine(source, settings)
        report = self.engine.compile()
        message = "jaxray: compiled %d programs in %.1f s (buckets %s, batch sizes %s) for %s on %s"
        details = (self.engine.buckets, settings.batch_sizes, self.engine.source, jax.devices())
        logger.info(message, report["programs"], report["compile_s"], *details)
        model = (self.engine.config.vocab_size, self.engine.context_len, args.generation_timeout_s)
        self.limits = Limits(settings.max_new_tokens, settings.max_prompt_bytes, *model)
        batch, wait_ms = args.max_batch_size, args.batch_wait_ms
        self.batching = {"max_batch_size": batch, "batch_wait_ms": wait_ms, "compute_cpus": cpus}
        self._batch.set_max_batch_size(batch)
        self._batch.set_batch_wait_timeout_s(wait_ms / 1e3)
        self.scheduler = Scheduler(self.engine, batch)
        self.path = RequestPath(
            self.engine, self.scheduler, self.limits, args.served_model_name, self.started_unix, self._batch
        )
        if self.engine.prefix is not None:
            metrics.watch_prefix_cache(args.served_model_name, self.engine.prefix)

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok", "replica": self.replica, "up_s": round(time.monotonic() - self.started, 1)}

    @api.get("/info")
    async def info(self) -> dict[str, Any]:
        server = {**self.batching, "limits": vars(self.limits), "engine": self.scheduler.stats()}
        return {**self.engine.info(), "server": server}

    @api.post("/generate", response_model=GenerateResponse, openapi_extra=body_schema(GenerateRequest))
    async def generate(self, http: HttpRequest):
        return await generate(self.path, http)

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return openai.models(self.path)

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> dict[str, Any]:
        return openai.models(self.path, model_id)

    @api.post("/v1/completions", openapi_extra=body_schema(openai.CompletionRequest))
    async def completions(self, http: HttpRequest):
        return await openai.answer(self.path, http, openai.CompletionRequest)

    @api.post("/v1/chat/completions", openapi_extra=body_schema(openai.ChatRequest))
    async def chat(self, http: HttpRequest):
        return await openai.answer(self.path, http, openai.ChatRequest)

    # Several Serve batches may wait at once: the scheduler admits each into the running batch.
    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01, max_concurrent_batches=MERGED_BATCHES)
    async def _batch(self, requests: list[Request]) -> AsyncIterator[list]:
        """Each yield hands request i ``(tokens, done)``, then StopIteration (Serve's end of stream)."""
        remaining = [r.max_new_tokens for r in requests]
        async for step in self.scheduler.run(requests):
            yield [StopIteration if n <= 0 else (t, n - len(t) <= 0) for n, t in zip(remaining, step)]
            remaining = [n - len(t) for n, t in zip(remaining, step)]
