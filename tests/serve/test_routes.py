"""The routes' HTTP side without a server: /generate's server-sent events end with their summary,
or with an error event when the engine fails mid-stream."""

from __future__ import annotations

import asyncio
import json
import time

from jaxray.inference.detokenize import Choice
from jaxray.serve.routes import generate_events, guarded


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
