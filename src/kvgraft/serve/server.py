"""An OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn): thin, the engine does the work.

```
kvgraft serve kvgraft-ced-8m --adapter geometry=runs/.../adapter --adapter-dir runs --port 8000
```

This module owns :class:`KvgraftServer` (request validation and limits, each endpoint, the engine's answers
as HTTP), :func:`build_server`, :func:`serve`, :func:`shipped_adapters` and the chat template
(:func:`render_chat`: ``<|{role}|>\\n{content}\\n`` per message, ending ``<|assistant|>\\n``, generation
stopping at ``\\n<|``, for a tokenizer without a ``chat_template`` of its own). A request's ``model`` is the
base's name (its directory name) or a loaded adapter's. At most ``max_seqs + max_queue`` requests are in
flight; one more is answered 429. Errors use OpenAI's shape (:class:`~kvgraft.serve.schemas.ErrorResponse`),
and ``/openapi.json`` documents every status each endpoint returns. A stop string is cut from the text and
streamed text never shows a part of one. A client that disconnects cancels its request.

Elsewhere: the pydantic bodies and error documentation in :mod:`kvgraft.serve.schemas`, the engine thread
(HTTP handlers never block it) in :mod:`kvgraft.serve.bridge`, text and SSE streaming in
:mod:`kvgraft.serve.streaming`, the FastAPI app and ``/openapi.json`` in :mod:`kvgraft.serve.routes`, the
Prometheus collector in :mod:`kvgraft.serve.metrics`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import uvicorn
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from kvgraft.adapters.lora import base_fingerprint
from kvgraft.checks import check_int
from kvgraft.errors import ConfigError
from kvgraft.hf import load_pretrained, load_tokenizer_dir
from kvgraft.model.config import ModelConfig
from kvgraft.reference import models_dir, resolve_model
from kvgraft.runtime.adapters import NAME_RE, AdapterBusyError, AdapterError, UnknownAdapterError, read_adapter
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams
from kvgraft.serve import routes
from kvgraft.serve.bridge import EngineStopped, EngineWorker, QueueFull, RequestStream
from kvgraft.serve.metrics import metrics_registry
from kvgraft.serve.schemas import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionDelta,
    ChatCompletionMessage,
    ChatRequest,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    HTTPError,
    LoadAdapterRequest,
    UnloadAdapterRequest,
    Usage,
    _Common,
)
from kvgraft.serve.streaming import TextStream, collect, sse_events

CHAT_STOP = "\n<|"
MIN_TEMPERATURE = 1e-6  # below: greedy (see KvgraftServer._sampling)
MIN_TOP_P = 1e-6


class Tokenizer(Protocol):
    """What the server needs of a tokenizer (a ``transformers.PreTrainedTokenizerFast``, as
    ``kvgraft.hf.load_tokenizer_dir`` gives; a chat template, when it has one, is read as ``chat_template``
    and applied with ``apply_chat_template``)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(
        self, conversation: list[dict[str, str]], *, tokenize: bool = ..., add_generation_prompt: bool = ...
    ) -> Any: ...


_T = TypeVar("_T")


