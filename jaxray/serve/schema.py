"""HTTP request/response shapes: strict pydantic models parsed from the body bytes (``parse``) under the
server's ``Limits`` (the validation context). Refusals are 4xx in OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}``, plus ``field`` (= ``param``) and ``allowed``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

MAX_SEED = 2**32 - 1
MAX_N, MAX_STOPS = 16, 4  # OpenAI routes: choices per request; stop sequences per request (OpenAI's limit)
DEFAULT_NEW_TOKENS = 128  # /generate without max_new_tokens (lowered to the server's cap if that is smaller)


@dataclass(frozen=True)
class Limits:
    """What a request may ask of this server (from EngineSettings and the model config)."""

    max_new_tokens: int  # cap on new tokens per request
    max_prompt_bytes: int  # UTF-8 bytes of the prompt
    vocab_size: int = 256  # top_k is 1..vocab_size
    context_len: int | None = None  # prompt bytes the model reads (max_model_len); a longer chat is refused
    generation_timeout_s: float | None = None  # seconds a request may generate (None: no limit)

    @property
    def max_body_bytes(self) -> int:
        """Longer bodies are refused unread (413): 6 JSON characters per prompt byte, 4 KiB for the rest."""
        return 6 * self.max_prompt_bytes + 4096


# OpenAI's error types by HTTP status (others: server_error)
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 503: "service_unavailable", 504: "timeout"}  # fmt: skip


class ApiError(Exception):
    """A refused request: HTTP ``status`` and the error body naming ``field``."""

    def __init__(self, status: int, field: str, message: str, allowed: str = ""):
        super().__init__(f"{field}: {message}")
        self.status, self.field, self.message, self.allowed = status, field, message, allowed

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "server_error")
        error = {"message": self.message, "type": kind, "param": self.field, "code": self.status}
        return {"error": {**error, "field": self.field, "allowed": self.allowed}}


def _limits(info: ValidationInfo) -> Limits:
    if not isinstance(info.context, Limits):
        raise TypeError("parse the request with parse(..., limits) so the server's limits apply")
    return info.context


def _check_prompt(prompt: str, info: ValidationInfo) -> str:
    if not prompt:
        raise ValueError("prompt is empty")
    try:
        size = len(prompt.encode("utf-8"))
    except UnicodeEncodeError as err:  # lone surrogates have no UTF-8 form
        raise ValueError(f"prompt is not valid Unicode text ({err.reason} at position {err.start})") from None
    if size > (limit := _limits(info).max_prompt_bytes):
        raise ValueError(f"prompt is {size} UTF-8 bytes, over the limit of {limit}")
    return prompt


def _check_range(value: int | None, info: ValidationInfo) -> int | None:
    """top_k: 1..vocab_size or null; a token budget: 1..max_new_tokens."""
    top_k = info.field_name == "top_k"
    most = _limits(info).vocab_size if top_k else _limits(info).max_new_tokens
    if value is not None and not 1 <= value <= most:
        raise ValueError(f"{info.field_name} must be in 1..{most}{' or null' if top_k else ''}, got {value}")
    return value


Temperature = Annotated[float, Field(ge=0, description="softmax temperature; 0 is greedy")]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED, description="PRNG seed; the same seed gives the same text")]
Prompt = Annotated[str, Field(description="text to continue; only its last max_seq_len - 1 bytes are read")]
TopK = Annotated[int | None, Field(description="sample from the k most likely bytes; null: all")]
Stream = Annotated[bool, Field(description="stream server-sent events as the bytes are produced")]


class SamplingRequest(BaseModel):
    """The checks both routes share; strict: JSON types must match exactly."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)

    _prompt = field_validator("prompt", check_fields=False)(_check_prompt)
    _range = field_validator(
        "top_k", "max_new_tokens", "max_tokens", "max_completion_tokens", check_fields=False
    )(_check_range)
    budget_field: ClassVar[str]  # the route's name for the new-token budget
    route: ClassVar[str]  # the route, as the metrics label it
    prompt_field: ClassVar[str] = "prompt"  # the field an over-long rendered prompt is blamed on

    def text(self) -> str:
        """The prompt the model continues."""
        return self.prompt

    def new_tokens(self, limits: Limits) -> int:
        """The token budget; its default is lowered to the server's cap when the field is not given."""
        value = getattr(self, self.budget_field)
        return value if self.budget_field in self.model_fields_set else min(value, limits.max_new_tokens)


class GenerateRequest(SamplingRequest):
    """``POST /generate``."""

    prompt: Prompt
    max_new_tokens: int = Field(DEFAULT_NEW_TOKENS, description="bytes to generate")
    temperature: Temperature = 0.8
    top_k: TopK = None
    seed: Seed = 0
    stream: Stream = False

    budget_field: ClassVar[str] = "max_new_tokens"
    route: ClassVar[str] = "/generate"
    # Fixed here, fields of the OpenAI routes: one choice, no stop, top_p 1 (all), no model named.
    n: ClassVar[int] = 1
    stop: ClassVar[list[str]] = []
    top_p: ClassVar[float] = 1.0
    model: ClassVar[str | None] = None


