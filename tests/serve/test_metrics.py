"""``jaxray.serve.metrics`` where Ray exports it: a throwaway two-replica Serve deployment on a
private local Ray records requests with ``RequestTimer`` as the app does;
real HTTP requests, then the Ray metrics agent's endpoint (``metrics_url()``) scraped and parsed
with ``prometheus_client``: latency histograms, token, request and prefix-cache counters move by
what was sent (answered, failed, abandoned by its client), Serve's own HTTP counter by route template and
status (no route, wrong method too), each replica's series under its own
``replica`` label, the waiting and running gauges go up during a slow request and back to 0.
Without Ray: the gauges' bookkeeping and no URL."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import requests
from private_ray import free_port, init_private_ray
from prometheus_scrape import label_values, scrape, value, wait_for
from ray import serve

from jaxray.inference.prefix_cache import PrefixCache
from jaxray.serve import metrics
from jaxray.serve.metrics import RequestTimer, metrics_url

MODEL = "tiny"
ROUTE = "/v1/completions"
REPORT_MS = "1000"  # Ray's metrics report interval here (10 s by default): values show within ~1 s
# (prompt, chunks of generated tokens): quick requests, sent at once to reach both replicas.
QUICK = [("abc", [1, 4, 2]), ("hello", [3]), ("xy", [2, 2]), ("q", [1, 1, 1, 1])]
SLOW = ("slow", [2, 3])  # waits, then runs, long enough to be seen in each state
FAILS = [("boom", [2]), ("zz", [])]  # raise after their chunks: 500, counted as "abort"
GONE = ("gone", [1, 1])  # its client leaves after its first chunk: cancelled, counted as "abort"


def tiny_app(replicas: int):
    """A deployment recording what jaxray's app records; defined in a function so that Ray pickles
    it by value (replica processes cannot import a test module)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    api = FastAPI()

    @api.exception_handler(Exception)
    async def _failed(_: Request, err: Exception) -> JSONResponse:
        return JSONResponse({"error": str(err)}, status_code=500)

    @serve.deployment(num_replicas=replicas, ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class Tiny:
        def __init__(self):  # a prefix cache whose counts the replica exports, as the app's engine's
            self.prefix = PrefixCache(4, 2)
            metrics.watch_prefix_cache(MODEL, self.prefix)

        @api.get("/healthz")
        async def healthz(self) -> dict:
            return {}

        @api.post(ROUTE)
        async def complete(self, body: dict) -> dict:
            prompt, chunks = body["prompt"], body["chunks"]
            timer = RequestTimer(ROUTE, MODEL)
            self.prefix.count(len(prompt), 1)  # each request reuses one block of 2 tokens
            try:
                await asyncio.sleep(body.get("wait_s", 0))
                for i, n in enumerate(chunks):
                    await asyncio.sleep(body.get("hold_s", 0) if i == 1 else 0.01)
                    timer.tokens(n)
                if body.get("fail"):
                    raise RuntimeError("failed after its chunks")
                timer.finish(len(prompt), "length")
            finally:
                timer.finish(len(prompt), None)  # after a finish: nothing
            return {"replica": serve.get_replica_context().replica_tag}

    return Tiny.bind()


def test_a_timer_moves_its_request_from_waiting_to_running_to_done_once():
    counts = metrics._get().counts  # this process's gauges (recorded nowhere without Ray)
    try:
        timer = RequestTimer(ROUTE, "bookkeeping")
        assert counts["bookkeeping"] == [1, 0]
        timer.tokens(0)  # no token yet
        assert counts["bookkeeping"] == [1, 0]
        timer.tokens(3)
        timer.tokens(2)
        assert counts["bookkeeping"] == [0, 1]
        timer.finish(5, "stop")
        timer.finish(5, None)
        timer.tokens(1)
        assert counts["bookkeeping"] == [0, 0]
        RequestTimer(ROUTE, "bookkeeping").finish(0, None)  # ended before a token: not waiting
        assert counts["bookkeeping"] == [0, 0]
    finally:  # else this process re-sets its gauges, exported should it start Ray later
        with metrics._get().lock:
            counts.pop("bookkeeping", None)


def test_no_metrics_url_without_ray():
    if ray.is_initialized():  # another test of this process left it running
        pytest.skip("Ray is running in this process")
    assert metrics_url() is None


@pytest.fixture(scope="module")
def served():
    """(the app's URL, the metrics URL) on a private local Ray reporting every second."""
    os.environ["RAY_metrics_report_interval_ms"] = REPORT_MS  # read by the processes ray.init starts
    init_private_ray(num_cpus=1)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(tiny_app(2), name="metrics", route_prefix="/")
        url, scrape_url = f"http://127.0.0.1:{port}", metrics_url()

        def routed(samples) -> bool:  # the proxy learns the route templates after serve.run returns
            requests.get(url + "/healthz", timeout=10)
            return value(samples, "ray_serve_num_http_requests_total", route="/healthz") > 0

        wait_for(scrape_url, routed, timeout=60)
        yield url, scrape_url
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop("RAY_metrics_report_interval_ms")


def post(url: str, prompt: str, chunks: list[int], **options) -> requests.Response:
    return requests.post(url + ROUTE, json={"prompt": prompt, "chunks": chunks, **options}, timeout=60)


def gauges(samples) -> tuple[float, float]:
    """(waiting, running), summed over the replicas."""
    return (
        value(samples, "ray_jaxray_num_requests_waiting", model_name=MODEL),
        value(samples, "ray_jaxray_num_requests_running", model_name=MODEL),
    )


@pytest.mark.ray
@pytest.mark.slow  # ~30 s: a local Ray, two replicas, a request held 6 s
def test_requests_move_the_metrics_ray_exports(served):
    url, scrape_url = served
    head = next(node for node in ray.nodes() if "node:__internal_head__" in node["Resources"])
    assert scrape_url == f"http://{head['NodeManagerAddress']}:{head['MetricsExportPort']}/metrics"
    assert scrape(scrape_url)  # Ray's own metrics: the agent answers without the dashboard

    # One request waits 3 s for its first token, then holds 3 s after it: seen in each state.
    slow = ThreadPoolExecutor(1).submit(post, url, *SLOW, wait_s=3, hold_s=3)
    wait_for(scrape_url, lambda s: gauges(s) == (1, 0), timeout=20)
    wait_for(scrape_url, lambda s: gauges(s) == (0, 1), timeout=20)
    assert slow.result().status_code == 200

    with ThreadPoolExecutor(len(QUICK)) as pool:  # at once: Serve spreads them over the replicas
        quick = list(pool.map(lambda r: post(url, *r, hold_s=0.5), QUICK))
    assert [r.status_code for r in quick] == [200] * len(QUICK)
    failed = [post(url, *r, fail=True) for r in FAILS]
    assert [r.status_code for r in failed] == [500, 500]
    with pytest.raises(requests.Timeout):  # Serve cancels the replica's handler when the client goes
        requests.post(url + ROUTE, json={"prompt": GONE[0], "chunks": GONE[1], "hold_s": 60}, timeout=2)
    assert requests.get(url + "/nope", timeout=60).status_code == 404
    assert requests.get(url + ROUTE, timeout=60).status_code == 405

    done = [SLOW, *QUICK]
    tags = {"model_name": MODEL, "route": ROUTE}
    every = [*done, *FAILS, (GONE[0], GONE[1][:1])]  # GONE: only its first chunk came
    expected = {
        ("ray_jaxray_request_success_total", "length"): len(done),
        ("ray_jaxray_request_success_total", "abort"): len(FAILS) + 1,
        ("ray_jaxray_generation_tokens_total", None): sum(sum(c) for _, c in every),
        ("ray_jaxray_prompt_tokens_total", None): sum(len(p) for p, _ in every),
        ("ray_jaxray_time_to_first_token_seconds_count", None): sum(1 for _, c in every if c),
        ("ray_jaxray_inter_token_latency_seconds_count", None): sum(max(len(c) - 1, 0) for _, c in every),
        ("ray_jaxray_e2e_request_latency_seconds_count", None): len(every),
    }

    expected |= {
        ("ray_jaxray_prefix_cache_queries_total", "model"): sum(len(p) for p, _ in every),
        ("ray_jaxray_prefix_cache_hits_total", "model"): 2 * len(every),
    }

    def observed(samples) -> dict:
        got = {}
        for name, reason in expected:
            labels = {**tags, "finished_reason": reason} if reason else tags
            got[name, reason] = value(
                samples, name, **({"model_name": MODEL} if reason == "model" else labels)
            )
        return got

    # Serve's proxy counts every HTTP request by the route template it matched by path and method
    # (else the app's route prefix), method and status code (jaxray keeps no HTTP counter of its own).
    http = {(ROUTE, "POST", "200"): 1 + len(QUICK), (ROUTE, "POST", "500"): 2, (ROUTE, "POST", "499"): 1}
    http |= {("/", "GET", "404"): 1, ("/", "GET", "405"): 1}

    def counted(samples) -> dict:
        name, app = "ray_serve_num_http_requests_total", {"application": "metrics"}
        return {(r, m, c): value(samples, name, route=r, method=m, status_code=c, **app) for r, m, c in http}

    samples = wait_for(
        scrape_url,
        lambda s: observed(s) == expected and counted(s) == http and gauges(s) == (0, 0),
        timeout=30,
    )

    # Every name of EXPORTED, as its kind shows in a scrape.
    suffix = {"histogram": "_count", "gauge": "", "counter": ""}
    for exported, (kind, labels, _) in metrics.EXPORTED.items():
        found = [s for s in samples if s.name == exported + suffix[kind]]
        assert found and all(set(labels) <= set(s.labels) for s in found), exported

    # Histograms: every observation within the buckets' range (+Inf holds all of them).
    name = "ray_jaxray_e2e_request_latency_seconds"
    assert value(samples, name + "_bucket", le="300.0", **tags) == len(every)
    assert 6 <= value(samples, name + "_sum", **tags) < 60  # the slow request alone held 6 s
    assert value(samples, "ray_jaxray_time_to_first_token_seconds_bucket", le="0.001", **tags) == 0

    # Per replica: its series carry its replica tag, as serve.get_replica_context() names it.
    served_by = Counter([slow.result().json()["replica"]] + [r.json()["replica"] for r in quick])
    success = "ray_jaxray_request_success_total"
    assert label_values(samples, success, "replica") >= set(served_by)
    for replica, n in served_by.items():
        assert value(samples, success, replica=replica, finished_reason="length") == n, replica
    # (a test process that ran the app's routes itself exports its own series, with empty labels)
    assert label_values(samples, success, "deployment") - {""} == {"Tiny"}
    assert label_values(samples, success, "application") - {""} == {"metrics"}
