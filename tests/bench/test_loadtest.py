"""The HTTP load-test client (jaxray/bench/loadtest.py): its statistics, its argument checks, and
what it counts against a stand-in server.

The aiohttp server here is a stand-in with the /generate contract, used only to check what the
client counts (answers, 5xx, dropped connections); it is never a benchmark. The real Serve app
under load is tested end to end elsewhere."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
from aiohttp import web

from jaxray.bench import loadtest
from jaxray.bench.loadtest import LoadSettings, Sample, summarize


def test_summarize_counts_the_window_share_and_excludes_warmups():
    samples = [
        Sample(-1.0, 0.0, "ok", 200, new_tokens=10, warmup=True),  # warm-up: no throughput, no latency
        Sample(0.0, 1.0, "ok", 200, new_tokens=10),  # wholly inside
        Sample(9.0, 11.0, "ok", 200, new_tokens=20),  # half inside: counts 0.5 and 10 tokens
        Sample(1.0, 1.5, "5xx", 500, error="HTTP 500: boom"),
        Sample(2.0, 2.1, "dropped", error="ServerDisconnectedError"),
        Sample(-0.5, -0.4, "4xx", 422, warmup=True),  # warm-up errors still count
        Sample(3.0, 3.2, "other", 200),
    ]
    row = summarize(samples, clients=4, start_s=0.0, end_s=10.0)
    assert row["clients"] == 4 and row["duration_s"] == 10.0 and row["requests"] == 2
    assert row["rps"] == pytest.approx(1.5 / 10) and row["new_tokens"] == 30
    assert row["new_tokens_per_s"] == pytest.approx((10 + 0.5 * 20) / 10)
    expected = np.percentile([1000.0, 2000.0], [50, 95, 99])
    assert [row["p50_ms"], row["p95_ms"], row["p99_ms"]] == pytest.approx(expected.tolist())
    assert row["mean_ms"] == pytest.approx(1500.0)
    assert (row["errors_4xx"], row["errors_5xx"], row["dropped"], row["errors_other"]) == (1, 1, 1, 1)
    assert row["first_error"] == "HTTP 500: boom"


def test_summarize_without_answers_has_no_latency():
    row = summarize([Sample(0.0, 0.1, "dropped", error="refused")], 1, 0.0, 5.0)
    assert row["requests"] == 0 and row["rps"] == 0.0 and row["p95_ms"] is None and row["dropped"] == 1
    with pytest.raises(ValueError, match="empty window"):
        summarize([], 1, 5.0, 5.0)


@pytest.mark.parametrize(
    "status, outcome",
    [(200, "ok"), (204, "ok"), (404, "4xx"), (429, "4xx"), (500, "5xx"), (503, "5xx"), (302, "other")],
)
def test_outcome_of(status, outcome):
    assert loadtest.outcome_of(status) == outcome


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("url", "localhost:8000", "bad --url"),
        ("url", "http://127.0.0.1:8000/generate", "no path"),
        ("url", "http://127.0.0.1:99999", "bad --url"),
        ("clients", (1, 1), "distinct"),
        ("clients", (), "distinct"),
        ("duration_s", 0.0, "duration_s"),
        ("timeout_s", float("inf"), "timeout_s"),
        ("max_new_tokens", 0, "max_new"),
        ("prompt", "", "prompt"),
        ("temperature", -1.0, "temperature"),
        ("top_k", 0, "top_k"),
        ("seed", 2**32, "seed"),
    ],
)
def test_settings_reject_bad_values(field, value, message):
    kwargs = {"url": "http://127.0.0.1:8000", field: value}
    with pytest.raises(ValueError, match=message):
        LoadSettings(**kwargs)


def test_payload_gives_each_request_its_seed():
    s = LoadSettings(url="http://127.0.0.1:8000", top_k=5)
    assert s.payload(2**32 + 3) == {
        "prompt": "ROMEO:",
        "max_new_tokens": 64,
        "temperature": 0.8,
        "seed": 3,
        "top_k": 5,
    }
    assert "top_k" not in LoadSettings(url="http://127.0.0.1:8000").payload(0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--clients", "1,4"], "--url"),
        (["--url", "ftp://x:1"], "--url"),
        (["--url", "http://127.0.0.1:8000", "--clients", "0"], "--clients"),
        (["--url", "http://127.0.0.1:8000", "--clients", "4,4"], "listed twice"),
        (["--url", "http://127.0.0.1:8000", "--duration", "-1"], "--duration"),
        (["--url", "http://127.0.0.1:8000", "--temperature", "nan"], "--temperature"),
        (["--url", "http://127.0.0.1:8000", "--prompt", ""], "--prompt"),
    ],
)
def test_loadtest_cli_rejects_bad_input(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        loadtest.main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


class StandIn:
    """A /generate stand-in: answers after ``delay_s`` with new_tokens = max_new_tokens; request k
    (counted from 1, warm-ups included) answers 500 when k % fail_every == 0 and is cut off (the
    connection closed without an answer) when k % drop_every == 0."""

    def __init__(self, delay_s: float = 0.02, fail_every: int = 0, drop_every: int = 0):
        self.delay_s, self.fail_every, self.drop_every, self.seen, self.seeds = (
            delay_s,
            fail_every,
            drop_every,
            0,
            [],
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen += 1
        k = self.seen  # this request's number: others arrive while it sleeps
        self.seeds.append(body["seed"])
        await asyncio.sleep(self.delay_s)
        if self.drop_every and k % self.drop_every == 0:
            request.transport.close()
            return web.Response()
        if self.fail_every and k % self.fail_every == 0:
            return web.Response(status=500, text="boom")
        return web.json_response(
            {
                "text": "x" * body["max_new_tokens"],
                "prompt_tokens": len(body["prompt"]),
                "new_tokens": body["max_new_tokens"],
                "latency_ms": self.delay_s * 1e3,
            }
        )


async def _against(stand_in: StandIn, clients: int, duration_s: float) -> dict:
    app = web.Application()
    app.router.add_post("/generate", stand_in.generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        settings = LoadSettings(
            url=f"http://127.0.0.1:{port}", clients=(clients,), duration_s=duration_s, max_new_tokens=8
        )
        return await loadtest.run_level(settings, clients)
    finally:
        await runner.cleanup()


def test_client_against_a_stand_in_counts_answers():
    stand_in = StandIn(delay_s=0.02)
    row = asyncio.run(_against(stand_in, clients=4, duration_s=0.6))
    assert row["errors_4xx"] == row["errors_5xx"] == row["dropped"] == row["errors_other"] == 0
    assert stand_in.seen >= row["requests"] + 4 and row["requests"] >= 4 * 10  # 4 warm-ups, ~30 each
    assert len(set(stand_in.seeds)) == len(stand_in.seeds)  # every request its own seed
    assert row["new_tokens"] == 8 * row["requests"]
    # closed loop: each client has one request in flight, so rps ~ clients / latency
    assert row["rps"] == pytest.approx(4 / (row["mean_ms"] / 1e3), rel=0.25)
    assert row["new_tokens_per_s"] == pytest.approx(8 * row["rps"])
    assert 20 <= row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"] and row["client_cpu_pct"] >= 0


def test_client_counts_5xx_and_dropped_connections_separately():
    stand_in = StandIn(delay_s=0.01, fail_every=5, drop_every=7)
    row = asyncio.run(_against(stand_in, clients=2, duration_s=0.6))
    total = stand_in.seen
    dropped = total // 7
    assert row["dropped"] == dropped and row["errors_5xx"] == total // 5 - total // 35
    assert row["requests"] + row["dropped"] + row["errors_5xx"] <= total and row["requests"] > 0


def test_client_counts_a_refused_connection_as_dropped():
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        settings = LoadSettings(url=f"http://127.0.0.1:{port}", clients=(2,), duration_s=0.3)
        row = asyncio.run(loadtest.run_level(settings, 2))
    assert row["requests"] == 0 and row["dropped"] >= 2 and row["errors_5xx"] == 0
    assert "Connect" in row["first_error"]
