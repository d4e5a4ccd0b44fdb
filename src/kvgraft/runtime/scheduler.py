"""Which requests run in the next step, and with how many tokens: the engine's scheduler.

Each step takes rows under a token budget (``max_batch_tokens``): every running request's next tokens first
(decodes, then the chunks of prompts being prefilled, fewest remaining tokens first), then newly admitted
requests in arrival order (FIFO), reserving cache blocks as it goes, so that later rows see what is left. A
chunk ends at the request's next prefix keep point (the prefix policy's ``keep_at``), so its cache can be
kept there. When the pool runs short, prefix entries are evicted first; then the most recently admitted
request is preempted: its blocks are freed and it goes back to the head of the queue, to recompute prompt +
output so far when it is admitted again (the same tokens: sampling state is per request).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import numpy as np

from kvgraft.model.cache import PagedKVCache
from kvgraft.runtime.prefix_policy import PrefixPolicy
from kvgraft.runtime.request import FINISHED, RUNNING, WAITING, Request

Row = tuple[Request, int]  # a request and the number of its tokens the step runs


class Scheduler:
    """The waiting queue and the running requests over one cache (see the module docstring). ``stats`` is
    the engine's ``stats`` dict: preemptions are counted into it."""

    def __init__(self, cache: PagedKVCache, max_batch_tokens: int, prefix: PrefixPolicy | None, stats: dict[str, int]) -> None:
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.prefix = prefix
        self.stats = stats
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def unfinished(self) -> Iterator[Request]:
        """Running requests (in admission order), then waiting ones (in queue order)."""
        yield from self.running
        yield from self.waiting

    def enqueue(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> list[Row]:
        """Rows of the next step: (request, new tokens), decode rows first, then prefill chunks; their
        blocks are reserved here (preempting the latest-admitted requests when the pool runs out)."""
        budget = self.max_batch_tokens
        rows: list[Row] = []
        ordered = sorted(list(self.running), key=lambda r: len(r.tokens) - r.computed)  # decodes first
        ready = self._reserved_decodes(ordered)
        for req in ordered:
            if budget == 0 or req not in self.running:
                continue
            n = self.chunk(req, req.computed, budget)
            if n == 1 and id(req) in ready:  # its next token's block is held and its own: nothing to reserve
                rows.append((req, n))
                budget -= n
                continue
            while not self.cache.can_extend(req.cache_seq, n):
                if self.prefix is not None and self.prefix.evict_one():
                    continue
                victim = self.running[-1]
                self.preempt(victim)
                budget += sum(k for r, k in rows if r is victim)
                rows = [(r, k) for r, k in rows if r is not victim]
                if victim is req:
                    break
            if req not in self.running:
                continue
            self.cache.extend(req.cache_seq, n)  # reserve now: the next rows see what is left
            rows.append((req, n))
            budget -= n
        while self.waiting and budget > 0 and self.cache.free_slots:
            req = self.waiting[0]
            hit = self.prefix.match(req) if self.prefix is not None else None
            seq = None
            if hit:  # a replay rebuilds what depends on the adapter: that comes fresh, the rest is shared
                assert self.prefix is not None
                seq = self.prefix.restore(hit)
                if seq is None:
                    hit = None
            if seq is None:  # it may grow to prompt + max new tokens: its blocks then come consecutive
                seq = self.cache.add_sequence(expect_tokens=len(req.prompt) + req.sampling.max_new_tokens)
                if self.prefix is not None and self.cache.head_major:  # its home run free of kept prompts
                    self.prefix.clear_home(seq)
            computed = hit[0].length if hit else 0
            n = self.chunk(req, computed, budget)
            while not self.cache.can_extend(seq, n) and self.prefix is not None and self.prefix.evict_one():
                pass
            if not self.cache.can_extend(seq, n):
                self.cache.free(seq)
                break
            self.cache.extend(seq, n)
            self.waiting.popleft()
            req.seq, req.status, req.computed = seq, RUNNING, computed
            if self.prefix is not None:
                self.prefix.admitted(req, hit)
            self.running.append(req)
            rows.append((req, n))
            budget -= n
        return rows

    def _reserved_decodes(self, running: list[Request]) -> set[int]:
        """ids of the running requests decoding one token whose cache already holds a block of their own for it
        (``PagedKVCache.reserved``, one array check for all of them): the step reserves nothing for those
        (most decode rows: all but one step in ``block_size``). Preempting another request leaves them so."""
        decodes = [r for r in running if len(r.tokens) - r.computed == 1]
        if not decodes:
            return set()
        slots = np.fromiter((self.cache.slot(r.cache_seq) for r in decodes), dtype=np.int64, count=len(decodes))
        ok = self.cache.reserved(slots, np.ones(len(decodes), dtype=np.int64))
        return {id(r) for r, k in zip(decodes, ok.tolist()) if k}

    def chunk(self, req: Request, computed: int, budget: int) -> int:
        """Tokens of ``req`` to run next: the rest, at most ``budget``, ending at the next keep point first."""
        n = min(len(req.tokens) - computed, budget)
        point = next((p for p in req.keep_at if p > computed), None)
        if point is not None:
            n = min(n, point - computed)
        return n

    def finish(self, req: Request, reason: str) -> None:
        """``req`` is done (``reason``: "length", "stop" or "cancelled"): its cache sequence is freed."""
        if req.seq is not None:
            self.cache.free(req.seq)
            req.seq = None
        if req in self.running:
            self.running.remove(req)
        req.status, req.finish_reason = FINISHED, reason

    def cancel(self, req: Request) -> None:
        """Stop ``req`` now, waiting or running."""
        if req in self.waiting:
            self.waiting.remove(req)
        self.finish(req, "cancelled")

    def preempt(self, req: Request) -> None:
        """Free ``req``'s cache and put it first in the queue; it recomputes prompt + output later."""
        if self.prefix is not None:
            self.prefix.forget(req)
        self.cache.free(req.cache_seq)
        req.seq, req.status, req.computed = None, WAITING, 0
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.stats["preemptions"] += 1