def render_chat(messages: list[dict[str, str]], tokenizer: Tokenizer | None = None) -> str:
    """The prompt text of a chat (see the module docstring)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return str(text)  # tokenize=False: the text
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
            check_int(name, value, low=0 if name == "max_queue" else 1)
        if self.adapter_dir is not None:
            self.adapter_dir = Path(self.adapter_dir).resolve()
            if not self.adapter_dir.is_dir():
                raise ConfigError(f"adapter directory {self.adapter_dir} does not exist")


def _check_unicode(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (JSON allows "\ud800"): no tokenizer takes it
        raise HTTPError(400, f"the {param} is not valid Unicode (it holds a lone surrogate)", param=param) from None


# ---- the server -----------------------------------------------------------------------------------------
class KvgraftServer:
    """The FastAPI app (``.app``) over an engine run by an :class:`EngineWorker` (``.worker``)."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, config: ServerConfig) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.worker = EngineWorker(engine, engine.cache.max_seqs + config.max_queue)
        self.max_seq_len = engine.cache.max_seq_len
        self.max_prompt_tokens = min(config.max_prompt_tokens or self.max_seq_len, self.max_seq_len - 1)
        self.eos = engine.model.config.eos_token_id
        self.created = int(time.time())
        self._registry = metrics_registry(self.worker)
        self.app = routes.build_app(self)

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
        raise HTTPError(
            404,
            f"model {model!r} not found; served: base {self.config.model_name!r}, adapters: {loaded}",
            kind="not_found_error",
            param="model",
        )

    def _prompt_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        """The token ids of a request's prompt (text or ids, alone or as a list of one), checked against the
        vocabulary and this server's limit; HTTPError 400 otherwise."""
        first = prompt[0] if isinstance(prompt, list) and prompt else None
        if isinstance(first, (str, list)):
            if len(prompt) != 1:
                raise HTTPError(400, f"one prompt per request ({len(prompt)} given)", param="prompt")
            one: str | list[int] = first
        else:  # text, or a list of ids (the lists of text or of lists are the case above)
            one = cast("str | list[int]", prompt)
        if isinstance(one, str):
            ids = self._encode(one, "prompt")
        else:
            ids = list(one)
            vocab = self.engine.model.config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise HTTPError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
        if not ids:
            raise HTTPError(400, "the prompt is empty", param="prompt")
        if len(ids) > self.max_prompt_tokens:
            raise HTTPError(
                400, f"the prompt has {len(ids)} tokens; this server takes at most {self.max_prompt_tokens}", param="prompt"
            )
        return ids

    def _encode(self, text: str, param: str) -> list[int]:
        _check_unicode(text, param)
        return self.tokenizer.encode(text)

    def _max_tokens(self, asked: int | None, n_prompt: int, default: int | None) -> int:
        room = self.max_seq_len - n_prompt
        if asked is None:
            asked = min(default or room, room, self.config.max_tokens_limit)
        if asked > self.config.max_tokens_limit:
            raise HTTPError(
                400, f"max_tokens ({asked}) exceeds this server's limit ({self.config.max_tokens_limit})", param="max_tokens"
            )
        if asked > room:
            raise HTTPError(
                400,
                f"prompt ({n_prompt} tokens) + max_tokens ({asked}) exceeds the model's context ({self.max_seq_len} tokens)",
                param="max_tokens",
            )
        return asked

    def _sampling(self, req: _Common, max_tokens: int, stops: tuple[str, ...]) -> SamplingParams:
        """The engine's parameters. Temperatures below ``MIN_TEMPERATURE`` are greedy and ``top_p`` is at least
        ``MIN_TOP_P``: the sampler works in float32, where 1e-300 is 0 (a division by zero, or every token
        dropped, would fail the engine's step); both are what those values mean in the limit."""
        temperature = float(req.temperature)
        temperature = 0.0 if temperature < MIN_TEMPERATURE else temperature
        try:
            return SamplingParams(
                max_new_tokens=max_tokens,
                temperature=temperature,
                top_p=max(float(req.top_p), MIN_TOP_P),
                seed=None if req.seed is None else req.seed % 2**64,
                stop_token_ids=() if self.eos is None else (self.eos,),
                stop=stops,
            )
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None

    async def _engine(self, future: asyncio.Future[_T] | concurrent.futures.Future[_T]) -> _T:
        """The result of a future the engine thread resolves, or 503 if the engine stops first (never hangs)."""
        waited = asyncio.wrap_future(future) if isinstance(future, concurrent.futures.Future) else future
        while True:
            done, _ = await asyncio.wait({waited}, timeout=0.5)
            if done:
                break
            if not self.worker.alive:
                waited.cancel()
                raise HTTPError(503, "the engine is not running", kind="server_error")
        try:
            return waited.result()
        except EngineStopped as exc:
            raise HTTPError(503, str(exc), kind="server_error") from None

    async def _start(self, ids: list[int], sampling: SamplingParams, adapter: str | None) -> RequestStream:
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

    @staticmethod
    def _usage(n_prompt: int, n_out: int) -> Usage:
        return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out)

    # -- endpoints --
    async def completions(self, body: CompletionRequest, request: Request) -> dict[str, Any] | StreamingResponse:
        body.check_supported()
        if body.echo or (body.best_of or 1) != 1 or body.suffix:
            raise HTTPError(400, "echo, best_of and suffix are not supported")
        adapter = self._adapter_of(body.model)
        ids = self._prompt_ids(body.prompt)
        stops = body.stops()
        sampling = self._sampling(body, self._max_tokens(body.max_tokens, len(ids), self.config.default_max_tokens), stops)
        stream = await self._start(ids, sampling, adapter)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        text = TextStream(self.decode, stops)

        def event(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionChunk:
            head = CompletionChunk(id=rid, object="text_completion", created=created, model=body.model, choices=choices)
            return head if usage is None else head.model_copy(update={"usage": usage})

        def choice(delta: str, reason: str | None) -> CompletionChoice:
            return CompletionChoice(index=0, text=delta, logprobs=None, finish_reason=reason)

        def chunk(delta: str, reason: str | None) -> dict[str, Any]:
            return event([choice(delta, reason)]).model_dump(exclude_unset=True)

        if body.stream:
            usage: Callable[[list[int]], dict[str, Any]] | None = None
            if (body.stream_options or {}).get("include_usage"):

                def usage_chunk(out: list[int]) -> dict[str, Any]:
                    return event([], self._usage(len(ids), len(out))).model_dump()

                usage = usage_chunk
            return StreamingResponse(sse_events(self.worker, stream, text, chunk, usage), media_type="text/event-stream")
        out, reason = await collect(self.worker, stream, request)
        return Completion(
            id=rid,
            object="text_completion",
            created=created,
            model=body.model,
            choices=[choice(text.text(out, True), reason)],
            usage=self._usage(len(ids), len(out)),
        ).model_dump()

    async def chat(self, body: ChatRequest, request: Request) -> dict[str, Any] | StreamingResponse:
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
                raise HTTPError(
                    400, f"{field} ({value}) exceeds this server's limit ({self.config.max_tokens_limit})", param=field
                )
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sampling = self._sampling(body, self._max_tokens(asked, len(ids), None), stops)
        stream = await self._start(ids, sampling, adapter)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        text = TextStream(self.decode, stops)
        first = [True]

        def event(choices: list[ChatCompletionChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            head = ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=created, model=body.model, choices=choices)
            return head if usage is None else head.model_copy(update={"usage": usage})

        def chunk(delta: str, reason: str | None) -> dict[str, Any]:
            d = ChatCompletionDelta(content=delta, role="assistant") if first[0] else ChatCompletionDelta(content=delta)
            first[0] = False
            choice = ChatCompletionChunkChoice(index=0, delta=d, logprobs=None, finish_reason=reason)
            return event([choice]).model_dump(exclude_unset=True)

        if body.stream:
            usage: Callable[[list[int]], dict[str, Any]] | None = None
            if (body.stream_options or {}).get("include_usage"):

                def usage_chunk(out: list[int]) -> dict[str, Any]:
                    return event([], self._usage(len(ids), len(out))).model_dump()

                usage = usage_chunk
            return StreamingResponse(sse_events(self.worker, stream, text, chunk, usage), media_type="text/event-stream")
        out, reason = await collect(self.worker, stream, request)
        message = ChatCompletionMessage(role="assistant", content=text.text(out, True))
        return ChatCompletion(
            id=rid,
            object="chat.completion",
            created=created,
            model=body.model,
            choices=[ChatCompletionChoice(index=0, message=message, logprobs=None, finish_reason=reason)],
            usage=self._usage(len(ids), len(out)),
        ).model_dump()

    def models(self) -> dict[str, Any]:
        base = {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvgraft",
            "root": self.config.model_name,
            "parent": None,
            "max_model_len": self.max_seq_len,
        }
        data = [base]
        for name, info in self.worker.adapters.items():
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "kvgraft",
                    "root": info["path"],
                    "parent": self.config.model_name,
                    "max_model_len": self.max_seq_len,
                    "kvgraft": info,
                }
            )
        return {"object": "list", "data": data}

    def _adapter_path(self, root: Path, lora_path: str) -> Path:
        """``lora_path`` inside ``root``: 403 outside it, 404 when no adapter directory is there."""
        try:
            path = (root / lora_path).resolve()
        except (OSError, ValueError, RuntimeError):  # a NUL byte, a name too long, a symlink loop
            raise HTTPError(404, f"no adapter at lora_path {lora_path!r}", kind="not_found_error", param="lora_path") from None
        if not path.is_relative_to(root):
            raise HTTPError(
                403, f"lora_path {lora_path!r} is outside the adapter directory", kind="permission_error", param="lora_path"
            )
        try:
            is_dir = path.is_dir()
            is_adapter = is_dir and (path / "adapter_config.json").is_file()
        except (OSError, ValueError):
            is_dir = is_adapter = False
        if not is_dir:
            raise HTTPError(
                404,
                f"lora_path {lora_path!r} is not a directory inside the adapter directory",
                kind="not_found_error",
                param="lora_path",
            )
        if not is_adapter:
            raise HTTPError(
                404,
                f"lora_path {lora_path!r} is not an adapter directory (no adapter_config.json)",
                kind="not_found_error",
                param="lora_path",
            )
        return path

    async def load_adapter(self, body: LoadAdapterRequest) -> dict[str, Any]:
        root = self.config.adapter_dir
        if root is None:
            raise HTTPError(
                403, "loading adapters over HTTP is off: start the server with --adapter-dir DIR", kind="permission_error"
            )
        if not NAME_RE.fullmatch(body.lora_name):
            raise HTTPError(
                400,
                f"adapter name {body.lora_name!r} must be 1-64 characters of letters, digits, '.', "
                "'_' or '-', starting with a letter or digit",
                param="lora_name",
            )
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
            raise HTTPError(
                422, f"lora_path {body.lora_path!r} cannot be read ({type(exc).__name__}: {exc.strerror})", param="lora_path"
            ) from None
        try:
            adapter = await self._engine(self.worker.load_adapter(body.lora_name, files))
        except AdapterError as exc:  # loaded meanwhile, or the layers refuse it
            status = 409 if "already loaded" in str(exc) else 422
            raise HTTPError(status, str(exc), param="lora_name" if status == 409 else "lora_path") from None
        return {"loaded": adapter.name, "adapter": adapter.info()}

    async def unload_adapter(self, body: UnloadAdapterRequest) -> dict[str, Any]:
        try:
            now = await self._engine(self.worker.unload_adapter(body.lora_name, body.wait))
        except UnknownAdapterError as exc:
            raise HTTPError(404, str(exc), kind="not_found_error", param="lora_name") from None
        except AdapterBusyError as exc:
            raise HTTPError(409, str(exc), param="lora_name") from None
        return {"unloaded": body.lora_name if now else None, "draining": None if now else body.lora_name}

    def health(self) -> Response:
        ok = self.worker.alive
        body = {
            "status": "ok" if ok else "engine stopped",
            "model": self.config.model_name,
            "adapters": list(self.worker.adapters),
            "in_flight": self.worker.in_flight,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    def metrics(self) -> Response:
        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_LATEST)

    # -- the schema --
    def openapi(self) -> dict[str, Any]:
        """``/openapi.json``: :func:`kvgraft.serve.routes.openapi` (FastAPI's schema with this server's limits
        and served models filled in)."""
        return routes.openapi(self)


