"""The Serve app end to end: a transformer trained here on real TinyShakespeare bytes, restored by a
real Ray Serve replica on loopback, real HTTP. Greedy text equals the full-recompute sampler,
streams equal their non-stream answers, concurrent requests batch without changing results, and
every bad input is a 4xx JSON error naming its field while the server stays up."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from ray import serve
from saved import save_params
from serve_load import private_serve

from jaxray import checkpoint
from jaxray.config import parse_trial
from jaxray.data.batching import train_batches
from jaxray.data.workloads import load_arrays
from jaxray.inference.engine import gather_shapes
from jaxray.inference.sampling import Sampling
from jaxray.inference.sampling import generate as full_recompute
from jaxray.parallel.mesh import make_mesh
from jaxray.serve.app import app_builder
from jaxray.train.run import train

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # a real Serve app: ~50 s to start and compile

MAX_SEQ_LEN = 64
ENGINE = {
    "buckets": [16, 64],
    "batch_sizes": [1, 4],
    "chunk": 8,
    "max_new_tokens": 200,
    "max_prompt_bytes": 1024,
}


@pytest.fixture(scope="module")
def trained(real_dir, tmp_path_factory) -> Path:
    """A checkpoint of 30 steps of a one-layer, width-32 transformer on real TinyShakespeare."""
    trial = parse_trial(
        {
            "model": {
                "workload": "transformer",
                "width": 32,
                "num_layers": 1,
                "num_heads": 2,
                "max_seq_len": MAX_SEQ_LEN,
            },
            "data": {"data_dir": str(real_dir), "seq_len": MAX_SEQ_LEN},
            "train": {
                "steps": 30,
                "global_batch": 16,
                "log_every": 10,
                "eval_batch": 16,
                "learning_rate": 3e-3,
            },
        }
    )
    train_arrays, held_out = load_arrays(trial)
    held_out = {k: v[:16] for k, v in held_out.items()}  # evaluation is not under test: keep it short
    result = train(
        trial, train_batches(train_arrays, trial.train.global_batch, trial.train.seed), held_out, make_mesh()
    )
    return save_params(tmp_path_factory.mktemp("serve") / "ck", result.state.params, trial)


@pytest.fixture(scope="module")
def url(trained) -> str:
    """A running app (built by app_builder, as `serve run` does) on 127.0.0.1 and a free port."""
    with private_serve() as url:
        serve.run(
            app_builder(
                {"checkpoint": str(trained), "max_batch_size": 4, "batch_wait_ms": 50, "engine": ENGINE}
            ),
            name="jaxray",
            route_prefix="/",
        )
        yield url


def post(url: str, path: str, body, **kwargs) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body)
    return requests.post(
        url + path, data=data, headers={"Content-Type": "application/json"}, timeout=60, **kwargs
    )


def events(response: requests.Response) -> list:
    """The ``data:`` payloads of a server-sent event stream, JSON-decoded where they are JSON."""
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    out = []
    for line in response.iter_lines(decode_unicode=False):
        if line.startswith(b"data: "):
            payload = line[len(b"data: ") :].decode("utf-8")
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_healthz_and_info(url, trained):
    health = requests.get(url + "/healthz", timeout=10).json()
    assert health["status"] == "ok" and health["replica"] and health["up_s"] >= 0
    info = requests.get(url + "/info", timeout=10).json()
    assert info["model"]["max_seq_len"] == MAX_SEQ_LEN and info["model"]["width"] == 32
    assert str(trained) in json.dumps(info) and info["server"]["max_batch_size"] == 4
    # (16, 64) x (1, 4): a start program per bucket and batch size, a decode program per batch size,
    # the same again for the default prefix cache (start_cached, block store), and the gather programs
    # of continuous batching
    assert (
        info["programs"] == 2 * 6 + len(gather_shapes((1, 4))) and info["compile_s"] > 0 and info["devices"]
    )
    assert info["prefix_cache"]["mib"] > 0 and info["prefix_cache"]["block_tokens"] == 32


def test_greedy_equals_the_full_recompute_sampler(url, trained):
    model, params = checkpoint.restore(trained)
    want = full_recompute(model, params, "ROMEO:", Sampling(40, temperature=0.0))
    got = post(url, "/generate", {"prompt": "ROMEO:", "max_new_tokens": 40, "temperature": 0}).json()
    assert got["text"] == want
    assert (got["prompt_tokens"], got["new_tokens"]) == (6, 40) and got["latency_ms"] > 0


def test_stream_equals_the_answer(url):
    body = {"prompt": "First Citizen:\n", "max_new_tokens": 40, "temperature": 1.5, "seed": 7, "top_k": 50}
    whole = post(url, "/generate", body).json()
    parts = events(post(url, "/generate", {**body, "stream": True}, stream=True))
    assert len(parts) >= 3 and all(set(p) == {"text"} for p in parts[:-1])  # chunk 8: several events
    assert "".join(p["text"] for p in parts[:-1]) == whole["text"]
    assert parts[-1]["done"] is True and parts[-1]["new_tokens"] == 40 and parts[-1]["prompt_tokens"] == 15


def test_openai_completions(url):
    body = {"model": "jaxray", "prompt": "KING:", "max_tokens": 24, "temperature": 0}
    ours = post(url, "/generate", {"prompt": "KING:", "max_new_tokens": 24, "temperature": 0}).json()
    answer = post(url, "/v1/completions", body).json()
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-")
    assert answer["choices"][0]["text"] == ours["text"] and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 24, "total_tokens": 29}
    chunks = events(post(url, "/v1/completions", {**body, "stream": True}, stream=True))
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(
        c["object"] == "text_completion" and c["choices"][0]["finish_reason"] is None for c in chunks[:-2]
    )
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == ours["text"]


def test_concurrent_requests_batch_without_changing_results(url):
    bodies = [
        {"prompt": p, "max_new_tokens": 16 + 4 * i, "temperature": 0.9, "seed": i}
        for i, p in enumerate(["ROMEO:", "JULIET:", "To be", "O", "What, ho!", "A" * 70, "\n", "Sir,"])
    ]
    alone = [post(url, "/generate", b).json()["text"] for b in bodies]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: post(url, "/generate", b), bodies))
    assert [r.status_code for r in together] == [200] * 8
    assert [r.json()["text"] for r in together] == alone
    assert together[5].json()["prompt_tokens"] == MAX_SEQ_LEN - 1  # a 70-byte prompt keeps its last 63
    server = requests.get(url + "/info", timeout=10).json()["server"]
    assert server["engine"]["mean_rows"] > 1  # decode calls were shared
    assert len(server["compute_cpus"]) == max(
        1, len(os.sched_getaffinity(0)) - 1
    )  # pinned before JAX started


def test_invalid_utf8_is_replaced_never_a_500(url):
    body = {"prompt": "\u00e9", "max_new_tokens": 200, "temperature": 5.0, "seed": 3}  # near-uniform bytes
    whole = post(url, "/generate", body)
    assert whole.status_code == 200 and whole.json()["new_tokens"] == 200
    assert "\ufffd" in whole.json()["text"]
    parts = events(post(url, "/generate", {**body, "stream": True}, stream=True))
    assert "".join(p["text"] for p in parts[:-1]) == whole.json()["text"]


LONG_CHAT = json.dumps({"messages": [{"role": "user", "content": "x" * 1020}]}).encode()
BAD = [
    ("/generate", b"not json", "body"),
    ("/generate", b"[1, 2]", "body"),
    ("/generate", b'"ROMEO:"', "body"),
    ("/generate", b"\xff\xfe", "body"),
    ("/generate", b"{}", "prompt"),
    ("/generate", b'{"prompt": 3}', "prompt"),
    ("/generate", b'{"prompt": ""}', "prompt"),
    ("/generate", json.dumps({"prompt": "x" * 1025}).encode(), "prompt"),
    ("/generate", json.dumps({"prompt": "x" * 100_000}).encode(), "body"),  # 413, read no further
    ("/generate", b'{"prompt": "a", "max_new_tokens": 0}', "max_new_tokens"),
    ("/generate", b'{"prompt": "a", "max_new_tokens": 201}', "max_new_tokens"),
    ("/generate", b'{"prompt": "a", "max_new_tokens": true}', "max_new_tokens"),
    ("/generate", b'{"prompt": "a", "temperature": -1}', "temperature"),
    ("/generate", b'{"prompt": "a", "temperature": NaN}', "temperature"),
    ("/generate", b'{"prompt": "a", "temperature": "0.5"}', "temperature"),
    ("/generate", b'{"prompt": "a", "top_k": 0}', "top_k"),
    ("/generate", b'{"prompt": "a", "top_k": 257}', "top_k"),
    ("/generate", b'{"prompt": "a", "seed": -1}', "seed"),
    ("/generate", b'{"prompt": "a", "stream": "yes"}', "stream"),
    ("/generate", b'{"prompt": "a", "bogus": 1}', "bogus"),
    ("/v1/completions", b"nope", "body"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 0}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "a", "temperature": Infinity}', "temperature"),
    ("/v1/completions", b'{"prompt": ["a"]}', "prompt"),
    ("/v1/completions", b'{"prompt": "a", "echo": true}', "echo"),
    # Content under the limit, the rendered script (its speaker line) over it.
    ("/v1/chat/completions", LONG_CHAT, "messages"),
]


@pytest.mark.parametrize("path,body,field", BAD)
def test_bad_input_is_a_4xx_naming_the_field(url, path, body, field):
    response = post(url, path, body)
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert response.json()["error"]["field"] == field and response.json()["error"]["allowed"], response.text


def test_unknown_routes_and_methods_are_json_errors_and_the_server_stays_up(url):
    missing = requests.get(url + "/nope", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "path"
    wrong = requests.get(url + "/generate", timeout=10)
    assert wrong.status_code == 405 and wrong.json()["error"]["field"] == "method"
    assert requests.get(url + "/healthz", timeout=10).json()["status"] == "ok"
    assert post(url, "/generate", {"prompt": "a", "max_new_tokens": 3}).status_code == 200


def test_the_official_openai_client(url):
    """The ``openai`` package against the app: models, completions and chat, streamed and not."""
    from openai import BadRequestError, NotFoundError, OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    [model] = client.models.list().data
    assert model.id == "jaxray" and client.models.retrieve("jaxray").id == "jaxray"
    greedy = {"model": model.id, "max_tokens": 24, "temperature": 0}
    whole = client.completions.create(prompt="KING:", **greedy)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 24
    stream = client.completions.create(
        prompt="KING:", stream=True, stream_options={"include_usage": True}, **greedy
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24

    messages = [{"role": "user", "content": "Good morrow, sweet lady."}]
    chat = client.chat.completions.create(messages=messages, max_completion_tokens=30, **greedy)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 30
    parts = list(
        client.chat.completions.create(messages=messages, max_completion_tokens=30, stream=True, **greedy)
    )
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    prompt = post(url, "/generate", {"prompt": "Good morrow, sweet lady.", "max_new_tokens": 1}).json()
    assert (
        chat.usage.prompt_tokens
        == len("ROMEO:\nGood morrow, sweet lady.\n\nJULIET:\n")
        != prompt["prompt_tokens"]
    )

    sampled = {"model": model.id, "prompt": "ROMEO:", "max_tokens": 20, "temperature": 1.0}
    three = client.completions.create(n=3, seed=42, **sampled)
    assert [c.index for c in three.choices] == [0, 1, 2] and three.usage.completion_tokens == 60
    third = client.completions.create(seed=44, **sampled)  # choice i is seeded seed + i
    assert third.choices[0].text == three.choices[2].text

    with pytest.raises(BadRequestError) as refused:
        client.completions.create(model=model.id, prompt="a", max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"
    with pytest.raises(NotFoundError):
        client.completions.create(model="gpt-4o", prompt="a")
    assert client.completions.create(prompt="a", **{**greedy, "max_tokens": 2}).usage.completion_tokens == 2


def test_a_stop_sequence_ends_the_text_before_it(url):
    """Greedy text up to the first match of a stop (two of its own bytes), with finish_reason
    "stop" and the stop in stop_reason; the usage counts the bytes up to and including the stop."""
    text = post(url, "/generate", {"prompt": "ROMEO:", "max_new_tokens": 100, "temperature": 0}).json()[
        "text"
    ]
    stop = text[20:22]
    cut = text.index(stop)
    body = {"prompt": "ROMEO:", "max_tokens": 100, "temperature": 0, "stop": ["\u0000never", stop]}
    decode_calls = lambda: requests.get(url + "/info", timeout=10).json()["server"]["engine"]["decode_calls"]  # noqa: E731
    before = decode_calls()
    answer = post(url, "/v1/completions", body).json()
    calls, previous = decode_calls(), None
    for _ in range(60):  # until the count settles: a request the stop did not end goes on decoding
        if calls == previous:
            break
        time.sleep(0.5)
        calls, previous = decode_calls(), calls
    # The engine stopped there too: its 99 tokens after the first would take 13 calls. The reader
    # finds the stop (and cancels) a few event-loop hops after the call that made it, while the
    # engine thread goes on: allow a few calls more (4 were seen on a loaded 2-core machine).
    assert calls - before <= cut // ENGINE["chunk"] + 6
    [choice] = answer["choices"]
    assert choice["text"] == text[:cut] and (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert answer["usage"]["completion_tokens"] == len(text[:cut].encode()) + len(stop.encode())
    streamed = events(post(url, "/v1/completions", {**body, "stream": True}, stream=True))
    assert "".join(c["choices"][0]["text"] for c in streamed[:-1]) == text[:cut]
    assert streamed[-2]["choices"][0]["finish_reason"] == "stop"
