"""The HTTP side of the Serve app: the FastAPI ``api``, its JSON error handlers, body reads, SSE
streams, and ``JsonErrors`` (Serve's proxy middleware). Handlers are methods of
``jaxray.serve.app.JaxrayServer``; shapes in ``jaxray.serve.schema``. No Ray and no JAX."""

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

from jaxray.serve.metrics import count_requests
from jaxray.serve.schema import ApiError, sse

logger = logging.getLogger("ray.serve")
api = FastAPI(
    title="jaxray", description="Byte-level transformer text generation on Ray Serve", redirect_slashes=False
)  # /generate/ is a JSON 404, not a bodiless 307
count_requests(api)  # requests by route, method and status, in Ray's metrics
ROUTES = (
    "GET / (the playground), GET /healthz, GET /info, POST /generate, GET /v1/models, "
    "POST /v1/completions, POST /v1/chat/completions"
)
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
    field = "method" if err.status_code == 405 else "path"
    message = f"{err.detail}: {http.method} {http.url.path}"
    return JSONResponse(ApiError(err.status_code, field, message, ROUTES).body(), status_code=err.status_code)


@api.exception_handler(Exception)
async def _failed(_: HttpRequest, err: Exception) -> JSONResponse:
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
    """The request body, read no further than just past ``limit`` bytes (``parse`` answers 413)."""
    body = bytearray()
    async for part in http.stream():
        body += part
        if len(body) > limit:
            break
    return bytes(body)


async def decoded(chunks: AsyncIterator[list[int]]) -> AsyncIterator[str]:
    """Text pieces of a token stream; bytes that are not UTF-8 become U+FFFD."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    async for tokens in chunks:
        if text := decoder.decode(bytes(tokens)):
            yield text
    if tail := decoder.decode(b"", final=True):
        yield tail


async def guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``events``, then an SSE error event if the engine fails mid-stream (which ends it)."""
    async for event in _guarded(events):
        yield event


async def _guarded(pieces: AsyncIterator[str]) -> AsyncIterator[str | bytes]:
    """``pieces``, then an SSE error event (bytes) if the engine fails mid-stream."""
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
    """/generate's stream: ``{"text"}`` events, then ``{"done": true, **usage, ...}``, or an error."""
    async for piece in _guarded(decoded(chunks)):
        if isinstance(piece, bytes):  # the error event ends the stream
            yield piece
            return
        yield sse({"text": piece})
    latency_ms = (time.perf_counter() - start) * 1e3
    yield sse({"done": True, **usage, "new_tokens": chunks.count, "latency_ms": latency_ms})


def _json_reply(status: int, message: str, headers: list | None = None) -> list[dict]:
    """ASGI messages of a JSON error answer (field ``server``), keeping ``headers`` such as Retry-After."""
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
    """ASGI middleware for Serve's proxy: its own errors as JSON ``ApiError`` (field ``server``):
    503 for a full queue, 504 for a time-out (Serve's 408), 500 for a replica that died.
    ``/healthz`` times out after ``healthz_timeout_s``; a stream under way is left as it is."""

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
    """``[JsonErrors]``, for ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``."""
    return [Middleware(JsonErrors)]
