"""The serve load client (jaxray/bench/load.py) against a stand-in app with /generate's contract: what
it counts (answers, 5xx, dropped), and ``bench serve --url`` end to end in process. The stand-in is
never a benchmark; the real Serve app under load is tested in tests/integration."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from aiohttp import web

from jaxray.bench.__main__ import main
from jaxray.bench.load import Sample, run_level, summarize


def test_summarize_counts_the_window_share_and_excludes_warmups():
    samples = [
        Sample(-1.0, 0.0, "ok", 200, new_tokens=10, warmup=True),  # warm-up: no throughput, no latency
        Sample(0.0, 1.0, "ok", 200, new_tokens=10),
        Sample(9.0, 11.0, "ok", 200, new_tokens=20),  # half inside: counts 0.5 and 10 tokens
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
    assert (row["errors_4xx"], row["errors_5xx"], row["dropped"], row["errors_other"]) == (1, 1, 1, 1)
    assert row["first_error"] == "HTTP 500: boom"
    with pytest.raises(ValueError, match="empty window"):
        summarize([], 1, 5.0, 5.0)


class StandIn:
    """/generate after ``delay_s``; request k (from 1) answers 500 when k % fail_every == 0 and is cut
    off when k % drop_every == 0. /healthz and /info as the app's."""

    def __init__(self, delay_s: float = 0.01, fail_every: int = 0, drop_every: int = 0):
        self.delay_s, self.fail_every, self.drop_every, self.seeds = delay_s, fail_every, drop_every, []

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seeds.append(body["seed"])
        k = len(self.seeds)
        await asyncio.sleep(self.delay_s)
        if self.drop_every and k % self.drop_every == 0:
            request.transport.close()
            return web.Response()
        if self.fail_every and k % self.fail_every == 0:
            return web.Response(status=500, text="boom")
        return web.json_response({"text": "x", "new_tokens": body["max_new_tokens"], "latency_ms": 1.0})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def info(self, request: web.Request) -> web.Response:
        n = len(self.seeds)
        return web.json_response({"server": {"engine": {"decode_calls": n, "rows_decoded": 2 * n}}})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/info", self.info)
        app.router.add_get("/healthz", self.healthz)
        return app


def load_args(url: str, **more) -> SimpleNamespace:
    base = {"url": url, "prompt": "ROMEO:", "max_new_tokens": 8, "temperature": 0.8, "top_k": None, "seed": 0}
    return SimpleNamespace(**(base | {"timeout": 10.0, "duration": 0.5} | more))


async def _against(stand_in: StandIn, clients: int) -> dict:
    runner = web.AppRunner(stand_in.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        return await run_level(
            load_args(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"), clients
        )
    finally:
        await runner.cleanup()


def test_client_counts_answers_with_a_seed_each():
    stand_in = StandIn()
    row = asyncio.run(_against(stand_in, clients=4))
    assert row["errors_4xx"] == row["errors_5xx"] == row["dropped"] == row["errors_other"] == 0
    assert len(stand_in.seeds) >= row["requests"] + 4 and row["requests"] > 4
    assert len(set(stand_in.seeds)) == len(stand_in.seeds) and row["new_tokens"] == 8 * row["requests"]
    assert row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"] and row["client_cpu_pct"] >= 0


def test_client_counts_5xx_and_dropped_connections_apart():
    stand_in = StandIn(fail_every=5, drop_every=7)
    row = asyncio.run(_against(stand_in, clients=2))
    total = len(stand_in.seeds)
    assert (
        row["dropped"] == total // 7 and row["errors_5xx"] == total // 5 - total // 35 and row["requests"] > 0
    )


def test_client_counts_a_refused_connection_as_dropped():
    with socket.socket() as s:  # bound, never listening
        s.bind(("127.0.0.1", 0))
        row = asyncio.run(run_level(load_args(f"http://127.0.0.1:{s.getsockname()[1]}", duration=0.3), 2))
    assert row["requests"] == 0 and row["dropped"] >= 2 and "Connect" in row["first_error"]


def test_bench_serve_url_writes_the_report(tmp_path, capsys):
    loop, ready, stop = asyncio.new_event_loop(), threading.Event(), None

    async def serve():
        nonlocal stop
        runner = web.AppRunner(StandIn().app())
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
    out = tmp_path / "serve"
    try:
        url = f"http://127.0.0.1:{serve.port}"
        code = main(["serve", "--url", url, "--clients", "1,16", "--duration", "0.5", "--out", str(out)])
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
    assert code == 0, capsys.readouterr()
    doc = json.loads((out / "summary.json").read_text())
    assert [r["clients"] for r in doc["rows"]] == [1, 16] and doc["summary"]["scaling_16_vs_1"] > 0
    assert all(r["requests"] > 0 and r["decode_calls"] > 0 and r["mean_rows"] == 2 for r in doc["rows"])
    assert "| new tok/s |" in (out / "summary.md").read_text()
    assert (out / "serve_new_tokens_per_s.png").stat().st_size > 0 and (out / "serve_p95_ms.png").is_file()
