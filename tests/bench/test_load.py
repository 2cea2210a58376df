"""The serve load client (jaxray/bench/load.py) against a stand-in app with /generate's contract: what
it counts (answers, 5xx, dropped), and ``bench serve --url`` end to end in process. The stand-in is
never a benchmark; the real Serve app under load is tested in tests/integration."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections import Counter
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from jaxray.bench.__main__ import main
from jaxray.bench.load import Sample, events, run_level, send, summarize


def test_summarize_counts_the_window_share_and_excludes_warmups():
    samples = [
        Sample(-1.0, 0.0, "ok", 200, new_tokens=10, warmup=True, first_s=-0.9),  # warm-up: not counted
        Sample(0.0, 1.0, "ok", 200, new_tokens=10, first_s=0.1, gaps_s=(0.02, 0.04)),
        Sample(9.0, 11.0, "ok", 200, new_tokens=20, first_s=9.3),  # half inside: counts 0.5 and 10 tokens
        Sample(1.0, 1.5, "5xx", 500, error="HTTP 500: boom"),
        Sample(2.0, 2.1, "dropped", error="ServerDisconnectedError"),
        Sample(-0.5, -0.4, "4xx", 422, warmup=True),  # warm-up errors still count
        Sample(3.0, 3.2, "other", 200),
    ]
    row = summarize(samples, clients=4, start_s=0.0, end_s=10.0)
    assert (row["clients"], row["requests"], row["new_tokens"]) == (4, 2, 30)
    assert row["rps"] == pytest.approx(0.15) and row["new_tokens_per_s"] == pytest.approx(2.0)
    assert [row["p50_ms"], row["p95_ms"], row["p99_ms"]] == pytest.approx(
        np.percentile([1000.0, 2000.0], [50, 95, 99]).tolist()
    )
    assert [row["ttft_p50_ms"], row["ttft_p99_ms"]] == pytest.approx(
        np.percentile([100.0, 300.0], [50, 99]).tolist()
    )
    assert [row["itl_p50_ms"], row["itl_p99_ms"]] == pytest.approx(
        np.percentile([20.0, 40.0], [50, 99]).tolist()
    )
    assert (row["errors_4xx"], row["errors_5xx"], row["dropped"], row["errors_other"]) == (1, 1, 1, 1)
    assert row["first_error"] == "HTTP 500: boom"
    none = summarize([Sample(1.0, 1.5, "5xx", 500)], 1, 0.0, 10.0)
    assert none["ttft_p50_ms"] is None and none["ttft_p99_ms"] is None and none["p99_ms"] is None
    assert none["itl_p50_ms"] is None and none["itl_p99_ms"] is None
    with pytest.raises(ValueError, match="empty window"):
        summarize([], 1, 5.0, 5.0)


def test_events_parses_names_and_data_lines():
    async def parsed(chunks: list[bytes]) -> list[tuple[str, str]]:
        async def lines():
            for line in b"".join(chunks).splitlines(keepends=True):
                yield line

        return [e async for e in events(lines())]

    raw = [b'data: {"text": "a"}\r\n\r\n', b": comment\n", b"event: error\ndata: {\n", b"data: 1}\n\n"]
    assert asyncio.run(parsed(raw)) == [("message", '{"text": "a"}'), ("error", "{\n1}")]


def sse(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


class StandIn:
    """/generate with the app's contract: a JSON error, or (``"stream": true``) a text event after
    ``first_s``, another after ``rest_s``, then the done event. Request k (from 1) takes the first fault
    of ``faults`` {fault: n} with k % n == 0: "http_500" (a JSON 500), "cut" (the connection closed
    after the first text), "error_event" (the engine's error event instead of the rest) or "no_done"
    (the stream ends without its done event). /healthz and /v1/models as the app's."""

    def __init__(self, first_s: float = 0.005, rest_s: float = 0.02, **faults: int):
        self.first_s, self.rest_s, self.faults, self.seeds, self.streamed = first_s, rest_s, faults, [], []
        self.prompts: list[str] = []
        self.info_calls = 0

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seeds.append(body["seed"])
        self.streamed.append(body.get("stream"))
        self.prompts.append(body["prompt"])
        k = len(self.seeds)
        fault = next((f for f, n in self.faults.items() if k % n == 0), None)
        await asyncio.sleep(self.first_s)
        if fault == "http_500":
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"text": "x"}))
        if fault == "cut":
            request.transport.close()
            return resp
        await asyncio.sleep(self.rest_s)
        if fault == "error_event":
            await resp.write(b"event: error\n" + sse({"error": {"message": "engine failed", "code": 500}}))
        elif fault != "no_done":
            await resp.write(sse({"text": "y"}))
            done = {"done": True, "prompt_tokens": 6, "new_tokens": body["max_new_tokens"], "latency_ms": 1.0}
            await resp.write(sse(done))
        await resp.write_eof()
        return resp

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def info(self, request: web.Request) -> web.Response:
        """The app's engine counters: 10 decode calls of 3 rows each between two reads."""
        n, self.info_calls = self.info_calls, self.info_calls + 1
        engine = {"decode_calls": 10 * n, "rows_decoded": 30 * n, "admit_s": 0.0, "decode_s": 0.1 * n}
        return web.json_response({"server": {"engine": engine}})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/info", self.info)
        return app


