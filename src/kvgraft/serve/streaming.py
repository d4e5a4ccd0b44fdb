"""A request's generated tokens as the HTTP answer: :class:`TextStream` (ids -> text that never shows a part
of a stop string, nor an incomplete UTF-8 character), :func:`collect` (the whole answer, for a request that
does not stream) and :func:`sse_events` (server-sent events: ``data: {chunk}`` per piece of text, an
optional usage chunk, then ``data: [DONE]``; an engine failure mid-stream is a ``data: {ErrorResponse}``
event, then ``data: [DONE]``). Both read the request's :class:`~kvgraft.serve.bridge.RequestStream` and
cancel the request when the client goes away.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from kvgraft.runtime.detok import IncrementalText
from kvgraft.runtime.stops import StopStrings
from kvgraft.serve.bridge import EngineWorker, Failure, RequestStream
from kvgraft.serve.schemas import HTTPError, error_body


class TextStream:
    """Generated ids -> text that never shows part of a stop string, nor an incomplete character
    (:meth:`kvgraft.runtime.stops.StopStrings.visible`: cut before the first stop string, and until the
    output finishes without the tail that could still begin one)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]) -> None:
        self.decoded = IncrementalText(decode)  # linear in the output's length, not quadratic
        self.stops = StopStrings(stops)
        self.sent = ""

    def text(self, ids: list[int], finished: bool) -> str:
        """What may be shown of the text of ``ids`` (all of the output so far, growing from call to call)."""
        return self.stops.visible(self.decoded.text(ids), finished)

    def delta(self, ids: list[int], finished: bool) -> str:
        """The text to send now: what :meth:`text` adds to what was sent (nothing if it would retract any)."""
        text = self.text(ids, finished)
        if not text.startswith(self.sent):  # never retract what was sent
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new


async def collect(worker: EngineWorker, stream: RequestStream, request: Request) -> tuple[list[int], str | None]:
    """Every generated id and the finish reason; cancels the request if the client goes away."""
    ids: list[int] = []
    while True:
        try:
            item = await asyncio.wait_for(stream.items.get(), timeout=0.1)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                worker.cancel(stream)
                raise HTTPError(499, "client disconnected") from None  # nobody reads it: not in the schema
            if not worker.alive and stream.items.empty():
                raise HTTPError(503, "the engine stopped", kind="server_error") from None
            continue
        if isinstance(item, Failure):
            raise HTTPError(500, item.message, kind="server_error")
        ids.extend(item.ids)
        if item.finished:
            return ids, item.finish_reason


async def sse_events(
    worker: EngineWorker,
    stream: RequestStream,
    text: TextStream,
    chunk: Callable[[str, str | None], dict[str, Any]],
    usage: Callable[[list[int]], dict[str, Any]] | None,
) -> AsyncIterator[str]:
    """The request's server-sent events (see the module docstring); cancels the request when it ends or the
    client goes away."""
    ids: list[int] = []
    try:
        while True:
            try:
                item = await asyncio.wait_for(stream.items.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if worker.alive or not stream.items.empty():
                    continue
                item = Failure("the engine stopped")
            if isinstance(item, Failure):
                yield "data: " + json.dumps(error_body(500, item.message, "server_error")) + "\n\n"
                break
            ids.extend(item.ids)
            finished = item.finished
            delta = text.delta(ids, finished)
            if delta or finished:
                yield "data: " + json.dumps(chunk(delta, item.finish_reason if finished else None)) + "\n\n"
            if finished:
                if usage is not None:
                    yield "data: " + json.dumps(usage(ids)) + "\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:  # the client went away (the generator is cancelled) or we are done
        worker.cancel(stream)
