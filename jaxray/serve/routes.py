"""The HTTP side of the Serve app: the FastAPI ``api``, its JSON error handlers, SSE streams and
``GET /``, the playground (``playground.html``: one self-contained page, no outside assets, streaming
``POST /generate``). Handlers are methods of ``jaxray.serve.replica.JaxrayServer``. No JAX."""

# No `from __future__ import annotations`: FastAPI reads handler signatures at runtime.
import logging
import time
from collections.abc import AsyncIterator
from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest

from jaxray.serve.schema import ApiError, GenerateRequest, GenerateResponse, sse

logger = logging.getLogger("ray.serve")
api = FastAPI(
    title="jaxray", description="Byte-level transformer text generation on Ray Serve", redirect_slashes=False
)  # /generate/ is a JSON 404, not a bodiless 307
ROUTES = (
    "GET / (the playground), GET /healthz, GET /info, POST /generate, GET /v1/models, "
    "GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions"
)
PAGE = files("jaxray.serve").joinpath("playground.html").read_text(encoding="utf-8")


@api.get("/", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(PAGE)


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
    content = {"application/json": {"schema": model.model_json_schema()}}
    return {"requestBody": {"required": True, "content": content}}


async def guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``events`` (SSE), ended by an error event if the engine fails or times out (ApiError) mid-stream."""
    try:
        async for event in events:
            yield event
    except ApiError as err:
        yield b"event: error\n" + sse(err.body())
    except Exception as err:  # noqa: BLE001 - reported to the client and the log, the server stays up
        logger.exception("jaxray: generation failed mid-stream")
        yield b"event: error\n" + sse(ApiError(500, "engine", f"{type(err).__name__}: {err}").body())


async def generate_events(choice, usage: dict, start: float) -> AsyncIterator[bytes]:
    """/generate's stream of ``choice``: ``{"text"}`` events, then ``{"done": true, **usage,
    "new_tokens", "latency_ms"}`` (``start``: ``time.perf_counter()`` at arrival)."""
    async for piece in choice.pieces():
        yield sse({"text": piece})
    latency_ms = (time.perf_counter() - start) * 1e3
    yield sse({"done": True, **usage, "new_tokens": choice.tokens, "latency_ms": latency_ms})


async def generate(path, http: HttpRequest):
    """``POST /generate`` through the replica's ``RequestPath``: one choice, as JSON (``GenerateResponse``)
    or, with ``stream``, SSE (``generate_events``)."""
    start = time.perf_counter()
    req, [choice], prompt_tokens = await path.choices(http, GenerateRequest)
    usage = {"prompt_tokens": prompt_tokens}
    if req.stream:
        events = guarded(generate_events(choice, usage, start))
        return StreamingResponse(events, media_type="text/event-stream")
    text = await choice.text()
    latency_ms = (time.perf_counter() - start) * 1e3
    return GenerateResponse(text=text, new_tokens=choice.tokens, **usage, latency_ms=latency_ms).model_dump()
