"""The FastAPI app of a :class:`~kvgraft.serve.server.KvgraftServer`: its routes (each endpoint with every
status it answers documented, :func:`build_app`), the error handlers that give every refusal OpenAI's error
shape, the request-size limit (:class:`_BodyLimit`) and the ``/openapi.json`` this server serves
(:func:`openapi`: FastAPI's schema with the server's limits and served models filled in).

The endpoints themselves are the server's methods (``completions``, ``chat``, ``models``,
``load_adapter``, ``unload_adapter``, ``health``, ``metrics``): this module only routes to them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.metadata import version
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvgraft.runtime.engine import Engine
from kvgraft.serve.bridge import EngineWorker
from kvgraft.serve.schemas import (
    _NON_EMPTY,
    _SSE,
    ChatCompletion,
    Completion,
    Health,
    HTTPError,
    LoadAdapterResponse,
    ModelList,
    UnloadAdapterResponse,
    _responses,
    error_response,
)


class ServedConfig(Protocol):
    """What the app reads of the server's configuration (:class:`~kvgraft.serve.server.ServerConfig`)."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_tokens_limit(self) -> int: ...

    @property
    def max_request_bytes(self) -> int: ...


class Served(Protocol):
    """What the app needs of the server (:class:`~kvgraft.serve.server.KvgraftServer`): its state, and its
    endpoints as callables whose signatures FastAPI reads."""

    engine: Engine
    worker: EngineWorker
    max_prompt_tokens: int
    app: FastAPI

    @property
    def config(self) -> ServedConfig: ...

    @property
    def completions(self) -> Callable[..., Any]: ...

    @property
    def chat(self) -> Callable[..., Any]: ...

    @property
    def models(self) -> Callable[..., Any]: ...

    @property
    def load_adapter(self) -> Callable[..., Any]: ...

    @property
    def unload_adapter(self) -> Callable[..., Any]: ...

    @property
    def health(self) -> Callable[..., Any]: ...

    @property
    def metrics(self) -> Callable[..., Any]: ...

    def openapi(self) -> dict[str, Any]: ...


