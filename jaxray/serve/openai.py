"""The OpenAI surface (vLLM's fields where they apply to a byte model): ``/v1/models``,
``/v1/completions`` and ``/v1/chat/completions`` over the replica's ``RequestPath`` (``server``).
Chat renders ``messages`` as a play script (``render_chat``), the text the model was trained on. No Ray."""

# No `from __future__ import annotations`: pydantic reads the annotations at runtime.
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from starlette.requests import Request as HttpRequest

from jaxray.inference.detokenize import Choice
from jaxray.serve import schema
from jaxray.serve.routes import guarded
from jaxray.serve.schema import Prompt, SamplingRequest, Seed, Stream, Temperature, TopK, sse

OPENAI_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default for max_tokens
SPEAKER_NAME = r"^[A-Za-z0-9 _'-]{1,64}$"  # a message's ``name``: OpenAI's characters, spaces and '
# Chat's speakers when a message names none: the model learned play scripts, "NAME:\ntext\n\n".
SPEAKERS = {"user": "ROMEO", "assistant": "JULIET"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    include_usage: bool = Field(False, description="a last chunk with empty choices and the usage")


# OpenAI fields jaxray does not implement -> the neutral values it accepts (clients such as the openai
# package send their defaults); any other value is refused by name, as vLLM refuses what it cannot do.
NEUTRAL: dict[str, tuple] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None,),
}


def neutral_words(field: str) -> str:
    """What ``field`` (of ``NEUTRAL``) accepts, in words."""
    return " or ".join(json.dumps(v) for v in NEUTRAL[field]) + " (jaxray does not implement it)"


class _OpenAI(SamplingRequest):
    """The fields both OpenAI routes share (vLLM's names and defaults); ``NEUTRAL``'s at neutral values."""

    model: str | None = Field(None, description="the served model's id (GET /v1/models); null: that one")
    temperature: Temperature = 1.0  # OpenAI's default
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the most likely bytes holding this")
    top_k: TopK = None
    seed: Seed | None = Field(None, description="choice i is seeded seed + i; null: a random seed")
    n: int = Field(1, ge=1, le=schema.MAX_N, description="choices to generate")
    stop: str | list[str] | None = Field(
        None, validate_default=True, description=f"up to {schema.MAX_STOPS} strings that end a choice"
    )
    stream: Stream = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="the end user's id (OpenAI's field): accepted, unused")
    logprobs: Any = Field(None, description=f"only {neutral_words('logprobs')}")
    top_logprobs: Any = Field(None, description=f"only {neutral_words('top_logprobs')}")
    echo: Any = Field(False, description=f"only {neutral_words('echo')}")
    presence_penalty: Any = Field(0, description=f"only {neutral_words('presence_penalty')}")
    frequency_penalty: Any = Field(0, description=f"only {neutral_words('frequency_penalty')}")
    repetition_penalty: Any = Field(None, description=f"only {neutral_words('repetition_penalty')}")
    logit_bias: Any = Field(None, description=f"only {neutral_words('logit_bias')}")
    best_of: Any = Field(None, description=f"only {neutral_words('best_of')}")
    suffix: Any = Field(None, description=f"only {neutral_words('suffix')}")

    @field_validator(*NEUTRAL)
    @classmethod
    def _neutral(cls, value: Any, info: ValidationInfo) -> Any:
        field = info.field_name
        if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in NEUTRAL[field]):
            raise ValueError(f"{field} {json.dumps(value)} is not supported: only {neutral_words(field)}")
        return value

    @field_validator("top_k", mode="before")
    @classmethod
    def _all_bytes(cls, value: Any) -> Any:
        return None if value == -1 and type(value) is int else value  # vLLM's -1: no top-k

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > (most := schema.MAX_STOPS) or not all(stops):
            raise ValueError(f"stop must be a string or a list of at most {most} non-empty strings")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _with_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return value


class CompletionRequest(_OpenAI):
    """``POST /v1/completions``: one string prompt."""

    prompt: Prompt
    max_tokens: int = OPENAI_DEFAULT_MAX_TOKENS

    budget_field: ClassVar[str] = "max_tokens"
    route: ClassVar[str] = "/v1/completions"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    role: Literal["system", "user", "assistant"]
    content: str
    # A speaker line of the play script: no newline or colon, which would start another turn.
    name: str | None = Field(
        None, pattern=SPEAKER_NAME, description="the speaker's name (default: the role's, SPEAKERS)"
    )