class GenerateResponse(BaseModel):
    """The ``POST /generate`` answer (and, less ``text``, the last streamed event)."""

    text: str = Field(description="the new text; invalid UTF-8 bytes become U+FFFD")
    prompt_tokens: int = Field(description="prompt bytes the model read (the last max_seq_len - 1 at most)")
    new_tokens: int = Field(description="bytes generated")
    latency_ms: float = Field(description="from request parsed to last byte, milliseconds")


def allowed(model: type[BaseModel], field: str, limits: Limits) -> str:
    """What ``field`` of ``model`` accepts, in words, for the error body."""
    cap = f"an integer in 1..{limits.max_new_tokens}"
    words = {
        "body": f"a JSON object of at most {limits.max_body_bytes} bytes with the fields "
        f"{', '.join(model.model_fields)}",
        "prompt": f"a non-empty string of at most {limits.max_prompt_bytes} UTF-8 bytes",
        **dict.fromkeys(("max_new_tokens", "max_tokens", "max_completion_tokens"), cap),
        "top_p": "a number in (0, 1]",
        "n": f"an integer in 1..{MAX_N}",
        "stop": f"a string or a list of at most {MAX_STOPS} non-empty strings",
        "stream_options": 'an object {"include_usage": true or false}, with stream: true',
        "messages": 'a non-empty list of {"role": "system", "user" or "assistant", "content": a string, '
        '"name": an optional speaker name of 1..64 letters, digits, spaces, _, \' or -}, rendered to at '
        f"most {limits.max_prompt_bytes} UTF-8 bytes",
        "temperature": "a finite number >= 0 (0 is greedy)",
        "top_k": f"an integer in 1..{limits.vocab_size}, or null"
        + (" or -1 for all" if "n" in model.model_fields else " for all"),
        "seed": f"an integer in 0..{MAX_SEED}" + (", or null: random" if "n" in model.model_fields else ""),
        "stream": "true or false",
        "model": "the served model's id (GET /v1/models), or null",
        "user": "a string (unused)",
    }
    known = model.model_fields.get(field)
    if field != "body" and known is None:
        return f"one of the fields {', '.join(model.model_fields)}"
    return words[field] if field in words else known.description or ""


def parse(model: type[SamplingRequest], body: bytes, limits: Limits) -> SamplingRequest:
    """Parse ``body`` (raw request bytes) into ``model`` under ``limits``. Raises ApiError(400) naming
    the first bad field (or ``body``), ApiError(413) when over ``limits.max_body_bytes``."""
    if len(body) > limits.max_body_bytes:
        message = f"request body is over the limit of {limits.max_body_bytes} bytes"
        raise ApiError(413, "body", message, allowed(model, "body", limits))
    try:
        return model.model_validate_json(body, context=limits)
    except ValidationError as err:
        error = err.errors(include_url=False)[0]
        field, kind = (str(error["loc"][0]) if error["loc"] else "body"), error["type"]
        where = ".".join(str(part) for part in error["loc"]) or "body"  # e.g. messages.0.content
        if kind == "extra_forbidden":
            message = f"unknown field {field!r}"
        elif kind == "missing":
            message = f"{where} is required"
        elif kind in ("json_invalid", "model_type"):
            message = f"the body is not a JSON object ({error['msg']})"
        else:  # pydantic's message for type and range errors; ours (after "Value error, ") for the rest
            message = error["msg"].removeprefix("Value error, ")
            message = message if message.startswith(field) else f"{where}: {message}"
        raise ApiError(400, field, message, allowed(model, field, limits)) from None


def prompt_bytes(model: type[SamplingRequest], req: SamplingRequest, limits: Limits) -> bytes:
    """``req``'s prompt as the model reads it (a chat's messages rendered as a play script), UTF-8.
    Raises ApiError(400) naming ``model.prompt_field`` when it cannot be encoded (a lone surrogate),
    is over ``limits.max_prompt_bytes``, or is a chat over ``limits.context_len``."""
    field = model.prompt_field
    try:
        prompt = req.text().encode("utf-8")
    except UnicodeEncodeError as err:
        message = f"{field}: not valid Unicode text ({err.reason})"
        raise ApiError(400, field, message, allowed(model, field, limits)) from None
    if len(prompt) > (limit := limits.max_prompt_bytes):
        message = f"the rendered prompt is {len(prompt)} UTF-8 bytes, over the limit of {limit}"
    # A completion reads its prompt's last bytes (a window); a chat cut so would lose its system
    # message and first turns unsaid, so it is refused, as vLLM refuses prompts past max_model_len.
    elif field == "messages" and limits.context_len is not None and len(prompt) > limits.context_len:
        message = (
            f"the rendered chat is {len(prompt)} UTF-8 bytes; the model reads at most "
            f"{limits.context_len} (max_model_len): shorten or drop earlier messages"
        )
    else:
        return prompt
    raise ApiError(400, field, message, allowed(model, field, limits))


def sse(data: Any) -> bytes:
    """One server-sent event carrying ``data`` as JSON (or a bare string such as ``[DONE]``)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
