"""A replica's request path, shared by every route: an HTTP body read no further than its limit,
checked into ``n`` engine requests (seeds seed + i), each streaming its new tokens from the replica's
batch, recorded in the metrics. No JAX: the engine only checks a request and counts its prompt."""

# No `from __future__ import annotations`: kept like the route modules FastAPI reads.
import asyncio
import contextlib
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Callable
from functools import partial

from starlette.requests import Request as HttpRequest

from jaxray.inference.detokenize import Choice
from jaxray.inference.engine import Engine, Request
from jaxray.inference.scheduler import Scheduler
from jaxray.serve import metrics, schema
from jaxray.serve.schema import ApiError, Limits, parse

ENGINE_FIELDS = ("prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed")


async def drain(results: AsyncIterator, read: asyncio.Future | None = None) -> None:
    """Read ``results`` to its end after the read in flight, ``read``, dropping the items and an
    engine error (its other readers report it)."""
    if read is not None:
        await asyncio.wait([read])
        if not read.cancelled():
            read.exception()  # retrieved: a read whose reader left may end in an engine error
    with contextlib.suppress(Exception):
        async for _ in results:
            pass


@dataclasses.dataclass(eq=False)
class RequestPath:
    """What the routes need of a replica; ``choices`` turns a request body into ``Choice``s whose
    tokens come from ``batch`` (the replica's Serve-batched call: an engine request -> an async
    iterator of ``(tokens, done)``); ``scheduler`` frees the row of a request whose reader left."""

    engine: Engine
    scheduler: Scheduler
    limits: Limits
    model_name: str  # the served model's id
    started_unix: float  # when the replica started
    batch: Callable[[Request], AsyncIterator]
    _draining: set[asyncio.Task] = dataclasses.field(default_factory=set, init=False)  # held: not GC'd

    def check_model(self, model: str | None) -> None:
        """ApiError 404 unless ``model`` is None or the id served here."""
        if model is not None and model != self.model_name:
            message = f"the model {model!r} is not served here (GET /v1/models lists {self.model_name!r})"
            raise ApiError(404, "model", message, f"{self.model_name!r} or null")

    async def choices(self, http: HttpRequest, model: type[schema.SamplingRequest]) -> tuple:
        """(the ``model`` request in ``http``'s body, read no further than just past the limit that
        ``parse`` answers with 413; a ``Choice`` per engine request, ``n``, choice i seeded seed + i;
        the prompt tokens each reads). Raises ApiError naming the field."""
        arrived, body = time.monotonic(), bytearray()
        async for part in http.stream():
            body += part
            if len(body) > self.limits.max_body_bytes:
                break
        req = parse(model, bytes(body), self.limits)
        self.check_model(req.model)
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
        limit = self.limits.generation_timeout_s  # counted from the body's arrival
        deadline = None if limit is None else arrived + limit
        choices = [
            Choice(i, partial(self.tokens, r, model.route, deadline=deadline), req.stop)
            for i, r in enumerate(requests)
        ]
        return req, choices, self.engine.prompt_tokens(requests[0])

    async def tokens(
        self,
        request: Request,
        route: str,
        ended: Callable[[], str | None] = lambda: None,
        deadline: float | None = None,
    ) -> AsyncIterator[list[int]]:
        """A checked request's new tokens, a chunk at a time, as its batch produces them, recorded
        in the metrics of ``route`` from the first read; its end is "length" at the budget, else
        ``ended()`` when the reader closes it ("stop" at a stop sequence; None: "abort"). Raises
        ApiError 504 past ``deadline`` (``time.monotonic()`` s; None: none)."""
        timer = metrics.RequestTimer(route, self.model_name)
        results, prompt_tokens = self.batch(request), self.engine.prompt_tokens(request)
        # Each read is a task of its own, awaited through a shield: a reader cancelled mid-read (its
        # client left) must not cancel Serve's future, or Serve's batching orphans the next one
        # ("Future exception was never retrieved: StopAsyncIteration"); ``drain`` ends the read.
        read: asyncio.Future | None = None
        finished = False  # the stream ended: nothing left to cancel
        try:
            while True:
                read = asyncio.ensure_future(anext(results))
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    tokens, done = await asyncio.wait_for(asyncio.shield(read), left)
                except StopAsyncIteration:
                    finished = True
                    break
                except TimeoutError:  # ended below as a reader that left: its row freed
                    limit = self.limits.generation_timeout_s
                    message = (
                        f"not done {limit:g} s after it reached this replica (generation_timeout_s), "
                        "waiting for a row or generating: retry later or ask for fewer tokens"
                    )
                    raise ApiError(504, "generation_timeout_s", message) from None
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