def load_args(url: str, **more) -> SimpleNamespace:
    base = {"url": url, "prompt": "ROMEO:", "max_new_tokens": 8, "temperature": 0.8, "top_k": None, "seed": 0}
    base |= {"prompt_bytes": 0, "shared_bytes": 0, "long_clients": 0, "long_bytes": 1000}
    return SimpleNamespace(**(base | {"timeout": 10.0, "duration": 0.5} | more))


async def _against(stand_in: StandIn, clients: int, **more) -> dict:
    runner = web.AppRunner(stand_in.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        return await run_level(
            load_args(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", **more), clients
        )
    finally:
        await runner.cleanup()


def test_client_streams_and_times_the_first_token():
    stand_in = StandIn(first_s=0.005, rest_s=0.03)
    row = asyncio.run(_against(stand_in, clients=4))
    assert row["errors_4xx"] == row["errors_5xx"] == row["dropped"] == row["errors_other"] == 0
    assert len(stand_in.seeds) >= row["requests"] + 4 and row["requests"] > 4 and all(stand_in.streamed)
    assert len(set(stand_in.seeds)) == len(stand_in.seeds) and row["new_tokens"] == 8 * row["requests"]
    assert row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"] and row["client_cpu_pct"] >= 0
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] <= row["p99_ms"]
    assert row["ttft_p50_ms"] < row["p50_ms"]  # the first text comes 30 ms before the done event
    assert 0 < row["itl_p50_ms"] <= row["itl_p99_ms"] < row["p99_ms"]  # "x" then "y": one gap each
    assert row["rows_per_step"] == 3.0 and row["engine_busy_pct"] > 0  # from /info before and after


def test_long_prompt_clients_are_counted_apart_from_the_streams():
    stand_in = StandIn(first_s=0.005, rest_s=0.01)
    row = asyncio.run(_against(stand_in, clients=2, long_clients=1, long_bytes=50))
    long = [p for p in stand_in.prompts if len(p) == 50]
    short = [p for p in stand_in.prompts if p == "ROMEO:"]
    assert len(long) + len(short) == len(stand_in.prompts) and len(set(long)) == len(long) > 0
    assert row["long_requests"] == len(long) and row["long_errors"] == 0 and row["long_ttft_p50_ms"] > 0
    assert row["requests"] == len(short) - 2  # the streams' own, less their warm-ups


def test_client_counts_5xx_and_cut_streams_apart():
    stand_in = StandIn(cut=7, http_500=5)
    row = asyncio.run(_against(stand_in, clients=2))
    total = len(stand_in.seeds)
    assert row["dropped"] == total // 7 and row["errors_5xx"] == total // 5 - total // 35
    assert row["requests"] > 0 and row["errors_other"] == 0


def test_client_counts_an_error_event_as_5xx_and_a_stream_without_done_as_dropped():
    stand_in = StandIn(error_event=3, no_done=4)
    row = asyncio.run(_against(stand_in, clients=2))
    total = len(stand_in.seeds)
    assert row["errors_5xx"] == total // 3 and row["dropped"] == total // 4 - total // 12
    assert row["requests"] > 0 and row["errors_other"] == 0 and row["first_error"].startswith("error event")


def test_client_counts_a_refused_connection_as_dropped():
    with socket.socket() as s:  # bound, never listening
        s.bind(("127.0.0.1", 0))
        row = asyncio.run(run_level(load_args(f"http://127.0.0.1:{s.getsockname()[1]}", duration=0.3), 2))
    assert row["requests"] == 0 and row["dropped"] >= 2 and "Connect" in row["first_error"]


def test_client_counts_a_5xx_whose_body_is_cut_as_5xx():
    """A 503 whose promised body never comes (a replica killed between Serve's two messages): the
    status reached the client, so it is a prompt 5xx, not a dropped request."""

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 131\r\n\r\n")
        await writer.drain()
        writer.close()

    async def one() -> Sample:
        server = await asyncio.start_server(cut, "127.0.0.1", 0)
        async with server, aiohttp.ClientSession() as session:
            return await send(session, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", {})

    sample = asyncio.run(one())
    assert sample.outcome == "5xx" and sample.error == "HTTP 503", sample


def bench_serve(stand_in: StandIn, out, *argv: str) -> int:
    """``bench serve --url`` (in process) against ``stand_in`` served from a thread; its exit code."""
    loop, ready, stop = asyncio.new_event_loop(), threading.Event(), None

    async def serve():
        nonlocal stop
        runner = web.AppRunner(stand_in.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        serve.port, stop = site._server.sockets[0].getsockname()[1], asyncio.Event()
        ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    ready.wait(10)
    try:
        return main(["serve", "--url", f"http://127.0.0.1:{serve.port}", "--out", str(out), *argv])
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


def test_bench_serve_url_writes_the_report(tmp_path, capsys):
    out = tmp_path / "serve"
    code = bench_serve(StandIn(), out, "--clients", "1,16", "--duration", "0.5")
    assert code == 0, capsys.readouterr()
    doc = json.loads((out / "summary.json").read_text())
    summary = doc["summary"]
    assert [r["clients"] for r in doc["rows"]] == [1, 16] and summary["scaling_16_vs_1"] > 0
    rows = doc["rows"]
    assert all(r["requests"] > 0 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] <= r["p99_ms"] for r in rows)
    assert summary["model"] == "stand-in" and summary["max_clients"] == 16
    assert summary["ttft_p99_ms_at_max_clients"] == doc["rows"][1]["ttft_p99_ms"]
    assert not any("decode_calls" in r or "mean_rows" in r for r in doc["rows"])  # /info is not read
    md = (out / "summary.md").read_text()
    assert "| new tok/s |" in md and "| p99 ms | TTFT p50 ms | TTFT p99 ms |" in md and "stand-in" in md
    assert (out / "serve_new_tokens_per_s.png").stat().st_size > 0 and (out / "serve_p95_ms.png").is_file()
    assert (out / "serve_ttft_p99_ms.png").is_file()


def test_bench_serve_fails_on_an_error_event(tmp_path, capsys):
    code = bench_serve(StandIn(error_event=2), tmp_path / "serve", "--clients", "2", "--duration", "0.3")
    assert code == 1 and "failed: 2 clients" in capsys.readouterr().out


def test_bench_serve_compares_shared_prefixes_with_random_prompts(tmp_path, capsys):
    stand_in, out = StandIn(), tmp_path / "serve"
    argv = ["--clients", "1,2", "--duration", "0.3", "--prompt-bytes", "40", "--shared-bytes", "30"]
    assert bench_serve(stand_in, out, *argv) == 0, capsys.readouterr()
    doc = json.loads((out / "summary.json").read_text())
    assert [(r["clients"], r["shared"]) for r in doc["rows"]] == [
        (1, False),
        (1, True),
        (2, False),
        (2, True),
    ]
    assert [r["prompts"] for r in doc["rows"][:2]] == ["40 B random", "40 B, first 30 shared"]
    assert all(len(p) == 40 and p.isascii() for p in stand_in.prompts)
    heads = sorted(Counter(p[:30] for p in stand_in.prompts).values())  # random: each its own; shared: one
    assert heads[-1] > 4 and heads[:-1] == [1] * (len(heads) - 1)
    assert doc["summary"]["shared_ttft_p50_vs_random_1"] > 0 and doc["rows"][1]["ttft_p50_vs_random"] > 0
    assert doc["summary"]["scaling_16_vs_1"] is None and doc["summary"]["max_clients"] == 2
    assert bench_serve(StandIn(), out, "--clients", "1", "--prompt-bytes", "40", "--shared-bytes", "40") == 2


@pytest.mark.slow  # ~20 s: a trained model's engine under load: make test-all
def test_engine_load_runs_in_process_with_the_default_prefix_cache(trained_transformer, tmp_path):
    """``bench engine``: serve's closed-loop levels on the engine in this process (no HTTP, no Ray):
    every request answered with its tokens, TTFT and ITL, the batch filling with 4 clients, and prompts
    sharing 40 of 48 bytes reusing the default prefix cache (on for a 64-position model)."""
    out = tmp_path / "engine"
    argv = ["engine", "--checkpoint", trained_transformer, "--clients", "1,4", "--duration", "1",
            "--max-new-tokens", "8", "--prompt-bytes", "48", "--shared-bytes", "40", "--batch-sizes", "1,4",
            "--buckets", "16,64", "--prefix-block", "8", "--chunk", "4", "--out", out]  # fmt: skip
    assert main([str(a) for a in argv]) == 0
    doc = json.loads((out / "summary.json").read_text())
    assert [(r["clients"], r["shared"]) for r in doc["rows"]] == [
        (1, False),
        (1, True),
        (4, False),
        (4, True),
    ]
    for row in doc["rows"]:
        assert row["requests"] > 0 and row["errors_5xx"] == row["dropped"] == 0
        assert (
            0 < row["new_tokens"] <= 8 * row["requests"] and row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] > 0
        )
    assert doc["rows"][2]["rows_per_step"] > 1  # continuous batching: 4 clients share decode calls
    cache = doc["summary"]["prefix_cache"]
    assert cache["mib"] > 0 and cache["hit_tokens"] > 0 and doc["summary"]["shared_ttft_p50_vs_random_4"] > 0