class ChatRequest(_OpenAI):
    """``POST /v1/chat/completions``: ``messages`` rendered by ``render_chat``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    max_tokens: int | None = Field(None, description="the older name of max_completion_tokens")

    budget_field: ClassVar[str] = "max_completion_tokens"
    route: ClassVar[str] = "/v1/chat/completions"
    prompt_field: ClassVar[str] = "messages"

    def new_tokens(self, limits) -> int:
        given = self.max_completion_tokens or self.max_tokens
        return given if given is not None else min(OPENAI_DEFAULT_MAX_TOKENS, limits.max_new_tokens)

    def text(self) -> str:
        return render_chat(self.messages)


def render_chat(messages: list[ChatMessage]) -> str:
    """The prompt of a chat: each message a speaker turn ``"NAME:\\ntext\\n\\n"`` (NAME: its ``name``,
    else ``SPEAKERS[role]``, upper-cased), a system message its bare text and a blank line, then
    the assistant's speaker line ``"JULIET:\\n"`` that the reply continues."""
    turns = []
    for m in messages:
        speaker = (m.name or SPEAKERS.get(m.role, "")).upper()
        turns.append(f"{m.content}\n\n" if m.role == "system" else f"{speaker}:\n{m.content}\n\n")
    return "".join(turns) + f"{SPEAKERS['assistant']}:\n"


def models(server, model_id: str | None = None) -> dict[str, Any]:
    """``GET /v1/models`` (a list of the one ``model`` object), or ``/v1/models/{model_id}`` (ApiError
    404 for another id)."""
    model = {"id": server.model_name, "object": "model", "created": int(server.started_unix)}
    model |= {"owned_by": "jaxray", "max_model_len": server.engine.context_len}
    if model_id is None:
        return {"object": "list", "data": [model]}
    server.check_model(model_id)
    return model


async def _merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, str | None]]:
    """(choice, text piece) as the choices produce them, then (choice, None) once each is done."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for piece in choice.pieces():
                queue.put_nowait((choice, piece))
            queue.put_nowait((choice, None))
        except BaseException as err:  # re-raised in the reader; a cancelled one too, not to hang it
            queue.put_nowait((choice, err))
            if not isinstance(err, Exception):
                raise

    tasks, running = [asyncio.get_running_loop().create_task(pump(c)) for c in choices], len(choices)
    try:
        while running:
            choice, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            running -= item is None
            yield choice, item
    finally:
        for task in tasks:
            task.cancel()


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(c.tokens for c in choices)
    total = prompt_tokens + completion
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": total}


class _Reply:
    """One request's answer or stream: its id, object type and model, and its ``choices`` entries."""

    def __init__(self, server, chat: bool):
        self.kind = "chat.completion" if chat else "text_completion"
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model, self.created = server.model_name, int(time.time())

    def choice(self, c: Choice, text: str, chunk: bool, done: bool = True) -> dict:
        """``c``'s entry: text (completions), a message or a delta (chat); its reasons once ``done``."""
        finish, stop = (c.finish_reason, c.stop_reason) if done else (None, None)
        end = {"logprobs": None, "finish_reason": finish, "stop_reason": stop}
        if self.kind == "text_completion":
            return {"index": c.index, "text": text, **end}
        if chunk:
            return {"index": c.index, "delta": {"content": text} if text or not done else {}, **end}
        return {"index": c.index, "message": {"role": "assistant", "content": text}, **end}

    def body(self, choices: list[dict], usage: dict | None = None, chunk: bool = False) -> dict[str, Any]:
        kind = f"{self.kind}.chunk" if chunk and self.kind == "chat.completion" else self.kind
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        body["choices"] = choices
        return body if usage is None else {**body, "usage": usage}


async def _events(reply: _Reply, choices: list[Choice], req: _OpenAI, prompt_tokens: int) -> AsyncIterator:
    """The SSE stream: for chat a first chunk with the assistant role per choice; a chunk per piece;
    a finishing chunk per choice; the usage chunk (``stream_options.include_usage``); ``[DONE]``."""
    if reply.kind == "chat.completion":
        for c in choices:
            role = {**reply.choice(c, "", True, done=False), "delta": {"role": "assistant", "content": ""}}
            yield sse(reply.body([role], chunk=True))
    async for c, piece in _merged(choices):
        yield sse(reply.body([reply.choice(c, piece or "", True, done=piece is None)], chunk=True))
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse(reply.body([], _usage(prompt_tokens, choices), chunk=True))
    yield sse("[DONE]")


async def answer(server, http: HttpRequest, model: type[_OpenAI]):
    """``POST /v1/completions`` (``CompletionRequest``) or ``/v1/chat/completions`` (``ChatRequest``).
    Raises ApiError naming the field."""
    req, choices, prompt_tokens = await server.choices(http, model)
    reply = _Reply(server, model is ChatRequest)
    if req.stream:
        events = guarded(_events(reply, choices, req, prompt_tokens))
        return StreamingResponse(events, media_type="text/event-stream")
    texts = await asyncio.gather(*(c.text() for c in choices))
    out = [reply.choice(c, t, False) for c, t in zip(choices, texts)]
    return reply.body(out, _usage(prompt_tokens, choices))
