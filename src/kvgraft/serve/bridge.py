"""The bridge between the HTTP side and the engine: :class:`EngineWorker` runs an
:class:`~kvgraft.runtime.engine.Engine` in its own thread, and the HTTP handlers talk to it only through typed
messages on thread-safe queues, so neither ever blocks the other.

- HTTP -> engine (:attr:`EngineWorker.commands`): :class:`Submit` (a request), :class:`Cancel` (a client
  went away), :class:`LoadAdapter` / :class:`UnloadAdapter` (run between steps; their result or exception
  comes back on a future), :class:`Shutdown` (wakes the engine thread so that it stops at once).
- engine -> HTTP (a :class:`RequestStream` per request, on the request's event loop): the request id or the
  reason it was refused (:attr:`RequestStream.accepted`), then :class:`Tokens` as they are generated, or one
  :class:`Failure`.

Each loop the engine thread takes every waiting command, runs one ``Engine.step()`` and hands each request's
new tokens to its stream with ``loop.call_soon_threadsafe``. At most ``max_in_flight`` requests are in flight
(submitted, not finished); one more raises :class:`QueueFull`. Nothing waits on an engine that has stopped
(:class:`EngineStopped`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgraft.runtime.adapters import Adapter, AdapterFiles
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.sampling import SamplingParams


class QueueFull(Exception):
    pass


class EngineStopped(Exception):
    """The engine thread is not running (not started, stopped, shutting down or failed): answered 503."""


# ---- engine -> HTTP: what a request's stream carries ------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Tokens:
    """New token ids of one request (possibly none), whether it finished and why."""

    ids: list[int]
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class Failure:
    """The request failed (the engine failed, stopped, or is shutting down); nothing follows."""

    message: str


StreamItem = Tokens | Failure


class RequestStream:
    """One request as the HTTP side sees it: an accepted future (request id or exception) and a queue of
    :class:`Tokens` / :class:`Failure` items, both fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.accepted: asyncio.Future[int | None] = loop.create_future()
        self.items: asyncio.Queue[StreamItem] = asyncio.Queue()
        self.rid: int | None = None
        self.done = False  # the engine will send nothing more

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the event loop is closed (shutdown)
            pass

    def accept(self, rid: int | None, exc: BaseException | None = None) -> None:
        """Resolve :attr:`accepted` (from the engine thread): the request id, or the exception that refused it."""

        def set_result() -> None:
            if self.accepted.done():
                return
            if exc is not None:
                self.accepted.set_exception(exc)
            else:
                self.accepted.set_result(rid)

        self._call(set_result)

    def push(self, item: StreamItem) -> None:
        """Queue ``item`` on the request's event loop (from the engine thread)."""

        def put() -> None:
            self.items.put_nowait(item)

        self._call(put)


# ---- HTTP -> engine: commands -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Submit:
    """A new request: its stream is answered with the request id (or the refusal), then its tokens."""

    stream: RequestStream
    prompt: list[int]
    sampling: SamplingParams
    adapter: str | None


@dataclass(frozen=True, slots=True)
class Cancel:
    """The request of ``stream`` is to stop now (its client went away)."""

    stream: RequestStream


@dataclass(frozen=True, slots=True)
class LoadAdapter:
    """Install adapter files (read and checked on the HTTP side) under ``name``; the future gets the Adapter."""

    name: str
    files: AdapterFiles
    future: concurrent.futures.Future[Adapter]


