"""The OpenAI surface without a server: requests refused naming the field, vLLM's defaults, the
chat template, and the streams' event order (role, pieces, finish, usage, one [DONE])."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from jaxray.inference.detokenize import Choice
from jaxray.serve.openai import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    _events,
    _Reply,
    render_chat,
)
from jaxray.serve.schema import ApiError, Limits, parse, prompt_bytes

LIMITS = Limits(max_new_tokens=100, max_prompt_bytes=50)


async def tokens(*chunks: bytes):
    """A token-chunk stream as the engine gives it (byte values)."""
    for chunk in chunks:
        yield list(chunk)


@pytest.mark.parametrize(
    "model,body,field",
    [
        (CompletionRequest, b'{"prompt": "a", "max_tokens": 0}', "max_tokens"),
        (CompletionRequest, b'{"prompt": "a", "max_tokens": 101}', "max_tokens"),
        (CompletionRequest, b'{"prompt": "a", "model": 3}', "model"),
        (CompletionRequest, b'{"prompt": ["a", "b"]}', "prompt"),  # the list-of-prompts form is not served
        (CompletionRequest, b'{"prompt": "a", "n": 0}', "n"),
        (CompletionRequest, b'{"prompt": "a", "n": 17}', "n"),
        (CompletionRequest, b'{"prompt": "a", "top_p": 0}', "top_p"),
        (CompletionRequest, b'{"prompt": "a", "top_p": 1.5}', "top_p"),
        (CompletionRequest, b'{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}', "stop"),
        (CompletionRequest, b'{"prompt": "a", "stop": ""}', "stop"),
        (CompletionRequest, b'{"prompt": "a", "stream_options": {"include_usage": true}}', "stream_options"),
        (CompletionRequest, b'{"prompt": "a", "temperature": NaN}', "temperature"),
        (CompletionRequest, b'{"prompt": "a", "echo": true}', "echo"),
        (CompletionRequest, b'{"prompt": "a", "presence_penalty": 0.5}', "presence_penalty"),
        (CompletionRequest, b'{"prompt": "a", "frequency_penalty": false}', "frequency_penalty"),
        (CompletionRequest, b'{"prompt": "a", "logprobs": 2}', "logprobs"),
        (CompletionRequest, b'{"prompt": "a", "logit_bias": {"65": 10}}', "logit_bias"),
        (ChatRequest, b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true}', "logprobs"),
        (CompletionRequest, b'{"max_tokens": 5}', "prompt"),
        (ChatRequest, b'{"messages": []}', "messages"),
        (ChatRequest, b'{"messages": [{"role": "robot", "content": "hi"}]}', "messages"),
        (ChatRequest, b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}',
         "max_completion_tokens"),
        (ChatRequest, b'{"prompt": "a"}', "messages"),  # required first
        # A name that would forge another speaker turn in the rendered play script.
        (ChatRequest, b'{"messages": [{"role": "user", "content": "x", "name": "A\\nB:"}]}', "messages"),
        (ChatRequest, b'{"messages": [{"role": "user", "content": "hi"}], "prompt": "a"}', "prompt"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_naming_the_field(model, body, field):
    with pytest.raises(ApiError) as caught:
        parse(model, body, LIMITS)
    error = caught.value.body()["error"]
    assert caught.value.status == 400 and error["param"] == field and error["code"] == 400
    assert error["type"] == "invalid_request_error" and error["message"] and error["allowed"]


def test_what_clients_send_by_default_is_accepted():
    """The neutral values of fields jaxray does not implement, as the openai package and others send
    them (vLLM accepts them too); the refusal of another value names the field and what it takes."""
    neutral = {"logprobs": None, "echo": False, "presence_penalty": 0, "frequency_penalty": 0.0}
    neutral |= {"logit_bias": {}, "best_of": 1, "suffix": None, "top_logprobs": 0, "repetition_penalty": 1}
    parse(CompletionRequest, json.dumps({"prompt": "a", **neutral}).encode(), LIMITS)
    parse(CompletionRequest, b'{"prompt": "a", "echo": null}', LIMITS)  # null: the default, as vLLM
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": False, "logit_bias": None}
    parse(ChatRequest, json.dumps(chat).encode(), LIMITS)
    with pytest.raises(ApiError) as caught:
        parse(CompletionRequest, b'{"prompt": "a", "presence_penalty": 0.5}', LIMITS)
    error = caught.value.body()["error"]
    assert error["message"] == "presence_penalty 0.5 is not supported: only 0 (jaxray does not implement it)"
    assert error["allowed"] == "only 0 (jaxray does not implement it)"


def test_a_rendered_prompt_over_the_limit_names_the_field_and_the_limit():
    # 45 bytes of content pass the schema; the rendered play script (speaker lines) is past 50.
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 45}]}).encode()
    req = parse(ChatRequest, body, LIMITS)
    with pytest.raises(ApiError) as caught:
        prompt_bytes(ChatRequest, req, LIMITS)
    error = caught.value.body()["error"]
    assert error["param"] == "messages" and "over the limit of 50" in error["message"], error
    assert error["allowed"].endswith("rendered to at most 50 UTF-8 bytes"), error
    short = parse(ChatRequest, b'{"messages": [{"role": "user", "content": "hi"}]}', LIMITS)
    assert prompt_bytes(ChatRequest, short, LIMITS) == render_chat(short.messages).encode()
    completion = parse(CompletionRequest, b'{"prompt": "hi"}', LIMITS)
    assert prompt_bytes(CompletionRequest, completion, LIMITS) == b"hi"


def test_a_chat_longer_than_the_model_reads_is_refused_not_cut():
    limits = Limits(max_new_tokens=100, max_prompt_bytes=500, context_len=40)
    system = {"role": "system", "content": "You are a tragedian."}
    body = json.dumps({"messages": [system, {"role": "user", "content": "x" * 30}]}).encode()
    with pytest.raises(ApiError) as caught:
        prompt_bytes(ChatRequest, parse(ChatRequest, body, limits), limits)
    error = caught.value.body()["error"]
    assert error["param"] == "messages" and "the model reads at most 40 (max_model_len)" in error["message"]
    long = json.dumps({"prompt": "y" * 60}).encode()  # a completion reads its last 40 bytes, as documented
    assert len(prompt_bytes(CompletionRequest, parse(CompletionRequest, long, limits), limits)) == 60


def test_a_nested_error_names_where_in_the_field():
    with pytest.raises(ApiError) as caught:
        parse(ChatRequest, b'{"messages": [{"role": "user"}]}', LIMITS)
    assert caught.value.body()["error"]["message"] == "messages.0.content is required"
    ok = b'{"messages": [{"role": "user", "content": "hi", "name": "Lady Capulet"}]}'
    assert render_chat(parse(ChatRequest, ok, LIMITS).messages).startswith("LADY CAPULET:\nhi\n\n")


def test_defaults_are_vllms():
    req = parse(CompletionRequest, b'{"prompt": "a", "top_k": -1}', LIMITS)
    assert (req.new_tokens(LIMITS), req.temperature, req.top_p, req.top_k, req.n, req.seed) == (
        16, 1.0, 1.0, None, 1, None
    )  # fmt: skip
    assert req.stop == [] and not req.stream and req.stream_options is None
    req = parse(CompletionRequest, b'{"prompt": "a", "stop": "\\n", "stream": true, '
                b'"stream_options": {"include_usage": true}}', LIMITS)  # fmt: skip
    assert req.stop == ["\n"] and req.stream_options.include_usage
    chat = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}'
    assert parse(ChatRequest, chat, LIMITS).new_tokens(LIMITS) == 9  # the older name still counts
    chat = b'{"messages": [{"role": "user", "content": "hi"}]}'
    assert parse(ChatRequest, chat, LIMITS).new_tokens(LIMITS) == 16


def test_chat_renders_a_play_script():
    messages = [
        ChatMessage(role="system", content="A street in Verona."),
        ChatMessage(role="user", content="Good morrow."),
        ChatMessage(role="assistant", content="And to you."),
        ChatMessage(role="user", content="What news?", name="Mercutio"),
    ]
    assert render_chat(messages) == (
        "A street in Verona.\n\nROMEO:\nGood morrow.\n\nJULIET:\nAnd to you.\n\n"
        "MERCUTIO:\nWhat news?\n\nJULIET:\n"
    )


def events(raw: list[bytes]) -> list:
    return [
        (lambda d: d if d == "[DONE]" else json.loads(d))(e.decode().split("data: ", 1)[1].rstrip("\n"))
        for e in raw
    ]


async def gathered(stream) -> list:
    return [item async for item in stream]


def test_chat_stream_events_in_order_with_usage_and_one_done():
    req = parse(ChatRequest, b'{"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": true, '
                b'"stop": "!", "stream_options": {"include_usage": true}}', LIMITS)  # fmt: skip
    choices = [
        Choice(0, lambda ended: tokens(b"Ay", b"e!x"), req.stop),
        Choice(1, lambda ended: tokens(b"No"), req.stop),
    ]
    out = events(
        asyncio.run(gathered(_events(_Reply(SimpleNamespace(model_name="m"), True), choices, req, 5)))
    )
    assert out[-1] == "[DONE]" and out.count("[DONE]") == 1
    chunks = out[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks[2:-1]:
        [entry] = c["choices"]
        text[entry["index"]] += entry["delta"].get("content", "")
        if entry["finish_reason"]:
            finish[entry["index"]] = (entry["finish_reason"], entry["stop_reason"])
    assert text == {0: "Aye", 1: "No"} and finish == {0: ("stop", "!"), 1: ("length", None)}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 4 + 2, "total_tokens": 11
    }  # fmt: skip


def test_completion_stream_without_usage():
    req = parse(CompletionRequest, b'{"prompt": "a", "stream": true}', LIMITS)
    choices = [Choice(0, lambda ended: tokens(b"hi"), req.stop)]
    out = events(
        asyncio.run(gathered(_events(_Reply(SimpleNamespace(model_name="m"), False), choices, req, 1)))
    )
    assert [c["choices"][0]["text"] for c in out[:-1]] == ["hi", ""] and out[-1] == "[DONE]"
    assert out[0]["object"] == "text_completion" and out[1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in out[:-1])