def build_app(server: Served) -> FastAPI:
    """The app: starts the server's engine thread on start-up and stops it on shut-down."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.worker.start()
        yield
        server.worker.stop()

    app = FastAPI(
        title="kvgraft",
        version=_version(),
        lifespan=lifespan,
        description="OpenAI-compatible completions over kvgraft's engine; many LoRA adapters on one "
        "base. Every error is an ErrorResponse.",
    )
    app.add_middleware(_BodyLimit, limit=server.config.max_request_bytes)

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, exc: HTTPError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errors[:5]]
        param = ".".join(str(x) for x in errors[0].get("loc", ())[1:]) if errors else None
        return error_response(400, "invalid request: " + "; ".join(parts), param=param or None)

    @app.exception_handler(StarletteHTTPException)
    async def starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # unknown paths, methods
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:  # a bug: still the documented shape
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")

    generate = _responses(400, 404, 409, 411, 413, 429, 500, 503)
    stream = {"text/event-stream": {"schema": _SSE}}
    # response_model=None: what the endpoint's return annotation says is not a response model (a dict, or
    # a stream); the 200 body is documented under ``responses``
    app.post(
        "/v1/completions",
        response_model=None,
        responses={
            200: {"model": Completion, "description": "The completion (JSON), or its stream", "content": stream},
            **generate,
        },
    )(server.completions)
    app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={
            200: {"model": ChatCompletion, "description": "The chat completion (JSON), or its stream", "content": stream},
            **generate,
        },
    )(server.chat)
    app.get(
        "/v1/models",
        response_model=None,
        responses={200: {"model": ModelList, "description": "The base, then every loaded adapter"}},
    )(server.models)
    app.post(
        "/v1/load_lora_adapter",
        response_model=None,
        responses={
            200: {"model": LoadAdapterResponse, "description": "Loaded"},
            **_responses(400, 403, 404, 409, 411, 413, 422, 500, 503),
        },
    )(server.load_adapter)
    app.post(
        "/v1/unload_lora_adapter",
        response_model=None,
        responses={
            200: {"model": UnloadAdapterResponse, "description": "Unloaded, or unloading once its requests finish"},
            **_responses(400, 404, 409, 411, 413, 500, 503),
        },
    )(server.unload_adapter)
    app.get(
        "/health",
        response_model=None,
        responses={
            200: {"model": Health, "description": "The engine runs"},
            503: {"model": Health, "description": "The engine is not running"},
        },
    )(server.health)
    app.get(
        "/metrics",
        response_model=None,
        response_class=PlainTextResponse,
        responses={
            200: {"description": "Prometheus text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}
        },
    )(server.metrics)
    app.openapi = server.openapi  # type: ignore[method-assign]  # FastAPI's documented way to serve a custom schema
    return app


def openapi(server: Served) -> dict[str, Any]:
    """FastAPI's schema with this server's limits filled in (max_tokens, the vocabulary, the prompt's
    length in token ids), examples that name the served models, and FastAPI's default 422 validation
    response removed (validation errors are 400 here)."""
    app = server.app
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for item in schema["paths"].values():
        for op in item.values():
            default = op.get("responses", {}).get("422", {})
            if "HTTPValidationError" in json.dumps(default):
                del op["responses"]["422"]
    comps = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    vocab = server.engine.model.config.vocab_size
    limit = server.config.max_tokens_limit
    ids = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1},
        "minItems": 1,
        "maxItems": server.max_prompt_tokens,
    }
    prompt = comps["CompletionRequest"]["properties"]["prompt"]
    prompt["anyOf"] = [
        _NON_EMPTY,
        ids,
        {"type": "array", "items": _NON_EMPTY, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": ids, "minItems": 1, "maxItems": 1},
    ]
    for req, fields in (("CompletionRequest", ("max_tokens",)), ("ChatRequest", ("max_tokens", "max_completion_tokens"))):
        for field in fields:
            for option in comps[req]["properties"][field]["anyOf"]:
                if option.get("type") == "integer":
                    option["maximum"] = limit
    names = [server.config.model_name, *server.worker.adapters]
    for req in ("CompletionRequest", "ChatRequest"):
        comps[req]["properties"]["model"]["examples"] = names
    question, n = "Q: A square has side 7. Area?\nA:", min(8, limit)
    chat = [{"role": "user", "content": "A square has side 7. Area?"}]
    examples = {
        "/v1/completions": [{"model": m, "prompt": question, "max_tokens": n, "temperature": 0} for m in names]
        + [{"model": names[-1], "prompt": question, "max_tokens": n, "stream": True, "stop": ["\n"]}],
        "/v1/chat/completions": [{"model": m, "messages": chat, "max_tokens": n, "temperature": 0} for m in names]
        + [{"model": names[-1], "messages": chat, "max_tokens": n, "stream": True, "stream_options": {"include_usage": True}}],
    }
    for path, values in examples.items():
        media = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        media["examples"] = {f"example{i}": {"value": v} for i, v in enumerate(values)}
    app.openapi_schema = schema
    return schema


def _version() -> str:
    try:
        return version("kvgraft")
    except Exception:
        return "0"


class _BodyLimit:
    """Pure ASGI middleware: a POST must say its size (Content-Length: 411 if not) and stay within the
    limit (413 if not)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            length = dict(scope["headers"]).get(b"content-length")
            response = None
            if length is None:
                response = error_response(411, "requests need a Content-Length header")
            elif not length.isdigit():
                response = error_response(400, f"Content-Length {length.decode(errors='replace')!r} is not a number")
            elif int(length) > self.limit:
                response = error_response(
                    413, f"the request body ({int(length)} bytes) exceeds this server's limit ({self.limit} bytes)"
                )
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
