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

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid requests
(validation, unsupported options such as ``n > 1`` or ``logprobs``, a prompt or ``max_tokens`` over the
limits, a body over ``max_request_bytes``), 404 for an unknown ``model`` (listing the loaded ones), 409 for
an adapter name already loaded or an adapter with requests still running, 429 when the queue is full.

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
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from kvgraft.serve.adapters import AdapterBusyError, AdapterError, UnknownAdapterError, read_adapter
from kvgraft.serve.sampling import SamplingParams

CHAT_STOP = "\n<|"


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


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
                   ) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


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
        """Run ``fn(engine)`` in the engine thread between steps; its result as a future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.commands.put(("call", fn, future))
        return future

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        with self._lock:
            n = sum(k for t, k in self._recent if t >= now - window)
        return n / window

    # -- the engine thread --
    def _run(self) -> None:
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
class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
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
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict]

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
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class LoadAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadAdapterRequest(BaseModel):
    lora_name: str
    wait: bool = False


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
        if model in self.worker.adapters:
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
            ids = self.tokenizer.encode(prompt)
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
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=float(req.temperature), top_p=float(req.top_p),
                                  seed=req.seed, stop_token_ids=() if self.eos is None else (self.eos,), stop=stops)
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None

    async def _start(self, ids: list[int], sampling: SamplingParams, adapter: str | None) -> _Stream:
        loop = asyncio.get_running_loop()
        try:
            stream = self.worker.submit(ids, sampling, adapter, loop)
        except QueueFull as exc:
            raise HTTPError(429, str(exc), kind="rate_limit_error") from None
        try:
            await stream.accepted
        except asyncio.CancelledError:  # the client went away while the engine took the request
            self.worker.cancel(stream)
            raise
        except UnknownAdapterError as exc:
            raise HTTPError(404, str(exc), kind="not_found_error", param="model") from None
        except (AdapterError, ValueError) as exc:
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
                    raise HTTPError(499, "client disconnected") from None
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
                item = await stream.items.get()
                if item[0] == "error":
                    yield "data: " + json.dumps({"error": {"message": item[1], "type": "server_error"}}) + "\n\n"
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
        ids = self._prompt_ids(render_chat(messages, self.tokenizer))
        stops = body.stops()
        if not own_template:
            stops += (CHAT_STOP,)
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

    async def load_adapter(self, body: LoadAdapterRequest) -> dict:
        root = self.config.adapter_dir
        if root is None:
            raise HTTPError(403, "loading adapters over HTTP is off: start the server with --adapter-dir DIR",
                            kind="permission_error")
        if body.lora_name == self.config.model_name:
            raise HTTPError(400, f"an adapter cannot take the base model's name {body.lora_name!r}", param="lora_name")
        path = (root / body.lora_path).resolve()
        if not path.is_relative_to(root):
            raise HTTPError(400, f"lora_path {body.lora_path!r} is outside the adapter directory", param="lora_path")
        try:
            files = await run_in_threadpool(read_adapter, path, self.engine.model.config)
            adapter = await asyncio.wrap_future(self.worker.call(lambda e: e.load_adapter(body.lora_name, files)))
        except AdapterError as exc:
            raise HTTPError(409 if "already loaded" in str(exc) else 400, str(exc)) from None
        return {"loaded": adapter.name, "adapter": adapter.info()}

    async def unload_adapter(self, body: UnloadAdapterRequest) -> dict:
        try:
            now = await asyncio.wrap_future(self.worker.call(lambda e: e.unload_adapter(body.lora_name, body.wait)))
        except UnknownAdapterError as exc:
            raise HTTPError(404, str(exc), kind="not_found_error", param="lora_name") from None
        except AdapterBusyError as exc:
            raise HTTPError(409, str(exc)) from None
        return {"unloaded": body.lora_name if now else None, "draining": None if now else body.lora_name}

    def health(self) -> Response:
        ok = self.worker.alive
        body = {"status": "ok" if ok else "engine stopped", "model": self.config.model_name,
                "adapters": list(self.worker.adapters), "in_flight": self.worker.in_flight}
        return JSONResponse(body, status_code=200 if ok else 503)

    def metrics(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_LATEST)

    # -- the app --
    def _build_app(self) -> FastAPI:
        from contextlib import asynccontextmanager

        from prometheus_client import CollectorRegistry

        self._registry = CollectorRegistry()
        self._registry.register(_Metrics(self.worker))
        server = self

        @asynccontextmanager
        async def lifespan(app):
            server.worker.start()
            yield
            server.worker.stop()

        app = FastAPI(title="kvgraft", lifespan=lifespan)
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

        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        app.get("/v1/models")(self.models)
        app.post("/v1/load_lora_adapter")(self.load_adapter)
        app.post("/v1/unload_lora_adapter")(self.unload_adapter)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics)
        return app


class _BodyLimit:
    """Pure ASGI middleware: a POST must say its size (Content-Length) and stay within the limit."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            length = dict(scope["headers"]).get(b"content-length")
            response = None
            if length is None:
                response = error_response(411, "requests need a Content-Length header")
            elif not length.isdigit() or int(length) > self.limit:
                response = error_response(400, f"the request body ({length.decode(errors='replace')} bytes) exceeds "
                                               f"this server's limit ({self.limit} bytes)")
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
def build_server(base: str | Path, adapters: dict[str, str | Path] | None = None, *, model_name: str | None = None,
                 max_seqs: int = 16, max_batch_tokens: int = 512, max_seq_len: int | None = None,
                 num_blocks: int | None = None, prefix_cache: bool = True, **config) -> KvgraftServer:
    """Load ``base`` (a model directory or shipped reference name) and its tokenizer, start adapters, build
    the server (not started: run it with uvicorn, or :func:`serve`). ``prefix_cache``: the engine's prefix
    cache (on by default; ``kvgraft serve --no-prefix-cache`` turns it off). ``config``: :class:`ServerConfig`
    fields."""
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
    for name, adapter_path in (adapters or {}).items():
        if name == cfg.model_name:
            raise ValueError(f"an adapter cannot take the base model's name {name!r}")
        engine.load_adapter(name, adapter_path)
    return KvgraftServer(engine, tokenizer, cfg)


def serve(server: KvgraftServer, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    import uvicorn

    uvicorn.run(server.app, host=host, port=port, log_level=log_level)
