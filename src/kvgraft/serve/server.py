"""An OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn): thin, the engine does the work.

```
kvgraft serve kvgraft-ced-8m --adapter geometry=runs/.../adapter --adapter-dir runs --port 8000
```

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (SSE streaming with ``stream: true``,
``data: [DONE]`` last), ``GET /v1/models`` (the base, then every loaded adapter with its placement and
sharing certificate), ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST
/v1/unload_lora_adapter`` ``{"lora_name", "wait"}`` (vLLM's names; loading over HTTP needs
``--adapter-dir``, and a path must resolve inside it), ``GET /health``, ``GET /metrics`` (Prometheus text).
A request's ``model`` is the base model's name (the base directory's name) or a loaded adapter's name.
``build_server(..., with_shipped_adapters=True)`` also serves the example adapters shipped for the base
(:func:`shipped_adapters`: ``models/adapters/``, e.g. ``kvgraft-ced-8m-geometry`` on ``kvgraft-ced-8m``).

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` (:class:`ErrorResponse`), and
``/openapi.json`` documents every status an endpoint returns, with that body:

- 400 ``invalid_request_error``: a body that is not JSON or does not match the schema, an option this
  server does not support (``n > 1``, ``logprobs``, penalties, ``logit_bias``, ``echo``, ``best_of > 1``,
  ``suffix``), a prompt over the context (a prompt's length in tokens, and prompt + ``max_tokens``, are the
  only limits the schema cannot state; everything else it states exactly: what it accepts is accepted).
- 403 ``permission_error``: ``/v1/load_lora_adapter`` with loading over HTTP off, or a ``lora_path`` outside
  ``--adapter-dir``.
- 404 ``not_found_error``: an unknown ``model`` (listing the served ones), unloading an adapter that is not
  loaded, a ``lora_path`` with no adapter; any other path.
- 405: a method a path does not take (with ``Allow``).
- 409: an adapter name already loaded (or the base's), unloading an adapter with requests running (without
  ``wait``), a request for an adapter that is being unloaded.
- 411 / 413: a POST without ``Content-Length`` / with a body over ``max_request_bytes``.
- 422: an adapter directory that cannot be loaded (another base, corrupt or unsupported files).
- 429 ``rate_limit_error``: the queue is full.
- 500 ``server_error``: the engine failed while running the request (a stream gets an ``error`` event).
- 503 ``server_error``: the engine is not running (stopped or shutting down); ``/health`` says so too.

Streaming responses are ``text/event-stream``; ``/metrics`` is Prometheus text. A request never waits on
an engine that has stopped: it gets 503 (or, streaming, an ``error`` event).

**Threads.** The engine runs in its own thread (:class:`EngineWorker`): each loop it takes every command
waiting in a thread-safe queue (add, cancel, load/unload an adapter), then runs one ``Engine.step()`` and
hands each request's new tokens to its asyncio queue with ``loop.call_soon_threadsafe``. HTTP handlers
only put commands and await futures, so they never block the engine (nor the engine them). Adapter files
are read and checked in a worker thread of the HTTP side; installing them happens in the engine thread
between steps. A client that disconnects (streaming or not) cancels its request: its blocks are freed
at once.

**The queue.** At most ``max_seqs + max_queue`` requests are in flight (running or waiting); one more is
answered 429 at once.

**Chat template** (for base models without one of their own, such as kvgraft's reference models): each
message becomes ``<|{role}|>\\n{content}\\n`` (roles system, user, assistant), and the prompt ends with
``<|assistant|>\\n``. Generation stops at the tokenizer's end-of-sequence token, at the request's ``stop``
strings and at ``\\n<|`` (the start of the next turn). A tokenizer that ships a ``chat_template`` uses it
instead (``apply_chat_template``), with only its own stops.

Text: completions decode the generated ids with special tokens skipped; a stop string is cut from the
text (OpenAI's behaviour) and streamed text never shows a part of one (a tail that could begin a stop
string, or an incomplete UTF-8 character, is held back until it resolves).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from kvgraft.serve.adapters import NAME_RE, AdapterBusyError, AdapterError, UnknownAdapterError, read_adapter
from kvgraft.serve.sampling import SamplingParams

CHAT_STOP = "\n<|"
MIN_TEMPERATURE = 1e-6  # below: greedy (see KvgraftServer._sampling)
MIN_TOP_P = 1e-6


def render_chat(messages: list[dict], tokenizer=None) -> str:
    """The prompt text of a chat (see the module docstring)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


# ---- configuration ------------------------------------------------------------------------------------
@dataclass
class ServerConfig:
    model_name: str  # the base model's name in requests and /v1/models
    max_queue: int = 64  # waiting requests beyond the engine's max_seqs running ones; more: 429
    max_tokens_limit: int = 1024  # the most max_tokens a request may ask for
    max_prompt_tokens: int | None = None  # default: the engine's max_seq_len - 1
    max_request_bytes: int = 1 << 20  # request bodies larger than this: 400
    default_max_tokens: int = 16  # completions without max_tokens (OpenAI's default)
    adapter_dir: Path | None = None  # where load_lora_adapter may read; None: loading over HTTP is off

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_tokens_limit", "max_request_bytes", "default_max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_queue" else 1):
                raise ValueError(f"{name} ({value!r}) must be a {'non-negative' if name == 'max_queue' else 'positive'} "
                                 "integer")
        if self.adapter_dir is not None:
            self.adapter_dir = Path(self.adapter_dir).resolve()
            if not self.adapter_dir.is_dir():
                raise ValueError(f"adapter directory {self.adapter_dir} does not exist")


class QueueFull(Exception):
    pass


