"""The HTTP side of the Serve app: the FastAPI app its routes hang on, and what they share.

Routes (the handlers are methods of ``jaxray.serve.app.JaxrayServer``, which holds the engine;
``jaxray.serve.schema`` has the request shapes and the error format):

  POST /generate         {"prompt", "max_new_tokens", "temperature", "top_k", "seed", "stream"}
                         -> {"text", "prompt_tokens", "new_tokens", "latency_ms"}, or with
                         "stream": true server-sent events ``data: {"text": ...}`` and a last
                         ``data: {"done": true, "prompt_tokens", "new_tokens", "latency_ms"}``
  POST /v1/completions   the OpenAI completions shape; streams OpenAI chunks and ``data: [DONE]``
  GET  /healthz          {"status": "ok", "replica": Serve's replica id, "up_s": seconds since it started}
  GET  /info             model config, checkpoint, engine settings, JAX devices, compile time

Here: ``api`` and its error handlers (every refusal, unknown routes and engine failures alike, in
the one JSON error shape), a body read that stops past its limit, the token streams turned into
text and into the two routes' server-sent events, and ``JsonErrors``, the middleware of Serve's
HTTP proxy that gives the proxy's own failures (a replica that died mid-request, a full queue, a
time-out) the same JSON error shape. No Ray and no JAX.
"""

# No `from __future__ import annotations`: FastAPI reads handler signatures at runtime.
import codecs
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest

from jaxray.serve.schema import ApiError, completion_object, sse

logger = logging.getLogger("ray.serve")
api = FastAPI(
    title="jaxray", description="Byte-level transformer text generation on Ray Serve", redirect_slashes=False
)  # /generate/ is a JSON 404, not a bodiless 307
ROUTES = "GET /healthz, GET /info, POST /generate, POST /v1/completions"
HEALTHZ_TIMEOUT_S = 5.0  # /healthz with no replica to answer it (one being replaced): 504 after this
TIMEOUT_HEADER = b"x-request-timeout-seconds"  # Serve's per-request time-out header
PROXY_STATUS = {408: 504}  # Serve's proxy answers a request time-out with 408: it is the server's
NO_ANSWER = (
    "the replica ended before answering (it failed or was stopped; Serve replaces a replica "
    "that died): retry the request"
)