@dataclass(frozen=True, slots=True)
class UnloadAdapter:
    """Unload ``name`` (with ``wait``: once its requests finish); the future gets whether it went now."""

    name: str
    wait: bool
    future: concurrent.futures.Future[bool]


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the engine thread (put by :meth:`EngineWorker.stop`, so that an idle thread wakes at once)."""


Command = Submit | Cancel | LoadAdapter | UnloadAdapter | Shutdown


# ---- the engine thread --------------------------------------------------------------------------------
class EngineWorker:
    """Runs an :class:`~kvgraft.runtime.engine.Engine` in its own thread; everything else talks to it
    through :meth:`submit`, :meth:`cancel` and :meth:`call` (thread-safe, never blocking)."""

    def __init__(self, engine: Engine, max_in_flight: int) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.streams: dict[int, RequestStream] = {}
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
        self.snapshot: dict[str, Any] = {}
        self._cache_at = -1.0
        self.adapters: dict[str, dict[str, Any]] = {}
        self._update_adapters()
        self._update_snapshot()

    # -- lifecycle --
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvgraft-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.commands.put(Shutdown())
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
    def submit(
        self, prompt: list[int], sampling: SamplingParams, adapter: str | None, loop: asyncio.AbstractEventLoop
    ) -> RequestStream:
        self.check_running()
        with self._lock:
            if self.in_flight >= self.max_in_flight:
                self.counts["rejected"] += 1
                raise QueueFull(
                    f"the server's queue is full ({self.in_flight} requests in flight, at most {self.max_in_flight}); retry later"
                )
            self.in_flight += 1
        stream = RequestStream(loop)
        self.commands.put(Submit(stream, prompt, sampling, adapter))
        return stream

    def cancel(self, stream: RequestStream) -> None:
        if not stream.done:
            self.commands.put(Cancel(stream))

    def load_adapter(self, name: str, files: AdapterFiles) -> concurrent.futures.Future[Adapter]:
        """Install ``files`` under ``name`` in the engine thread between steps; the Adapter (or the engine's
        refusal, or EngineStopped when the engine is not running) as a future."""
        future: concurrent.futures.Future[Adapter] = concurrent.futures.Future()
        self._send(LoadAdapter(name, files, future), future)
        return future

    def unload_adapter(self, name: str, wait: bool) -> concurrent.futures.Future[bool]:
        """Unload ``name`` in the engine thread between steps (``Engine.unload_adapter``); whether it went now
        (or the engine's refusal, or EngineStopped) as a future."""
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self._send(UnloadAdapter(name, wait, future), future)
        return future

    def _send(self, cmd: Command, future: concurrent.futures.Future[Any]) -> None:
        try:
            self.check_running()
        except EngineStopped as exc:
            future.set_exception(exc)
            return
        self.commands.put(cmd)

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
            self._close(rid, Failure(message), "error")

    def _drain_commands(self) -> None:
        """After the loop ended: answer every command still queued (nothing will run it)."""
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, Submit):
                with self._lock:
                    self.in_flight -= 1
                cmd.stream.done = True
                cmd.stream.accept(None, EngineStopped("the server is shutting down"))
            elif isinstance(cmd, (LoadAdapter, UnloadAdapter)) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(EngineStopped("the server is shutting down"))

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
                    self._close(rid, Failure(f"the engine failed: {type(exc).__name__}: {exc}"), "error")
                continue
            produced = 0
            for out in outputs:
                produced += len(out.new_token_ids)
                stream = self.streams.get(out.request_id)
                if stream is not None:
                    stream.push(Tokens(out.new_token_ids, out.finished, out.finish_reason))
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
            self._close(rid, Failure("the server is shutting down"), "cancelled")

    def _do(self, cmd: Command) -> None:
        """Carry out one command in the engine thread (:class:`Shutdown` needs nothing here: it only woke the
        thread, which then sees the stop flag)."""
        engine = self.engine
        if isinstance(cmd, Submit):
            stream = cmd.stream
            try:
                rid = engine.add_request(cmd.prompt, cmd.sampling, adapter=cmd.adapter)
            except Exception as exc:  # unknown adapter, a request the cache cannot hold, ...
                with self._lock:
                    self.in_flight -= 1
                stream.done = True
                stream.accept(None, exc)
                return
            stream.rid = rid
            self.streams[rid] = stream
            with self._lock:
                self.prompt_tokens += len(cmd.prompt)
            stream.accept(rid)
        elif isinstance(cmd, Cancel):
            stream = cmd.stream
            if stream.rid is not None and stream.rid in self.streams:
                engine.cancel(stream.rid)
                self._close(stream.rid, Tokens([], True, "cancelled"), "cancelled")
        elif isinstance(cmd, LoadAdapter):
            if cmd.future.set_running_or_notify_cancel():
                try:
                    cmd.future.set_result(engine.load_adapter(cmd.name, cmd.files))
                except Exception as exc:
                    cmd.future.set_exception(exc)
            self._update_adapters()
        elif isinstance(cmd, UnloadAdapter):
            if cmd.future.set_running_or_notify_cancel():
                try:
                    cmd.future.set_result(engine.unload_adapter(cmd.name, cmd.wait))
                except Exception as exc:
                    cmd.future.set_exception(exc)
            self._update_adapters()

    def _close(self, rid: int, item: StreamItem | None, reason: str | None) -> None:
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
        snap = {
            "waiting": len(e.waiting),
            "running": len(e.running),
            "steps": e.stats["steps"],
            "preemptions": e.stats["preemptions"],
            "adapters": len(e.adapters),
            "cache": self.snapshot.get("cache", {}),
        }
        now = time.monotonic()
        if now - self._cache_at > 0.2:
            self._cache_at = now
            snap["cache"] = dict(e.cache_stats())
        self.snapshot = snap  # one assignment: readers see a whole snapshot
