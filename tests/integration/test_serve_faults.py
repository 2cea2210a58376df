"""The Serve app's faults, with real Ray Serve, real HTTP and a real checkpoint (conftest's
``trained_transformer``, trained here on TinyShakespeare): a replica whose constructor raises fails
the deploy within seconds with its exception; a replica process killed under the load of 16
clients is replaced, every request it failed being a 5xx, or Serve's 408 for one that waited past
the request time-out for a replica, and none hanging; a full queue answers 503 with Retry-After at
once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from checkpoint_copies import damaged_copy
from ray import serve
from serve_load import healthz, load, private_serve, replica_pids

from jaxray.serve.app import app_builder, deploy_failure, deployment
from jaxray.serve.settings import AppArgs

pytestmark = [pytest.mark.ray, pytest.mark.slow]
# Few programs to compile (three replicas start in this module): no prefix cache, two batch sizes.
ENGINE = {"buckets": [16, 64], "batch_sizes": [4, 16], "chunk": 8, "max_new_tokens": 200}
ENGINE |= {"prefix_cache_mib": 0}
REQUEST_TIMEOUT_S = 20.0  # Serve's proxy: a request unanswered after this gets 408
CLIENT_TIMEOUT_S = REQUEST_TIMEOUT_S + 10  # a request still open after this counts as hanging


@pytest.fixture(scope="module")
def url() -> str:
    """Serve on a private local Ray with a request time-out."""
    with private_serve(request_timeout_s=REQUEST_TIMEOUT_S) as url:
        yield url


@pytest.fixture(scope="module")
def damaged(trained_transformer, tmp_path_factory) -> Path:
    return damaged_copy(trained_transformer, tmp_path_factory.mktemp("damaged"))[0]


def test_a_replica_that_fails_to_start_fails_the_deploy_in_seconds_with_its_exception(url, damaged):
    # Bound without build_app's restore in the caller: the replica's own load is what fails.
    args = AppArgs(checkpoint=str(damaged), max_batch_size=4, engine=ENGINE)
    app = deployment(args).bind(args)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Deploying application broken failed") as err:
        serve.run(app, name="broken", route_prefix="/broken")
    elapsed = time.monotonic() - start
    why = deploy_failure("broken")  # what python -m jaxray.serve prints after Serve's error
    assert "Deploying application broken failed" in str(err.value)
    serve.delete("broken")
    assert f"{damaged} is damaged" in why and "does not match its checksum" in why, why
    assert elapsed < 30, f"the failed deploy took {elapsed:.1f} s"


def test_a_killed_replica_under_load_is_replaced_and_every_failure_is_a_prompt_5xx(url, copied_run_folder):
    # Served from a run folder copied elsewhere, its original deleted: it reads the copy's checkpoint.
    args = {
        "checkpoint": str(copied_run_folder),
        "max_batch_size": 16,
        "batch_wait_ms": 10,
        "engine": ENGINE,
    }
    serve.run(app_builder(args), name="jaxray", route_prefix="/")
    status, before = healthz(url, CLIENT_TIMEOUT_S)
    assert status == 200 and before["status"] == "ok"
    served = requests.get(f"{url}/info", timeout=10).json()["checkpoint"]
    assert Path(served).is_relative_to(copied_run_folder), served
    [pid] = replica_pids()
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        clients = pool.submit(asyncio.run, load(url, 16, stop, CLIENT_TIMEOUT_S))
        try:
            time.sleep(4)  # 16 clients in flight
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            status, after = healthz(url, CLIENT_TIMEOUT_S)
            while not (status == 200 and after.get("replica") not in (None, before["replica"])):
                assert time.monotonic() - killed < 120, (status, after)
                time.sleep(0.5)
                status, after = healthz(url, CLIENT_TIMEOUT_S)
            recovered = time.monotonic()
            time.sleep(4)  # new requests meet the replacement
        finally:
            stop.set()  # the clients end even when the replacement never came
        samples = clients.result(timeout=CLIENT_TIMEOUT_S + 10)
    print(f"replica replaced {recovered - killed:.1f} s after the kill; healthz {after}")
    failed = [s for s in samples if s.outcome != "ok"]
    # 5xx, or Serve's 408 for a request still waiting for a replica after request_timeout_s
    odd = [s.error for s in failed if not (s.outcome == "5xx" or s.status == 408)]
    assert not odd, odd[:5]
    assert failed, "the requests in flight at the kill should have failed"
    slowest = max(s.latency_ms for s in samples) / 1e3
    assert slowest < REQUEST_TIMEOUT_S + 5, f"a request took {slowest:.1f} s"
    # Samples are timed on the event loop's clock, which is time.monotonic().
    late_ok = [s for s in samples if s.outcome == "ok" and s.start_s > recovered]
    assert late_ok, "no request succeeded once the replacement was up"
    assert replica_pids() != [pid]


def test_a_full_queue_answers_503_with_retry_after_at_once(url, trained_transformer):
    args = {
        "checkpoint": str(trained_transformer),
        "max_batch_size": 1,
        "max_ongoing_requests": 1,
        "max_queued_requests": 1,
        "engine": {**ENGINE, "batch_sizes": [1]},
    }
    serve.run(app_builder(args), name="queue", route_prefix="/q")
    body = json.dumps({"prompt": "ROMEO:", "max_new_tokens": 200, "temperature": 0.8})

    def post(_: int) -> tuple[requests.Response, float]:
        start = time.monotonic()
        response = requests.post(f"{url}/q/generate", data=body, timeout=CLIENT_TIMEOUT_S)
        return response, time.monotonic() - start

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(post, range(16)))
    serve.delete("queue")
    refused = [(r, t) for r, t in answers if r.status_code == 503]
    assert {r.status_code for r, _ in answers} == {200, 503} and len(refused) >= 8, [
        r.status_code for r, _ in answers
    ]
    for response, took in refused:
        assert response.headers["retry-after"] == "1" and took < 2.0, (response.headers, took)
