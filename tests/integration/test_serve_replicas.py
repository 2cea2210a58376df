"""Two replicas of the Serve app under load, on a private local Ray, with the transformer trained on
real TinyShakespeare bytes (conftest's ``trained_transformer``): both serve (Ray's metrics export,
scraped and parsed with prometheus_client, shows each replica's requests, tokens and latencies);
one is killed and the other keeps answering, no request failing but those the killed one held."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_scrape import label_values, value, wait_for
from ray import serve
from serve_load import healthz, load, private_serve, replica_pids

from jaxray.serve.app import app_builder
from jaxray.serve.metrics import metrics_url

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ENGINE = {"buckets": [16], "batch_sizes": [4], "chunk": 8, "max_new_tokens": 200, "prefix_cache_mib": 0}
CLIENT_TIMEOUT_S = 30.0
SUCCESS = "ray_jaxray_request_success_total"
HTTP = "ray_serve_num_http_requests_total"


@pytest.fixture(scope="module")
def url(trained_transformer):
    with private_serve(env={"RAY_metrics_report_interval_ms": "1000"}) as url:  # metrics within 1 s
        args = {
            "checkpoint": str(trained_transformer),
            "num_replicas": 2,
            "max_batch_size": 4,
            "engine": ENGINE,
        }
        serve.run(app_builder(args), name="jaxray", route_prefix="/")
        yield url


def both_served(samples) -> bool:
    """Two replicas each show a finished /generate request, its time to first token and tokens."""
    replicas = label_values(samples, SUCCESS, "replica")
    return len(replicas) == 2 and all(
        value(samples, SUCCESS, replica=replica, route="/generate", finished_reason="length") > 0
        and value(samples, "ray_jaxray_time_to_first_token_seconds_count", replica=replica) > 0
        and value(samples, "ray_jaxray_generation_tokens_total", replica=replica) > 0
        for replica in replicas
    )


def test_two_replicas_both_serve_and_one_survives_the_others_kill(url):
    scrape_url = metrics_url()
    assert scrape_url and len(replica_pids()) == 2
    chat = {"messages": [{"role": "user", "content": "Hail!"}], "max_tokens": 12, "stream": True}
    assert requests.post(url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        clients = pool.submit(asyncio.run, load(url, 8, stop, CLIENT_TIMEOUT_S))
        try:  # the clients run until stopped: a failed assertion here must stop them too
            # Each replica's /generate series (a replica's first series may be the chat request's
            # alone), the chat request's, and Serve's own HTTP count (its proxy reports apart).
            samples = wait_for(
                scrape_url,
                lambda s: (
                    both_served(s)
                    and value(s, SUCCESS, route="/v1/chat/completions") > 0
                    and value(s, HTTP, route="/generate", status_code="200") > 0
                ),
                timeout=60,
            )
            assert value(samples, SUCCESS, route="/v1/chat/completions", finished_reason="length") == 1

            killed_pid = replica_pids()[0]
            killed = time.monotonic()
            os.kill(killed_pid, signal.SIGKILL)
            time.sleep(8)  # the survivor carries the load while Serve replaces the other
        finally:
            stop.set()
        samples = clients.result(timeout=CLIENT_TIMEOUT_S + 10)
    failed = [s for s in samples if s.outcome != "ok"]
    assert {s.outcome for s in failed} <= {"5xx"}, [s.error for s in failed][:5]
    # Only requests the killed replica held fail: sent before the kill, at most its batch and queue.
    assert all(s.start_s < killed + 1.0 for s in failed), [(s.start_s - killed, s.error) for s in failed]
    assert len(failed) <= 8, [s.error for s in failed]
    after = [s for s in samples if s.start_s > killed + 1.0]
    assert after and all(s.outcome == "ok" for s in after)
    status, health = healthz(url, CLIENT_TIMEOUT_S)
    assert status == 200 and health["status"] == "ok"
