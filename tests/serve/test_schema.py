"""Request validation without a server: every bad input is an ApiError naming its field, the error
body has one shape, and good requests parse with the documented defaults."""

from __future__ import annotations

import json

import pytest

from jaxray.serve.schema import (
    ApiError,
    GenerateRequest,
    Limits,
    parse,
    sse,
)

LIMITS = Limits(max_new_tokens=100, max_prompt_bytes=50)

# (body, field named). Bodies are raw bytes as a client would send them.
BAD = [
    (b"not json", "body"),
    (b"", "body"),
    (b"\xff\xfe{", "body"),
    (b"[1, 2]", "body"),
    (b'"ROMEO:"', "body"),
    (b"null", "body"),
    (b"{}", "prompt"),
    (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": null}', "prompt"),
    (b'{"prompt": ["a"]}', "prompt"),
    (b'{"prompt": ""}', "prompt"),
    (json.dumps({"prompt": "x" * 51}).encode(), "prompt"),
    (json.dumps({"prompt": "\u00e9" * 26}).encode(), "prompt"),  # 26 characters, 52 UTF-8 bytes
    (b'{"prompt": "\\udcff"}', "body"),  # a lone surrogate has no UTF-8 form: the JSON is refused
    (b'{"prompt": "a", "max_new_tokens": 0}', "max_new_tokens"),
    (b'{"prompt": "a", "max_new_tokens": -3}', "max_new_tokens"),
    (b'{"prompt": "a", "max_new_tokens": 101}', "max_new_tokens"),
    (b'{"prompt": "a", "max_new_tokens": 100000000000000000000000000}', "max_new_tokens"),
    (b'{"prompt": "a", "max_new_tokens": 5.0}', "max_new_tokens"),
    (b'{"prompt": "a", "max_new_tokens": "5"}', "max_new_tokens"),
    (b'{"prompt": "a", "max_new_tokens": true}', "max_new_tokens"),
    (b'{"prompt": "a", "temperature": -0.1}', "temperature"),
    (b'{"prompt": "a", "temperature": NaN}', "temperature"),
    (b'{"prompt": "a", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "a", "temperature": 1e999}', "temperature"),
    (b'{"prompt": "a", "temperature": "0.5"}', "temperature"),
    (b'{"prompt": "a", "temperature": true}', "temperature"),
    (b'{"prompt": "a", "temperature": null}', "temperature"),
    (b'{"prompt": "a", "top_k": 0}', "top_k"),
    (b'{"prompt": "a", "top_k": 257}', "top_k"),
    (b'{"prompt": "a", "top_k": 2.5}', "top_k"),
    (b'{"prompt": "a", "seed": -1}', "seed"),
    (b'{"prompt": "a", "seed": 4294967296}', "seed"),
    (b'{"prompt": "a", "stream": "yes"}', "stream"),
    (b'{"prompt": "a", "stream": 1}', "stream"),
    (b'{"prompt": "a", "prompts": "b"}', "prompts"),
    (b'{"prompt": "a", "max_tokens": 5}', "max_tokens"),  # the OpenAI name is unknown on /generate
]


@pytest.mark.parametrize("body,field", BAD)
def test_generate_refuses_bad_input_naming_the_field(body, field):
    with pytest.raises(ApiError) as caught:
        parse(GenerateRequest, body, LIMITS)
    err = caught.value
    assert err.status == 400 and err.field == field, (err.field, err.message)
    error = err.body()["error"]
    assert error["field"] == error["param"] == field and error["type"] == "invalid_request_error"
    assert error["message"] and error["allowed"]


def test_limits_in_messages():
    with pytest.raises(ApiError, match=r"max_new_tokens must be in 1..100, got 101"):
        parse(GenerateRequest, b'{"prompt": "a", "max_new_tokens": 101}', LIMITS)
    with pytest.raises(ApiError, match="prompt is 52 UTF-8 bytes, over the limit of 50"):
        parse(GenerateRequest, json.dumps({"prompt": "\u00e9" * 26}).encode(), LIMITS)
    with pytest.raises(ApiError) as caught:
        parse(GenerateRequest, b'{"prompt": "a", "foo": 1}', LIMITS)
    assert caught.value.message == "unknown field 'foo'"
    assert (
        caught.value.allowed == "one of the fields prompt, max_new_tokens, temperature, top_k, seed, stream"
    )
    with pytest.raises(ApiError) as caught:  # a field of the other route is unknown here, and said so
        parse(GenerateRequest, b'{"prompt": "a", "max_tokens": 5}', LIMITS)
    assert caught.value.allowed.startswith("one of the fields prompt, max_new_tokens")


def test_a_body_far_past_the_limit_is_413():
    body = json.dumps({"prompt": "x" * LIMITS.max_body_bytes}).encode()
    with pytest.raises(ApiError) as caught:
        parse(GenerateRequest, body, LIMITS)
    assert caught.value.status == 413 and caught.value.field == "body"


def test_good_requests_and_defaults():
    req = parse(GenerateRequest, b'{"prompt": "ROMEO:"}', LIMITS)
    assert (req.temperature, req.top_k, req.seed, req.stream) == (0.8, None, 0, False)
    assert req.new_tokens(LIMITS) == 100  # the default 128 lowered to the cap
    req = parse(
        GenerateRequest,
        b'{"prompt": "\\u00e9t\\u00e9", "max_new_tokens": 7, "temperature": 0, '
        b'"top_k": 256, "seed": 4294967295, "stream": true}',
        LIMITS,
    )
    assert req.prompt == "\u00e9t\u00e9" and req.new_tokens(LIMITS) == 7 and req.temperature == 0.0
    assert req.top_k == 256 and req.stream


def test_server_sent_events():
    assert sse({"text": "é"}) == 'data: {"text": "é"}\n\n'.encode()
    assert sse("[DONE]") == b"data: [DONE]\n\n"