class EngineStopped(Exception):
    """The engine thread is not running (not started, stopped, shutting down or failed): answered 503."""


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind, param), status_code=status, headers=headers)


# ---- the engine thread --------------------------------------------------------------------------------
class _Stream:
    """One request as the HTTP side sees it: an accepted future (request id or exception) and a queue of
    (new token ids, finished, finish_reason) items, both fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.accepted: asyncio.Future = loop.create_future()
        self.items: asyncio.Queue = asyncio.Queue()
        self.rid: int | None = None
        self.done = False  # the engine will send nothing more

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed (shutdown)
            pass

    def accept(self, rid: int | None, exc: BaseException | None = None) -> None:
        def set_result():
            if not self.accepted.done():
                self.accepted.set_exception(exc) if exc is not None else self.accepted.set_result(rid)
        self._call(set_result)

    def push(self, item: tuple) -> None:
        self._call(self.items.put_nowait, item)


class EngineWorker:
    """Runs an :class:`~kvgraft.serve.engine.Engine` in its own thread; everything else talks to it
    through :meth:`submit`, :meth:`cancel` and :meth:`call` (thread-safe, never blocking)."""

    def __init__(self, engine, max_in_flight: int) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[int, _Stream] = {}
        self._lock = threading.Lock()
        self.in_flight = 0  # submitted and not finished
        self.counts = {"length": 0, "stop": 0, "cancelled": 0, "error": 0, "rejected": 0}
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.errors = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated by a step)
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None
        self.snapshot: dict = {}
        self._cache_at = -1.0
        self.adapters: dict[str, dict] = {}
        self._update_adapters()
        self._update_snapshot()

    # -- lifecycle --
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvgraft-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def pause(self) -> None:
        """Stop stepping (commands are still taken): for tests and maintenance."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    # -- called from other threads --
    def submit(self, prompt: list[int], sampling: SamplingParams, adapter: str | None,
               loop: asyncio.AbstractEventLoop) -> _Stream:
        self.check_running()
        with self._lock:
            if self.in_flight >= self.max_in_flight:
                self.counts["rejected"] += 1
                raise QueueFull(f"the server's queue is full ({self.in_flight} requests in flight, at most "
                                f"{self.max_in_flight}); retry later")
            self.in_flight += 1
        stream = _Stream(loop)
        self.commands.put(("add", stream, prompt, sampling, adapter))
        return stream

    def cancel(self, stream: _Stream) -> None:
        if not stream.done:
            self.commands.put(("cancel", stream))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` in the engine thread between steps; its result as a future (EngineStopped
        when the engine is not running)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self.check_running()
        except EngineStopped as exc:
            future.set_exception(exc)
            return future
        self.commands.put(("call", fn, future))
        return future

    def check_running(self) -> None:
        if self._stop.is_set():
            raise EngineStopped("the server is shutting down")
        if not self.alive:
            raise EngineStopped("the engine is not running")

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        with self._lock:
            n = sum(k for t, k in self._recent if t >= now - window)
        return n / window

    # -- the engine thread --
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug outside a step: fail what is running rather than hang it
            self.errors += 1
            self._fail_all(f"the engine stopped: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._stop.set()
            self._drain_commands()

    def _fail_all(self, message: str) -> None:
        for rid in list(self.streams):
            try:
                self.engine.cancel(rid)
            except Exception:
                pass
            self._close(rid, ("error", message), "error")

    def _drain_commands(self) -> None:
        """After the loop ended: answer every command still queued (nothing will run it)."""
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                with self._lock:
                    self.in_flight -= 1
                cmd[1].done = True
                cmd[1].accept(None, EngineStopped("the server is shutting down"))
            elif cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                cmd[2].set_exception(EngineStopped("the server is shutting down"))

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            idle = self._paused.is_set() or not engine.has_unfinished()
            try:
                cmd = self.commands.get(timeout=0.05) if idle else self.commands.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._do(cmd)
                try:
                    cmd = self.commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._paused.is_set() or not engine.has_unfinished():
                self._check_adapters()
                self._update_snapshot()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a failed forward: fail what was running, keep serving
                self.errors += 1
                for rid in [r.id for r in (*engine.running, *engine.waiting)]:
                    engine.cancel(rid)
                    self._close(rid, ("error", f"the engine failed: {type(exc).__name__}: {exc}"), "error")
                continue
            produced = 0
            for out in outputs:
                produced += len(out.new_token_ids)
                stream = self.streams.get(out.request_id)
                if stream is not None:
                    stream.push(("tokens", out.new_token_ids, out.finished, out.finish_reason))
                if out.finished:
                    self._close(out.request_id, None, out.finish_reason)
            with self._lock:
                self.generated_tokens += produced
                now = time.monotonic()
                self._recent.append((now, produced))
                while self._recent and self._recent[0][0] < now - 60:
                    self._recent.popleft()
            self._check_adapters()
            self._update_snapshot()
        for rid in list(self.streams):  # shutting down: end every stream
            self._close(rid, ("error", "the server is shutting down"), "cancelled")

    def _do(self, cmd: tuple) -> None:
        kind = cmd[0]
        engine = self.engine
        if kind == "add":
            _, stream, prompt, sampling, adapter = cmd
            try:
                rid = engine.add_request(prompt, sampling, adapter=adapter)
            except Exception as exc:  # unknown adapter, a request the cache cannot hold, ...
                with self._lock:
                    self.in_flight -= 1
                stream.done = True
                stream.accept(None, exc)
                return
            stream.rid = rid
            self.streams[rid] = stream
            with self._lock:
                self.prompt_tokens += len(prompt)
            stream.accept(rid)
        elif kind == "cancel":
            stream = cmd[1]
            if stream.rid is not None and stream.rid in self.streams:
                engine.cancel(stream.rid)
                self._close(stream.rid, ("tokens", [], True, "cancelled"), "cancelled")
        elif kind == "call":
            _, fn, future = cmd
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(engine))
                except Exception as exc:
                    future.set_exception(exc)
            self._update_adapters()

    def _close(self, rid: int, item: tuple | None, reason: str | None) -> None:
        stream = self.streams.pop(rid, None)
        if rid in self.engine.requests and self.engine.requests[rid].status == "finished":
            self.engine.pop_finished(rid)
        if stream is None:
            return
        if item is not None:
            stream.push(item)
        stream.done = True
        with self._lock:
            self.in_flight -= 1
            if reason in self.counts:
                self.counts[reason] += 1

    def _update_adapters(self) -> None:
        self.adapters = {n: a.info() for n, a in self.engine.adapters.adapters.items()}

    def _check_adapters(self) -> None:
        """An adapter unloaded with ``wait`` goes when its last request finishes (inside a step or a cancel):
        keep what the HTTP side reads in step."""
        if self.engine.adapters.adapters.keys() != self.adapters.keys():
            self._update_adapters()

    def _update_snapshot(self) -> None:
        """Called in the engine thread between steps: what /metrics reads. ``Engine.cache_stats()`` (cache
        bytes by kind, the prefix cache's counters) is taken at most every 0.2 s, as a shared-block count
        scans the block table."""
        e = self.engine
        snap = {"waiting": len(e.waiting), "running": len(e.running), "steps": e.stats["steps"],
                "preemptions": e.stats["preemptions"], "adapters": len(e.adapters),
                "cache": self.snapshot.get("cache", {})}
        now = time.monotonic()
        if now - self._cache_at > 0.2:
            self._cache_at = now
            snap["cache"] = dict(e.cache_stats())
        self.snapshot = snap  # one assignment: readers see a whole snapshot


# ---- request bodies -----------------------------------------------------------------------------------
# The schema states what the server accepts, exactly (a schema-valid body is accepted, an invalid one is
# refused with 400), bar the limits in tokens (a prompt's length, and prompt + max_tokens against the
# context). Options this server does not implement are in the schema with the one value it takes; the
# check in ``check_supported`` says why another value is refused. Bodies are validated strictly (no
# "1" for 1, no true for 1), as the schema's types say. Limits of one server (max_tokens, the vocabulary,
# the prompt's length in token ids) are filled into /openapi.json by :meth:`KvgraftServer.openapi`.
_NON_EMPTY = {"type": "string", "minLength": 1}


def _integral(value):
    """JSON Schema's integers include 1.0: take a float with no fraction as the int (strict otherwise)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]


def _int(**constraints):
    """An Int with constraints (inside the Annotated, so a union with None keeps them in the schema)."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _schema(**kw) -> dict:
    return {"json_schema_extra": kw}


class _Common(BaseModel):
    model_config = _STRICT

    model: str = Field(description="the base model's name or a loaded adapter's (GET /v1/models)")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: _int(ge=1) = Field(1, description="one choice per request", **_schema(maximum=1))
    stream: bool = False
    stream_options: dict | None = Field(None, description='{"include_usage": true}: a last chunk with usage')
    stop: str | list[str] | None = Field(None, description="up to 4 non-empty strings", **_schema(anyOf=[
        _NON_EMPTY, {"type": "array", "items": _NON_EMPTY, "maxItems": 4}, {"type": "null"}]))
    seed: _int(ge=0) | None = Field(None, description="any integer >= 0 (taken modulo 2**64)")
    logprobs: Any = Field(None, description="not supported", **_schema(enum=[None, False, 0]))
    presence_penalty: float = Field(0.0, description="not supported", **_schema(maximum=0, minimum=0))
    frequency_penalty: float = Field(0.0, description="not supported", **_schema(maximum=0, minimum=0))
    logit_bias: dict | None = Field(None, description="not supported", **_schema(anyOf=[
        {"type": "object", "maxProperties": 0}, {"type": "null"}]))
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
        description="text, token ids, or a list of one of either (one prompt per request)")
    max_tokens: _int(ge=1) | None = None
    echo: bool = Field(False, description="not supported", **_schema(enum=[False]))
    best_of: Int | None = Field(None, description="not supported (1)", **_schema(anyOf=[
        {"type": "integer", "minimum": 0, "maximum": 1}, {"type": "null"}]))
    suffix: str | None = Field(None, description="not supported", **_schema(anyOf=[
        {"type": "string", "maxLength": 0}, {"type": "null"}]))


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict] = Field(description="text, or a list of text parts", **_schema(anyOf=[
        {"type": "string"},
        {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]))

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
    max_tokens: _int(ge=1) | None = None
    max_completion_tokens: _int(ge=1) | None = None


class LoadAdapterRequest(BaseModel):
    model_config = _STRICT

    lora_name: str = Field(description="the name requests will use", **_schema(pattern=NAME_RE.pattern))
    lora_path: str = Field(description="an adapter directory, relative to the server's --adapter-dir")


class UnloadAdapterRequest(BaseModel):
    model_config = _STRICT

    lora_name: str
    wait: bool = Field(False, description="with requests running on the adapter: unload it once they finish "
                                          "(refusing new ones) instead of answering 409")


# ---- response bodies (documentation: /openapi.json) ---------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, permission_error, not_found_error, rate_limit_error or "
                                  "server_error")
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


class AdapterInfo(BaseModel):
    name: str
    path: str
    modules: int
    rank: int
    parameters: int
    placement: dict | None
    certificate: dict
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
    400: "Invalid request: not JSON, not matching the schema, an unsupported option, or a prompt (+ max_tokens) "
         "over the context",
    403: "Loading adapters over HTTP is off (start the server with --adapter-dir), or lora_path is outside it",
    404: "Not found: the model, the adapter, or an adapter at lora_path",
    409: "Conflict with the loaded adapters: a name already loaded, an adapter with requests running, or one "
         "being unloaded",
    411: "The request has no Content-Length header",
    413: "The request body is over this server's limit (max_request_bytes)",
    422: "The adapter directory cannot be loaded: trained on another base, corrupt or unsupported files",
    429: "The server's queue is full; retry later",
    500: "The engine failed while running the request (or installing the adapter)",
    503: "The engine is not running (stopped or shutting down)",
}
_SSE = {"type": "object", "description": "One server-sent event (stream: true): `data: {chunk}` per piece of text "
        "(a chunk object as JSON), an optional usage chunk, then `data: [DONE]`; an engine failure mid-stream is "
        "a `data: {ErrorResponse}` event, then `data: [DONE]`",
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                       "retry": {"type": "integer"}},
        "required": ["data"]}


def _responses(*codes: int) -> dict:
    return {code: {"model": ErrorResponse, "description": _ERRORS[code]} for code in codes}


# ---- text -----------------------------------------------------------------------------------------------
class TextStream:
    """Generated ids -> text that never shows part of a stop string, nor an incomplete character."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]) -> None:
        self.decode, self.stops = decode, stops
        self.hold = max((len(s) - 1 for s in stops), default=0)
        self.sent = ""

    def text(self, ids: list[int], finished: bool) -> str:
        text = self.decode(ids)
        cuts = [text.find(s) for s in self.stops if s in text]
        if cuts:
            return text[: min(cuts)]
        if not finished:
            text = text[: len(text) - self.hold] if self.hold else text
            text = text.rstrip("\ufffd")
        return text

    def delta(self, ids: list[int], finished: bool) -> str:
        text = self.text(ids, finished)
        if not text.startswith(self.sent):  # never retract what was sent
            return ""
        new, self.sent = text[len(self.sent):], text
        return new


def _check_unicode(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (JSON allows "\ud800"): no tokenizer takes it
        raise HTTPError(400, f"the {param} is not valid Unicode (it holds a lone surrogate)", param=param) from None


# ---- the server -----------------------------------------------------------------------------------------
class KvgraftServer:
    """The FastAPI app (``.app``) over an engine run by an :class:`EngineWorker` (``.worker``)."""

    def __init__(self, engine, tokenizer, config: ServerConfig) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.worker = EngineWorker(engine, engine.cache.max_seqs + config.max_queue)
        self.max_seq_len = engine.cache.max_seq_len
        self.max_prompt_tokens = min(config.max_prompt_tokens or self.max_seq_len, self.max_seq_len - 1)
        self.eos = engine.model.config.eos_token_id
        self.created = int(time.time())
        self.app = self._build_app()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- requests to the engine --
    def _adapter_of(self, model: str) -> str | None:
        if model == self.config.model_name:
            return None
        info = self.worker.adapters.get(model)
        if info is not None:
            if info.get("draining"):
                raise HTTPError(409, f"adapter {model!r} is being unloaded; it takes no new requests", param="model")
            return model
        loaded = ", ".join(self.worker.adapters) or "none"
        raise HTTPError(404, f"model {model!r} not found; served: base {self.config.model_name!r}, adapters: {loaded}",
                        kind="not_found_error", param="model")

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise HTTPError(400, f"one prompt per request ({len(prompt)} given)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self._encode(prompt, "prompt")
        else:
            ids = list(prompt)
            vocab = self.engine.model.config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise HTTPError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
        if not ids:
            raise HTTPError(400, "the prompt is empty", param="prompt")
        if len(ids) > self.max_prompt_tokens:
            raise HTTPError(400, f"the prompt has {len(ids)} tokens; this server takes at most "
                                 f"{self.max_prompt_tokens}", param="prompt")
        return ids

    def _encode(self, text: str, param: str) -> list[int]:
        _check_unicode(text, param)
        return self.tokenizer.encode(text)

    def _max_tokens(self, asked: int | None, n_prompt: int, default: int | None) -> int:
        room = self.max_seq_len - n_prompt
        if asked is None:
            asked = min(default or room, room, self.config.max_tokens_limit)
        if asked > self.config.max_tokens_limit:
            raise HTTPError(400, f"max_tokens ({asked}) exceeds this server's limit ({self.config.max_tokens_limit})",
                            param="max_tokens")
        if asked > room:
            raise HTTPError(400, f"prompt ({n_prompt} tokens) + max_tokens ({asked}) exceeds the model's context "
                                 f"({self.max_seq_len} tokens)", param="max_tokens")
        return asked

    def _sampling(self, req: _Common, max_tokens: int, stops: tuple[str, ...]) -> SamplingParams:
        """The engine's parameters. Temperatures below ``MIN_TEMPERATURE`` are greedy and ``top_p`` is at least
        ``MIN_TOP_P``: the sampler works in float32, where 1e-300 is 0 (a division by zero, or every token
        dropped, would fail the engine's step); both are what those values mean in the limit."""
        temperature = float(req.temperature)
        temperature = 0.0 if temperature < MIN_TEMPERATURE else temperature
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                                  top_p=max(float(req.top_p), MIN_TOP_P),
                                  seed=None if req.seed is None else req.seed % 2**64,
                                  stop_token_ids=() if self.eos is None else (self.eos,), stop=stops)
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None

    async def _engine(self, future: asyncio.Future | concurrent.futures.Future):
        """The result of a future the engine thread resolves, or 503 if the engine stops first (never hangs)."""
        future = asyncio.wrap_future(future) if isinstance(future, concurrent.futures.Future) else future
        while True:
            done, _ = await asyncio.wait({future}, timeout=0.5)
            if done:
                break
            if not self.worker.alive:
                future.cancel()
                raise HTTPError(503, "the engine is not running", kind="server_error")
        try:
            return future.result()
        except EngineStopped as exc:
            raise HTTPError(503, str(exc), kind="server_error") from None

    async def _start(self, ids: list[int], sampling: SamplingParams, adapter: str | None) -> _Stream:
        loop = asyncio.get_running_loop()
        try:
            stream = self.worker.submit(ids, sampling, adapter, loop)
        except QueueFull as exc:
            raise HTTPError(429, str(exc), kind="rate_limit_error") from None
        except EngineStopped as exc:
            raise HTTPError(503, str(exc), kind="server_error") from None
        try:
            await self._engine(stream.accepted)
        except asyncio.CancelledError:  # the client went away while the engine took the request
            self.worker.cancel(stream)
            raise
        except UnknownAdapterError as exc:  # unloaded since _adapter_of looked
            raise HTTPError(404, str(exc), kind="not_found_error", param="model") from None
        except AdapterError as exc:  # being unloaded
            raise HTTPError(409, str(exc), param="model") from None
        except ValueError as exc:  # a request the cache cannot hold
            raise HTTPError(400, str(exc)) from None
        return stream

    async def _collect(self, stream: _Stream, request: Request) -> tuple[list[int], str]:
        """Every generated id and the finish reason; cancels the request if the client goes away."""
        ids: list[int] = []
        while True:
            try:
                item = await asyncio.wait_for(stream.items.get(), timeout=0.1)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.worker.cancel(stream)
                    raise HTTPError(499, "client disconnected") from None  # nobody reads it: not in the schema
                if not self.worker.alive and stream.items.empty():
                    raise HTTPError(503, "the engine stopped", kind="server_error") from None
                continue
            if item[0] == "error":
                raise HTTPError(500, item[1], kind="server_error")
            ids.extend(item[1])
            if item[2]:
                return ids, item[3]

    async def _events(self, stream: _Stream, text: TextStream, chunk: Callable[[str, str | None], dict],
                      usage: Callable[[list[int]], dict] | None) -> AsyncIterator[str]:
        ids: list[int] = []
        try:
            while True:
                try:
                    item = await asyncio.wait_for(stream.items.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if self.worker.alive or not stream.items.empty():
                        continue
                    item = ("error", "the engine stopped")
                if item[0] == "error":
                    yield "data: " + json.dumps(error_body(500, item[1], "server_error")) + "\n\n"
                    break
                ids.extend(item[1])
                finished = item[2]
                delta = text.delta(ids, finished)
                if delta or finished:
                    yield "data: " + json.dumps(chunk(delta, item[3] if finished else None)) + "\n\n"
                if finished:
                    if usage is not None:
                        yield "data: " + json.dumps(usage(ids)) + "\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the generator is cancelled) or we are done
            self.worker.cancel(stream)

    @staticmethod
    def _usage(n_prompt: int, n_out: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    # -- endpoints --
    async def completions(self, body: CompletionRequest, request: Request):
        body.check_supported()
        if body.echo or (body.best_of or 1) != 1 or body.suffix:
            raise HTTPError(400, "echo, best_of and suffix are not supported")
        adapter = self._adapter_of(body.model)
        ids = self._prompt_ids(body.prompt)
        stops = body.stops()
        sampling = self._sampling(body, self._max_tokens(body.max_tokens, len(ids), self.config.default_max_tokens),
                                  stops)
        stream = await self._start(ids, sampling, adapter)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        text = TextStream(self.decode, stops)

        def chunk(delta: str, reason: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                    "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}]}

        if body.stream:
            usage = None
            if (body.stream_options or {}).get("include_usage"):
                def usage(out: list[int]) -> dict:
                    return dict(chunk("", None), choices=[], usage=self._usage(len(ids), len(out)))
            return StreamingResponse(self._events(stream, text, chunk, usage), media_type="text/event-stream")
        out, reason = await self._collect(stream, request)
        result = chunk(text.text(out, True), reason)
        result["usage"] = self._usage(len(ids), len(out))
        return result

    async def chat(self, body: ChatRequest, request: Request):
        body.check_supported()
        adapter = self._adapter_of(body.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        own_template = bool(getattr(self.tokenizer, "chat_template", None))
        for m in messages:
            _check_unicode(m["content"], "messages")
        ids = self._prompt_ids(render_chat(messages, self.tokenizer))
        stops = body.stops()
        if not own_template:
            stops += (CHAT_STOP,)
        for field in ("max_tokens", "max_completion_tokens"):  # both are checked, whichever is used
            value = getattr(body, field)
            if value is not None and value > self.config.max_tokens_limit:
                raise HTTPError(400, f"{field} ({value}) exceeds this server's limit ({self.config.max_tokens_limit})",
                                param=field)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sampling = self._sampling(body, self._max_tokens(asked, len(ids), None), stops)
        stream = await self._start(ids, sampling, adapter)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        text = TextStream(self.decode, stops)
        first = [True]

        def chunk(delta: str, reason: str | None) -> dict:
            d = {"content": delta}
            if first[0]:
                d["role"] = "assistant"
                first[0] = False
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}]}

        if body.stream:
            usage = None
            if (body.stream_options or {}).get("include_usage"):
                def usage(out: list[int]) -> dict:
                    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                            "choices": [], "usage": self._usage(len(ids), len(out))}
            return StreamingResponse(self._events(stream, text, chunk, usage), media_type="text/event-stream")
        out, reason = await self._collect(stream, request)
        return {"id": rid, "object": "chat.completion", "created": created, "model": body.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text.text(out, True)},
                             "logprobs": None, "finish_reason": reason}],
                "usage": self._usage(len(ids), len(out))}

    def models(self) -> dict:
        base = {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "kvgraft",
                "root": self.config.model_name, "parent": None, "max_model_len": self.max_seq_len}
        data = [base]
        for name, info in self.worker.adapters.items():
            data.append({"id": name, "object": "model", "created": self.created, "owned_by": "kvgraft",
                         "root": info["path"], "parent": self.config.model_name, "max_model_len": self.max_seq_len,
                         "kvgraft": info})
        return {"object": "list", "data": data}

    def _adapter_path(self, root: Path, lora_path: str) -> Path:
        """``lora_path`` inside ``root``: 403 outside it, 404 when no adapter directory is there."""
        try:
            path = (root / lora_path).resolve()
        except (OSError, ValueError, RuntimeError):  # a NUL byte, a name too long, a symlink loop
            raise HTTPError(404, f"no adapter at lora_path {lora_path!r}", kind="not_found_error",
                            param="lora_path") from None
        if not path.is_relative_to(root):
            raise HTTPError(403, f"lora_path {lora_path!r} is outside the adapter directory", kind="permission_error",
                            param="lora_path")
        try:
            is_dir = path.is_dir()
            is_adapter = is_dir and (path / "adapter_config.json").is_file()
        except (OSError, ValueError):
            is_dir = is_adapter = False
        if not is_dir:
            raise HTTPError(404, f"lora_path {lora_path!r} is not a directory inside the adapter directory",
                            kind="not_found_error", param="lora_path")
        if not is_adapter:
            raise HTTPError(404, f"lora_path {lora_path!r} is not an adapter directory (no adapter_config.json)",
                            kind="not_found_error", param="lora_path")
        return path

    async def load_adapter(self, body: LoadAdapterRequest) -> dict:
        root = self.config.adapter_dir
        if root is None:
            raise HTTPError(403, "loading adapters over HTTP is off: start the server with --adapter-dir DIR",
                            kind="permission_error")
        if not NAME_RE.fullmatch(body.lora_name):
            raise HTTPError(400, f"adapter name {body.lora_name!r} must be 1-64 characters of letters, digits, '.', "
                                 "'_' or '-', starting with a letter or digit", param="lora_name")
        if body.lora_name == self.config.model_name:
            raise HTTPError(409, f"an adapter cannot take the base model's name {body.lora_name!r}", param="lora_name")
        if body.lora_name in self.worker.adapters:
            raise HTTPError(409, f"adapter {body.lora_name!r} is already loaded; unload it first", param="lora_name")
        path = self._adapter_path(root, body.lora_path)
        try:
            files = await run_in_threadpool(read_adapter, path, self.engine.model.config)
        except AdapterError as exc:
            raise HTTPError(422, str(exc), param="lora_path") from None
        except OSError as exc:  # unreadable files
            raise HTTPError(422, f"lora_path {body.lora_path!r} cannot be read ({type(exc).__name__}: {exc.strerror})",
                            param="lora_path") from None
        try:
            adapter = await self._engine(self.worker.call(lambda e: e.load_adapter(body.lora_name, files)))
        except AdapterError as exc:  # loaded meanwhile, or the layers refuse it
            status = 409 if "already loaded" in str(exc) else 422
            raise HTTPError(status, str(exc), param="lora_name" if status == 409 else "lora_path") from None
        return {"loaded": adapter.name, "adapter": adapter.info()}

    async def unload_adapter(self, body: UnloadAdapterRequest) -> dict:
        try:
            now = await self._engine(self.worker.call(lambda e: e.unload_adapter(body.lora_name, body.wait)))
        except UnknownAdapterError as exc:
            raise HTTPError(404, str(exc), kind="not_found_error", param="lora_name") from None
        except AdapterBusyError as exc:
            raise HTTPError(409, str(exc), param="lora_name") from None
        return {"unloaded": body.lora_name if now else None, "draining": None if now else body.lora_name}

    def health(self) -> Response:
        ok = self.worker.alive
        body = {"status": "ok" if ok else "engine stopped", "model": self.config.model_name,
                "adapters": list(self.worker.adapters), "in_flight": self.worker.in_flight}
        return JSONResponse(body, status_code=200 if ok else 503)

    def metrics(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_LATEST)

    # -- the schema --
    def openapi(self) -> dict:
        """FastAPI's schema with this server's limits filled in (max_tokens, the vocabulary, the prompt's
        length in token ids), examples that name the served models, and FastAPI's default 422 validation
        response removed (validation errors are 400 here)."""
        from fastapi.openapi.utils import get_openapi

        app = self.app
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
        vocab = self.engine.model.config.vocab_size
        limit = self.config.max_tokens_limit
        ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}, "minItems": 1,
               "maxItems": self.max_prompt_tokens}
        prompt = comps["CompletionRequest"]["properties"]["prompt"]
        prompt["anyOf"] = [_NON_EMPTY, ids, {"type": "array", "items": _NON_EMPTY, "minItems": 1, "maxItems": 1},
                           {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}]
        for req, fields in (("CompletionRequest", ("max_tokens",)),
                            ("ChatRequest", ("max_tokens", "max_completion_tokens"))):
            for field in fields:
                for option in comps[req]["properties"][field]["anyOf"]:
                    if option.get("type") == "integer":
                        option["maximum"] = limit
        names = [self.config.model_name, *self.worker.adapters]
        for req in ("CompletionRequest", "ChatRequest"):
            comps[req]["properties"]["model"]["examples"] = names
        question, n = "Q: A square has side 7. Area?\nA:", min(8, limit)
        chat = [{"role": "user", "content": "A square has side 7. Area?"}]
        examples = {
            "/v1/completions": [{"model": m, "prompt": question, "max_tokens": n, "temperature": 0} for m in names]
            + [{"model": names[-1], "prompt": question, "max_tokens": n, "stream": True, "stop": ["\n"]}],
            "/v1/chat/completions": [{"model": m, "messages": chat, "max_tokens": n, "temperature": 0} for m in names]
            + [{"model": names[-1], "messages": chat, "max_tokens": n, "stream": True,
                "stream_options": {"include_usage": True}}],
        }
        for path, values in examples.items():
            media = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
            media["examples"] = {f"example{i}": {"value": v} for i, v in enumerate(values)}
        app.openapi_schema = schema
        return schema

    # -- the app --
    def _build_app(self) -> FastAPI:
        from contextlib import asynccontextmanager

        from prometheus_client import CollectorRegistry
        from starlette.exceptions import HTTPException as StarletteHTTPException

        self._registry = CollectorRegistry()
        self._registry.register(_Metrics(self.worker))
        server = self

        @asynccontextmanager
        async def lifespan(app):
            server.worker.start()
            yield
            server.worker.stop()

        app = FastAPI(title="kvgraft", version=_version(), lifespan=lifespan,
                      description="OpenAI-compatible completions over kvgraft's engine; many LoRA adapters on one "
                                  "base. Every error is an ErrorResponse.")
        app.add_middleware(_BodyLimit, limit=self.config.max_request_bytes)

        @app.exception_handler(HTTPError)
        async def http_error(request: Request, exc: HTTPError):
            return error_response(exc.status, exc.message, exc.kind, exc.param)

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError):
            errors = exc.errors()
            parts = [f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errors[:5]]
            param = ".".join(str(x) for x in errors[0].get("loc", ())[1:]) if errors else None
            return error_response(400, "invalid request: " + "; ".join(parts), param=param or None)

        @app.exception_handler(StarletteHTTPException)
        async def starlette_error(request: Request, exc: StarletteHTTPException):  # unknown paths, methods
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return error_response(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None))

        @app.exception_handler(Exception)
        async def server_error(request: Request, exc: Exception):  # a bug: still the documented shape
            return error_response(500, f"internal error: {type(exc).__name__}", "server_error")

        generate = _responses(400, 404, 409, 411, 413, 429, 500, 503)
        stream = {"text/event-stream": {"schema": _SSE}}
        app.post("/v1/completions", responses={
            200: {"model": Completion, "description": "The completion (JSON), or its stream", "content": stream},
            **generate})(self.completions)
        app.post("/v1/chat/completions", responses={
            200: {"model": ChatCompletion, "description": "The chat completion (JSON), or its stream",
                  "content": stream},
            **generate})(self.chat)
        app.get("/v1/models", response_model=None, responses={
            200: {"model": ModelList, "description": "The base, then every loaded adapter"}})(self.models)
        app.post("/v1/load_lora_adapter", response_model=None, responses={
            200: {"model": LoadAdapterResponse, "description": "Loaded"},
            **_responses(400, 403, 404, 409, 411, 413, 422, 500, 503)})(self.load_adapter)
        app.post("/v1/unload_lora_adapter", response_model=None, responses={
            200: {"model": UnloadAdapterResponse, "description": "Unloaded, or unloading once its requests finish"},
            **_responses(400, 404, 409, 411, 413, 500, 503)})(self.unload_adapter)
        app.get("/health", response_model=None, responses={
            200: {"model": Health, "description": "The engine runs"},
            503: {"model": Health, "description": "The engine is not running"}})(self.health)
        app.get("/metrics", response_model=None, response_class=PlainTextResponse, responses={
            200: {"description": "Prometheus text exposition format",
                  "content": {"text/plain": {"schema": {"type": "string"}}}}})(self.metrics)
        app.openapi = self.openapi
        return app


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvgraft")
    except Exception:
        return "0"


class _BodyLimit:
    """Pure ASGI middleware: a POST must say its size (Content-Length: 411 if not) and stay within the
    limit (413 if not)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            length = dict(scope["headers"]).get(b"content-length")
            response = None
            if length is None:
                response = error_response(411, "requests need a Content-Length header")
            elif not length.isdigit():
                response = error_response(400, f"Content-Length {length.decode(errors='replace')!r} is not a number")
            elif int(length) > self.limit:
                response = error_response(413, f"the request body ({int(length)} bytes) exceeds this server's limit "
                                               f"({self.limit} bytes)")
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Metrics:
    """Prometheus collector reading the engine thread's latest snapshot (no locks held across a step)."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        w, s = self.worker, self.worker.snapshot
        queued = max(w.in_flight - s.get("running", 0), 0)
        yield GaugeMetricFamily("kvgraft_queue_depth", "requests waiting for the engine (submitted, not running)",
                                value=queued)
        yield GaugeMetricFamily("kvgraft_running_requests", "requests in the running batch", value=s.get("running", 0))
        yield GaugeMetricFamily("kvgraft_tokens_per_second", "generated tokens per second over the last 10 s",
                                value=w.tokens_per_second())
        yield CounterMetricFamily("kvgraft_generated_tokens", "tokens generated", value=w.generated_tokens)
        yield CounterMetricFamily("kvgraft_prompt_tokens", "prompt tokens of accepted requests", value=w.prompt_tokens)
        requests = CounterMetricFamily("kvgraft_requests", "finished requests by outcome", labels=["outcome"])
        for outcome, n in w.counts.items():
            requests.add_metric([outcome], n)
        yield requests
        c = s.get("cache", {})
        cache = GaugeMetricFamily("kvgraft_cache_bytes", "paged KV cache bytes: used, free, total; shared (blocks "
                                  "held by more than one sequence or prefix-cache entry, each counted once) and "
                                  "private (the rest of used)", labels=["kind"])
        for kind in ("used", "free", "total", "shared", "private"):
            cache.add_metric([kind], c.get(f"{kind}_bytes", 0))
        yield cache
        yield GaugeMetricFamily("kvgraft_prefix_cache_entries", "prefix-cache entries held",
                                value=c.get("prefix_entries", 0))
        yield GaugeMetricFamily("kvgraft_prefix_cache_state_bytes", "bytes of prefix-cache entries outside the "
                                "paged cache: copied per-sequence state and hidden states kept for decoder replay "
                                "(their blocks count in kvgraft_cache_bytes)",
                                value=c.get("prefix_bytes", 0))
        yield GaugeMetricFamily("kvgraft_prefix_cache_hit_rate", "prefix-cache hits / queries since the start",
                                value=c.get("prefix_hit_rate", 0.0))
        yield CounterMetricFamily("kvgraft_prefix_cache_queries", "prefix-cache look-ups",
                                  value=c.get("prefix_queries", 0))
        yield CounterMetricFamily("kvgraft_prefix_cache_hits", "prefix-cache look-ups that found a cached prefix",
                                  value=c.get("prefix_hits", 0))
        yield CounterMetricFamily("kvgraft_decoder_replays", "adapter switches on a cached prefix served by "
                                  "replaying the decoder layers", value=c.get("replays", 0))
        yield CounterMetricFamily("kvgraft_decoder_replayed_tokens", "token positions recomputed by decoder replays",
                                  value=c.get("replayed_tokens", 0))
        yield GaugeMetricFamily("kvgraft_adapters_loaded", "adapters loaded", value=s.get("adapters", 0))
        yield CounterMetricFamily("kvgraft_engine_steps", "engine steps", value=s.get("steps", 0))
        yield CounterMetricFamily("kvgraft_preemptions", "requests preempted (recomputed later)",
                                  value=s.get("preemptions", 0))
        yield CounterMetricFamily("kvgraft_engine_errors", "failed engine steps", value=w.errors)


# ---- building and running -------------------------------------------------------------------------------
def shipped_adapters(base_dir: str | Path, config) -> dict[str, Path]:
    """The example adapters shipped for a base: ``models/adapters/NAME`` (under ``KVGRAFT_MODELS_DIR`` if set)
    whose ``kvgraft_adapter.json`` names this base (its directory name, as a reference) and its architecture
    (``base_fingerprint``), by directory name. Unreadable ones are skipped."""
    from kvgraft.adapters.lora import base_fingerprint
    from kvgraft.reference import models_dir

    root = models_dir() / "adapters"
    name, mine = Path(base_dir).resolve().name, base_fingerprint(config)
    found = {}
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        try:
            meta = json.loads((path / "kvgraft_adapter.json").read_text())
        except (OSError, ValueError):
            continue
        base = meta.get("base")
        if meta.get("base_fingerprint") == mine and isinstance(base, dict) and base.get("name") == name:
            found[path.name] = path
    return found


def build_server(base: str | Path, adapters: dict[str, str | Path] | None = None, *, model_name: str | None = None,
                 max_seqs: int = 16, max_batch_tokens: int = 512, max_seq_len: int | None = None,
                 num_blocks: int | None = None, prefix_cache: bool = True, with_shipped_adapters: bool = False,
                 **config) -> KvgraftServer:
    """Load ``base`` (a model directory or shipped reference name) and its tokenizer, start adapters, build
    the server (not started: run it with uvicorn, or :func:`serve`). ``prefix_cache``: the engine's prefix
    cache (on by default; ``kvgraft serve --no-prefix-cache`` turns it off). ``with_shipped_adapters``: also
    load the example adapters shipped for this base (:func:`shipped_adapters`; ``adapters`` win on a name).
    ``config``: :class:`ServerConfig` fields."""
    from kvgraft.hf import load_pretrained, load_tokenizer_dir
    from kvgraft.reference import resolve_model
    from kvgraft.serve.engine import Engine

    path = resolve_model(base)
    tokenizer = load_tokenizer_dir(path)
    if tokenizer is None:
        raise FileNotFoundError(f"{path} has no tokenizer.json; the server needs one")
    cfg = ServerConfig(model_name=model_name or Path(path).resolve().name, **config)
    model = load_pretrained(path).eval()

    def detok(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    engine = Engine(model, max_seqs=max_seqs, max_batch_tokens=max_batch_tokens, max_seq_len=max_seq_len,
                    num_blocks=num_blocks, detokenize=detok, prefix_cache=prefix_cache)
    adapters = dict(adapters or {})
    if with_shipped_adapters:
        given = {Path(p).resolve() for p in adapters.values()}
        for name, adapter_path in shipped_adapters(path, model.config).items():
            if name != cfg.model_name and adapter_path.resolve() not in given:  # not under another name already
                adapters.setdefault(name, adapter_path)
    for name, adapter_path in adapters.items():
        if name == cfg.model_name:
            raise ValueError(f"an adapter cannot take the base model's name {name!r}")
        engine.load_adapter(name, adapter_path)
    return KvgraftServer(engine, tokenizer, cfg)


def serve(server: KvgraftServer, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    import uvicorn

    uvicorn.run(server.app, host=host, port=port, log_level=log_level)