# ---- building and running -------------------------------------------------------------------------------
def shipped_adapters(base_dir: str | Path, config: ModelConfig) -> dict[str, Path]:
    """The example adapters shipped for a base: ``models/adapters/NAME`` (under ``KVGRAFT_MODELS_DIR`` if set)
    whose ``kvgraft_adapter.json`` names this base (its directory name, as a reference) and its architecture
    (``base_fingerprint``), by directory name. Unreadable ones are skipped."""

    root = models_dir() / "adapters"
    name, mine = Path(base_dir).resolve().name, base_fingerprint(config)
    found: dict[str, Path] = {}
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        try:
            meta = json.loads((path / "kvgraft_adapter.json").read_text())
        except (OSError, ValueError):
            continue
        base = meta.get("base")
        if meta.get("base_fingerprint") == mine and isinstance(base, dict) and base.get("name") == name:
            found[path.name] = path
    return found


def build_server(
    base: str | Path,
    adapters: dict[str, str | Path] | None = None,
    *,
    model_name: str | None = None,
    engine_options: EngineOptions | None = None,
    with_shipped_adapters: bool = False,
    **config: Any,
) -> KvgraftServer:
    """Load ``base`` (a model directory or shipped reference name) and its tokenizer, start adapters, build
    the server (not started: run it with uvicorn, or :func:`serve`). ``engine_options``: the engine's sizes,
    memory budget, dtype (the weights' and the cache's) and prefix cache
    (:class:`~kvgraft.runtime.options.EngineOptions`; None: its defaults; the prefix cache is on unless
    ``prefix_cache=False``).
    ``with_shipped_adapters``: also load the example adapters shipped for this base (:func:`shipped_adapters`;
    ``adapters`` win on a name). ``config``: :class:`ServerConfig` fields."""

    path = resolve_model(base)
    tokenizer: Tokenizer | None = load_tokenizer_dir(path)
    if tokenizer is None:
        raise FileNotFoundError(f"{path} has no tokenizer.json; the server needs one")
    cfg = ServerConfig(model_name=model_name or Path(path).resolve().name, **config)
    options = engine_options or EngineOptions()
    if options.prefix_cache is None:  # the server keeps prompts by default (kvgraft serve --no-prefix-cache)
        options = replace(options, prefix_cache=True)
    model = load_pretrained(path, dtype=options.torch_dtype).eval()

    def detok(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    engine = Engine(model, options, detokenize=detok)
    adapters = dict(adapters or {})
    if with_shipped_adapters:
        given = {Path(p).resolve() for p in adapters.values()}
        for name, adapter_path in shipped_adapters(path, model.config).items():
            if name != cfg.model_name and adapter_path.resolve() not in given:  # not under another name already
                adapters.setdefault(name, adapter_path)
    for name, source in adapters.items():
        if name == cfg.model_name:
            raise ConfigError(f"an adapter cannot take the base model's name {name!r}")
        engine.load_adapter(name, source)
    return KvgraftServer(engine, tokenizer, cfg)


def serve(server: KvgraftServer, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    uvicorn.run(server.app, host=host, port=port, log_level=log_level)