@api.exception_handler(ApiError)
async def _refused(_: HttpRequest, err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


@api.exception_handler(HTTPException)
async def _no_route(http: HttpRequest, err: HTTPException) -> JSONResponse:
    # FastAPI's 404/405 as the same error shape as every other refusal.
    field = "method" if err.status_code == 405 else "path"
    message = f"{err.detail}: {http.method} {http.url.path}"
    return JSONResponse(ApiError(err.status_code, field, message, ROUTES).body(), status_code=err.status_code)


@api.exception_handler(Exception)
async def _failed(_: HttpRequest, err: Exception) -> JSONResponse:
    # A bug or an engine failure: still the JSON error shape (the replica itself stays up).
    logger.exception("jaxray: request failed")
    return JSONResponse(ApiError(500, "engine", f"{type(err).__name__}: {err}").body(), status_code=500)


def body_schema(model: type[BaseModel]) -> dict:
    """OpenAPI ``requestBody`` for a route that parses its body itself (see ``schema.parse``)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


async def read_body(http: HttpRequest, limit: int) -> bytes:
    """The request body, but stop reading once it is past ``limit`` bytes (``parse`` then refuses
    it with 413): a client cannot make the replica buffer an arbitrarily large body."""
    body = bytearray()
    async for part in http.stream():
        body += part
        if len(body) > limit:
            break
    return bytes(body)


async def decoded(chunks: AsyncIterator[list[int]]) -> AsyncIterator[str]:
    """Text pieces of a token stream. The incremental decoder holds back a character split across
    chunks (rather than emitting U+FFFD for each half); bytes that are not UTF-8 become U+FFFD."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    async for tokens in chunks:
        if text := decoder.decode(bytes(tokens)):
            yield text
    if tail := decoder.decode(b"", final=True):
        yield tail


async def _guarded(pieces: AsyncIterator[str]) -> AsyncIterator[str | bytes]:
    """``pieces``, then an SSE error event (bytes) if the engine fails mid-stream: the status line
    is already sent, so the error can only travel in the stream."""
    try:
        async for piece in pieces:
            yield piece
    except Exception as err:  # noqa: BLE001 - reported to the client and the log, the server stays up
        logger.exception("jaxray: generation failed mid-stream")
        yield b"event: error\n" + sse(ApiError(500, "engine", f"{type(err).__name__}: {err}").body())


async def drain(results: AsyncIterator) -> None:
    """Read ``results`` to its end, dropping the items."""
    async for _ in results:
        pass


class Counted:
    """Wraps a token-chunk stream and counts the tokens that went through it."""

    def __init__(self, chunks: AsyncIterator[list[int]]):
        self.chunks, self.count = chunks, 0

    async def __aiter__(self) -> AsyncIterator[list[int]]:
        async for tokens in self.chunks:
            self.count += len(tokens)
            yield tokens


async def generate_events(chunks: Counted, usage: dict, start: float) -> AsyncIterator[bytes]:
    """/generate's stream: ``{"text"}`` events, then ``{"done": true, **usage, "new_tokens",
    "latency_ms"}`` (since ``start``, a ``time.perf_counter()``), or the error event that ends it."""
    async for piece in _guarded(decoded(chunks)):
        if isinstance(piece, bytes):  # the error event ends the stream
            yield piece
            return
        yield sse({"text": piece})
    latency_ms = (time.perf_counter() - start) * 1e3
    yield sse({"done": True, **usage, "new_tokens": chunks.count, "latency_ms": latency_ms})


async def completion_events(chunks: Counted, completion_id: str, model_name: str) -> AsyncIterator[bytes]:
    """/v1/completions' stream: OpenAI chunks, a last empty one with finish_reason "length", then
    ``[DONE]``; or the error event that ends it."""
    async for piece in _guarded(decoded(chunks)):
        if isinstance(piece, bytes):  # the error event ends the stream
            yield piece
            return
        yield sse(completion_object(completion_id, model_name, piece, None, chunk=True))
    yield sse(completion_object(completion_id, model_name, "", "length", chunk=True))
    yield sse("[DONE]")


def _json_reply(status: int, message: str, headers: list | None = None) -> list[dict]:
    """The ASGI messages of a JSON error answer (``ApiError`` shape, field ``server``), keeping
    ``headers`` (such as Retry-After) but content type and length."""
    body = json.dumps(ApiError(status, "server", message).body()).encode()
    kept = [(k, v) for k, v in headers or [] if k.lower() not in (b"content-type", b"content-length")]
    kept += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return [
        {"type": "http.response.start", "status": status, "headers": kept},
        {"type": "http.response.body", "body": body},
    ]


def _rewritten(status: int, headers: list) -> bool:
    """Whether an answer is one of the proxy's own plain-text errors (5xx or its 408 time-out)."""
    content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
    return (status >= 500 or status in PROXY_STATUS) and not content_type.startswith(b"application/json")


class JsonErrors:
    """ASGI middleware for Serve's HTTP proxy (``http_options`` middlewares, or the
    ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` callback ``proxy_middlewares``).

    The replica answers every error in the JSON shape of ``jaxray.serve.schema.ApiError``; these
    come from the proxy itself, in plain text or not at all, and get that shape here (field
    ``server``): 503 with Retry-After when the queue is full (``max_queued_requests``), 504 for
    Serve's request time-out (its 408), and 500 when the replica died before answering (Serve
    sends nothing). ``/healthz`` gets a time-out of ``healthz_timeout_s`` (504 when no replica
    answers in time, e.g. while one is replaced). A stream already under way is left as it is.
    """

    def __init__(self, app, healthz_timeout_s: float = HEALTHZ_TIMEOUT_S):
        self.app, self.healthz_timeout_s = app, healthz_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/healthz":
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != TIMEOUT_HEADER]
            scope = {**scope, "headers": [*headers, (TIMEOUT_HEADER, str(self.healthz_timeout_s).encode())]}
        state: dict = {"started": False, "held": None}

        async def guarded(message: dict) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                if _rewritten(message["status"], message.get("headers", [])):
                    state["held"] = (message["status"], message.get("headers", []), bytearray())
                    return
            elif message["type"] == "http.response.body" and state["held"] is not None:
                status, headers, body = state["held"]
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    state["held"] = None
                    text = body.decode("utf-8", errors="replace").strip() or f"HTTP {status}"
                    for reply in _json_reply(PROXY_STATUS.get(status, status), text, headers):
                        await send(reply)
                return
            await send(message)

        try:
            await self.app(scope, receive, guarded)
        except Exception as err:  # noqa: BLE001 - answered as JSON when nothing was sent yet
            if state["started"]:
                raise
            logger.exception("jaxray: the proxy failed a request")
            for reply in _json_reply(500, f"{type(err).__name__}: {err}"):
                await send(reply)
            return
        if not state["started"] or state["held"] is not None:  # no answer, or one cut short
            status = state["held"][0] if state["held"] else 500
            for reply in _json_reply(PROXY_STATUS.get(status, status), NO_ANSWER):
                await send(reply)


def proxy_middlewares() -> list[Middleware]:
    """``[JsonErrors]``, for ``serve run`` (whose config file cannot name middlewares):
    ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=jaxray.serve.routes:proxy_middlewares``."""
    return [Middleware(JsonErrors)]
