"""The HTTP bodies of :mod:`kvgraft.serve.server`: the pydantic request and response models, the error body
(OpenAI's shape, :class:`ErrorResponse`) and :class:`HTTPError` that every refusal raises, and the
documentation of each error status in ``/openapi.json`` (:func:`_responses`).

The request models are what the server accepts, exactly: a schema-valid body is accepted, an invalid one is
refused with 400 (see the comment above :class:`_Common`). The response models are what the endpoints answer:
``Completion`` and ``ChatCompletion`` (documented in ``/openapi.json``), and each event of their streams
(``CompletionChunk``, ``ChatCompletionChunk``; a key left unset is absent from the event).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from kvgraft.runtime.adapters import NAME_RE


# ---- errors -----------------------------------------------------------------------------------------------
class HTTPError(Exception):
    """A refusal: answered with ``status`` and OpenAI's error body (``kind`` is its ``type``)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind, param), status_code=status, headers=headers)


# ---- request bodies -----------------------------------------------------------------------------------
# The schema states what the server accepts, exactly (a schema-valid body is accepted, an invalid one is
# refused with 400), bar the limits in tokens (a prompt's length, and prompt + max_tokens against the
# context). Options this server does not implement are in the schema with the one value it takes; the
# check in ``check_supported`` says why another value is refused. Bodies are validated strictly (no
# "1" for 1, no true for 1), as the schema's types say. Limits of one server (max_tokens, the vocabulary,
# the prompt's length in token ids) are filled into /openapi.json by :func:`kvgraft.serve.routes.openapi`.
_NON_EMPTY: dict[str, Any] = {"type": "string", "minLength": 1}


def _integral(value: object) -> object:
    """JSON Schema's integers include 1.0: take a float with no fraction as the int (strict otherwise)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]


def _int(**constraints: Any) -> Any:
    """An Int with constraints (inside the Annotated, so a union with None keeps them in the schema)."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


# _int(...) spelled out, as type checkers read no call in an annotation
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
NonNegativeInt = Annotated[int, Field(ge=0), BeforeValidator(_integral)]


_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _schema(**kw: Any) -> dict[str, Any]:
    return {"json_schema_extra": kw}


class _Common(BaseModel):
    model_config = _STRICT

    model: str = Field(description="the base model's name or a loaded adapter's (GET /v1/models)")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: PositiveInt = Field(1, description="one choice per request", json_schema_extra=dict(maximum=1))
    stream: bool = False
    stream_options: dict[str, Any] | None = Field(None, description='{"include_usage": true}: a last chunk with usage')
    stop: str | list[str] | None = Field(
        None,
        description="up to 4 non-empty strings",
        json_schema_extra=dict(anyOf=[_NON_EMPTY, {"type": "array", "items": _NON_EMPTY, "maxItems": 4}, {"type": "null"}]),
    )
    seed: NonNegativeInt | None = Field(None, description="any integer >= 0 (taken modulo 2**64)")
    logprobs: Any = Field(None, description="not supported", json_schema_extra=dict(enum=[None, False, 0]))
    presence_penalty: float = Field(0.0, description="not supported", json_schema_extra=dict(maximum=0, minimum=0))
    frequency_penalty: float = Field(0.0, description="not supported", json_schema_extra=dict(maximum=0, minimum=0))
    logit_bias: dict[str, Any] | None = Field(
        None,
        description="not supported",
        json_schema_extra=dict(anyOf=[{"type": "object", "maxProperties": 0}, {"type": "null"}]),
    )
    user: str | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise HTTPError(400, f"n={self.n} is not supported: one choice per request", param="n")
        if self.logprobs not in (None, False, 0):
            raise HTTPError(400, "logprobs are not supported", param="logprobs")
        if self.presence_penalty or self.frequency_penalty:
            raise HTTPError(400, "presence/frequency penalties are not supported", param="presence_penalty")
        if self.logit_bias:
            raise HTTPError(400, "logit_bias is not supported", param="logit_bias")

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > 4 or any(not s for s in stops):
            raise HTTPError(400, "stop takes at most 4 non-empty strings", param="stop")
        return stops


