"""``JsonErrors``, the middleware of Serve's HTTP proxy, in front of a real uvicorn server on
loopback and real HTTP: the proxy's own plain-text failures and a request that got no answer at
all come back in the replica's JSON error shape, with Retry-After kept; answers that are already
JSON, and streams, pass unchanged; /healthz gets its short time-out header; a request waiting for
a replica when python -m jaxray.serve reports the app failed gets a JSON 503 with the cause."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import requests
import uvicorn

from jaxray.serve.routes import HEALTHZ_TIMEOUT_S, NO_ANSWER, TIMEOUT_HEADER, JsonErrors


async def _plain(send, status: int, text: bytes, headers: list | None = None) -> None:
    head = [(b"content-type", b"text/plain; charset=utf-8"), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": text})


async def proxy_like(scope, receive, send) -> None:
    """Answers as Serve's proxy does in each fault, by path."""
    path = scope["path"]
    if path == "/full":  # max_queued_requests exceeded
        await _plain(send, 503, b"Request dropped due to backpressure.", [(b"retry-after", b"1")])
    elif path == "/late":  # request_timeout_s passed
        await _plain(send, 408, b"Request 1f2e timed out after 60.0s.")
    elif path == "/died":  # the replica died mid-request: Serve sends nothing
        return
    elif path == "/raises":
        raise RuntimeError("proxy bug")
    elif path == "/waits":  # no replica to take it (one being replaced)
        await asyncio.sleep(3600)
    elif path == "/healthz":
        headers = dict(scope["headers"])
        body = json.dumps({"timeout": headers.get(TIMEOUT_HEADER, b"").decode()}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})
    elif path == "/refused":  # the replica's own JSON error
        body = b'{"error": {"field": "prompt"}}'
        await send(
            {
                "type": "http.response.start",
                "status": 500,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})
    else:  # a stream
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def url():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = JsonErrors(proxy_like)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _error(response: requests.Response) -> dict:
    assert response.headers["content-type"] == "application/json", response.text
    return response.json()["error"]


def test_a_full_queue_is_a_json_503_with_retry_after(url):
    response = requests.get(url + "/full", timeout=10)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    error = _error(response)
    assert error["field"] == "server" and "backpressure" in error["message"]


def test_the_proxy_time_out_is_a_json_504(url):
    response = requests.get(url + "/late", timeout=10)
    assert response.status_code == 504 and "timed out after 60.0s" in _error(response)["message"]


@pytest.mark.parametrize("path", ["/died", "/raises"])
def test_no_answer_is_a_json_500(url, path):
    response = requests.post(url + path, data=b"{}", timeout=10)
    assert response.status_code == 500
    message = _error(response)["message"]
    assert message == NO_ANSWER if path == "/died" else "RuntimeError: proxy bug" in message


def test_json_answers_and_streams_pass_unchanged(url):
    refused = requests.get(url + "/refused", timeout=10)
    assert refused.status_code == 500 and refused.json() == {"error": {"field": "prompt"}}
    stream = requests.get(url + "/stream", timeout=10, stream=True)
    assert stream.status_code == 200 and stream.content == b"data: 1\n\ndata: 2\n\n"


def test_healthz_gets_its_short_time_out_whatever_the_client_sends(url):
    for headers in ({}, {"x-request-timeout-seconds": "0"}):
        answer = requests.get(url + "/healthz", headers=headers, timeout=10).json()
        assert answer == {"timeout": str(HEALTHZ_TIMEOUT_S)}
