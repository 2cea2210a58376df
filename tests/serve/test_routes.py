"""The routes' HTTP side without a server: /generate's server-sent events end with their summary,
or with an error event when the engine fails or the generation times out mid-stream."""

from __future__ import annotations

import asyncio
import json
import time

import jax
import pytest
from starlette.requests import Request as HttpRequest

from jaxray.config import ModelConfig
from jaxray.inference.detokenize import Choice
from jaxray.inference.engine import Engine, Request
from jaxray.inference.scheduler import Scheduler
from jaxray.inference.settings import EngineSettings
from jaxray.models import build
from jaxray.serve.requests import RequestPath
from jaxray.serve.routes import generate_events, guarded
from jaxray.serve.schema import GenerateRequest, Limits


async def tokens(*chunks: bytes, fail: Exception | None = None):
    """A token-chunk stream as the engine gives it (byte values), optionally failing at its end."""
    for chunk in chunks:
        yield list(chunk)
    if fail is not None:
        raise fail


async def gathered(stream) -> list:
    return [item async for item in stream]


def events(raw: list[bytes]) -> list:
    """The data of each server-sent event (JSON parsed where it is JSON)."""
    out = []
    for event in raw:
        data = event.decode().split("data: ", 1)[1].rstrip("\n")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_generate_events_end_with_the_summary():
    choice = Choice(0, lambda ended: tokens(b"RO", b"MEO"), [])  # /generate's: no stop
    raw = asyncio.run(gathered(generate_events(choice, {"prompt_tokens": 3}, time.perf_counter())))
    *texts, done = events(raw)
    assert texts == [{"text": "RO"}, {"text": "MEO"}]
    assert done["done"] is True and done["prompt_tokens"] == 3 and done["new_tokens"] == 5
    assert done["latency_ms"] >= 0


def test_an_engine_failure_mid_stream_ends_it_with_an_error_event():
    async def failing():
        yield b"data: {}\n\n"
        raise RuntimeError("device lost")

    raw = asyncio.run(gathered(guarded(failing())))
    assert raw[-1].startswith(b"event: error\n") and len(raw) == 2  # the stream ends at the error
    error = events(raw[-1:])[0]["error"]
    assert error["field"] == "engine" and error["message"] == "RuntimeError: device lost"


@pytest.mark.slow  # ~11 s: an engine compiled, a 2 s timeout waited out: make test-all
def test_a_generation_past_its_timeout_ends_in_a_504_event_and_frees_its_row():
    """A stream still generating at ``generation_timeout_s`` ends with an error event (not cut bare, as
    Serve's proxy would at request_timeout_s) and its request leaves the running batch. The real
    engine and scheduler; each chunk reaches the route 200 ms late, as from a slow device."""
    model = build(ModelConfig(workload="transformer", width=32, num_layers=1, num_heads=2, max_seq_len=32))
    settings = EngineSettings(buckets=(8,), batch_sizes=(1,), chunk=4, max_new_tokens=64)
    engine = Engine.for_model(model, model.init(jax.random.key(0)), settings)
    engine.compile()
    scheduler = Scheduler(engine, 1)

    async def batch(request):  # the replica's Serve batch of one request
        async for [tokens] in scheduler.run([request]):
            await asyncio.sleep(0.2)
            yield tokens, False

    async def run():
        limits = Limits(64, 1024, generation_timeout_s=2.0)
        path = RequestPath(engine, scheduler, limits, "jaxray", 0.0, batch)
        async for _ in batch(Request(b"KING:", 4, 0.0)):  # the scheduler's first run starts its thread
            pass
        body = json.dumps({"prompt": "ROMEO:", "max_new_tokens": 64, "temperature": 0, "stream": True})

        async def receive():
            return {"type": "http.request", "body": body.encode(), "more_body": False}

        http = HttpRequest({"type": "http", "method": "POST", "path": "/generate", "headers": []}, receive)
        _, [choice], _ = await path.choices(http, GenerateRequest)  # the clock starts at the body
        raw = await gathered(guarded(generate_events(choice, {"prompt_tokens": 6}, time.perf_counter())))
        await asyncio.sleep(0.3)  # the background drain ends the request's stream
        return raw

    raw = asyncio.run(run())
    assert raw[-1].startswith(b"event: error\n") and all(not r.startswith(b"event") for r in raw[:-1])
    error = events(raw[-1:])[0]["error"]
    assert (error["code"], error["type"], error["param"]) == (504, "timeout", "generation_timeout_s")
    received = sum(len(e["text"]) for e in events(raw[:-1]))
    assert 0 < received < 64 and scheduler.batcher.live == 0