class CompletionRequest(_Common):
    prompt: str | list[Int] | list[str] | list[list[Int]] = Field(
        description="text, token ids, or a list of one of either (one prompt per request)"
    )
    max_tokens: PositiveInt | None = None
    echo: bool = Field(False, description="not supported", json_schema_extra=dict(enum=[False]))
    best_of: Int | None = Field(
        None,
        description="not supported (1)",
        json_schema_extra=dict(anyOf=[{"type": "integer", "minimum": 0, "maximum": 1}, {"type": "null"}]),
    )
    suffix: str | None = Field(
        None, description="not supported", json_schema_extra=dict(anyOf=[{"type": "string", "maxLength": 0}, {"type": "null"}])
    )


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]] = Field(
        description="text, or a list of text parts",
        json_schema_extra=dict(
            anyOf=[
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    },
                },
            ]
        ),
    )

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise HTTPError(400, "message content parts must be text parts", param="messages")
            parts.append(p["text"])
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None


class LoadAdapterRequest(BaseModel):
    model_config = _STRICT

    lora_name: str = Field(description="the name requests will use", json_schema_extra=dict(pattern=NAME_RE.pattern))
    lora_path: str = Field(description="an adapter directory, relative to the server's --adapter-dir")


class UnloadAdapterRequest(BaseModel):
    model_config = _STRICT

    lora_name: str
    wait: bool = Field(
        False,
        description="with requests running on the adapter: unload it once they finish "
        "(refusing new ones) instead of answering 409",
    )


# ---- response bodies (documentation: /openapi.json) ---------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, permission_error, not_found_error, rate_limit_error or server_error")
    param: str | None = Field(description="the request field at fault, if one is")
    code: int | None = Field(description="the HTTP status")


class ErrorResponse(BaseModel):
    """Every error this server answers, in OpenAI's shape."""

    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One event of a streamed completion; the last one, with ``stream_options.include_usage``, has no choices
    and the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class ChatCompletionDelta(BaseModel):
    """What a chat stream's event adds: its text, and the role in the first event only."""

    content: str
    role: Literal["assistant"] | None = None


class ChatCompletionChunkChoice(BaseModel):
    index: int
    delta: ChatCompletionDelta
    logprobs: None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion; the last one, with ``stream_options.include_usage``, has no
    choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None


class AdapterInfo(BaseModel):
    name: str
    path: str
    modules: int
    rank: int
    parameters: int
    placement: dict[str, Any] | None
    certificate: dict[str, Any]
    draining: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int
    kvgraft: AdapterInfo | None = Field(None, description="adapters only: placement, rank, sharing certificate")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class LoadAdapterResponse(BaseModel):
    loaded: str
    adapter: AdapterInfo


class UnloadAdapterResponse(BaseModel):
    unloaded: str | None = Field(description="the adapter, unloaded now")
    draining: str | None = Field(description="the adapter, unloading once its requests finish (wait: true)")


class Health(BaseModel):
    status: str = Field(description='"ok", or why not')
    model: str
    adapters: list[str]
    in_flight: int


_ERRORS = {
    400: "Invalid request: not JSON, not matching the schema, an unsupported option, or a prompt (+ max_tokens) over the context",
    403: "Loading adapters over HTTP is off (start the server with --adapter-dir), or lora_path is outside it",
    404: "Not found: the model, the adapter, or an adapter at lora_path",
    409: "Conflict with the loaded adapters: a name already loaded, an adapter with requests running, or one being unloaded",
    411: "The request has no Content-Length header",
    413: "The request body is over this server's limit (max_request_bytes)",
    422: "The adapter directory cannot be loaded: trained on another base, corrupt or unsupported files",
    429: "The server's queue is full; retry later",
    500: "The engine failed while running the request (or installing the adapter)",
    503: "The engine is not running (stopped or shutting down)",
}
_SSE = {
    "type": "object",
    "description": "One server-sent event (stream: true): `data: {chunk}` per piece of text "
    "(a chunk object as JSON), an optional usage chunk, then `data: [DONE]`; an engine failure mid-stream is "
    "a `data: {ErrorResponse}` event, then `data: [DONE]`",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}


def _responses(*codes: int) -> dict[int | str, Any]:
    return {code: {"model": ErrorResponse, "description": _ERRORS[code]} for code in codes}
