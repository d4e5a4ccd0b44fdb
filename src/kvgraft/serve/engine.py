"""A continuous-batching engine over the paged cache: the engine owns scheduling, the model owns math.

``add_request(prompt_ids, sampling)`` queues a request; each ``step()`` picks rows under a token budget
(every running request's next decode token first, then chunks of prompts being prefilled, then newly
admitted requests), runs the model once on them (one ``BatchContext``: rows at different lengths and
phases), samples each finished row with its own parameters and generator, and returns what each
request produced. When the cache runs out of blocks, the most recently admitted request is preempted:
its blocks are freed and it is re-queued to recompute prompt + output so far (never a crash, and the
same tokens: sampling state is per request). ``cancel(id)`` stops a request at once.

Adapters (``kvgraft.serve.adapters``): ``load_adapter(name, path)`` installs a kvgraft adapter directory
while the engine runs (between steps), ``add_request(..., adapter=name)`` runs a request with it (rows of
one step may use different adapters, or none), ``unload_adapter(name)`` removes it: refused while
unfinished requests use it, unless ``wait=True``, which refuses new requests for it and unloads it once
the last one finishes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvgraft.model.batch import BatchContext
from kvgraft.model.cache import CacheFullError, PagedKVCache, default_block_size, ring_geometry
from kvgraft.serve.adapters import (
    Adapter,
    AdapterBusyError,
    AdapterError,
    AdapterFiles,
    AdapterRegistry,
)
from kvgraft.serve.prefix import PrefixCache, PrefixEntry, replay_layer, replay_span
from kvgraft.serve.sampling import SamplingParams, sample_next

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class Request:
    id: int
    prompt: list[int]
    sampling: SamplingParams
    adapter: str | None = None  # a loaded adapter's name; None: the base model
    output: list[int] = field(default_factory=list)
    status: str = WAITING
    finish_reason: str | None = None  # "length" | "stop" | "cancelled"
    seq: int | None = None  # the cache sequence while running
    computed: int = 0  # tokens of prompt + output already in the cache
    generator: torch.Generator | None = None
    owner: object = None  # the adapter's load identity (prefix-cache key); None: the base
    shares: bool = True  # the adapter's certificate lets it read the base's shared cache groups
    same_below: int | None = None  # full-attention base: the first layer whose KV the adapter changes (None: none)
    keep_at: list[int] = field(default_factory=list)  # ascending: keep the cache in the prefix cache there
    hidden: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (first position, replay-layer inputs)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass(frozen=True)
class StepOutput:
    request_id: int
    new_token_ids: list[int]  # tokens produced by this step (0 or 1)
    finished: bool
    finish_reason: str | None


class Engine:
    """Continuous batching over one :class:`PagedKVCache`.

    ``num_blocks`` blocks of ``block_size`` tokens (default 16, rounded up to a multiple of an encoder-decoder's
    compression rate; ``num_blocks`` default: room for ``max_seqs`` full-length
    sequences); ``max_batch_tokens`` new tokens per step at most; ``max_seq_len`` (default: the model's
    ``max_position_embeddings``) bounds prompt + new tokens; ``detokenize`` turns ids into text for
    stop strings. ``prefix_cache``: keep prompts' caches for later requests and certified adapters
    (``kvgraft.serve.prefix``), at most ``prefix_entries`` entries and ``prefix_max_bytes`` of kept state
    outside the pools (default: a quarter of the pools' bytes).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int | None = None,
        block_size: int | None = None,
        max_seqs: int = 32,
        max_batch_tokens: int = 512,
        max_seq_len: int | None = None,
        dtype: torch.dtype | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        prefix_cache: bool = False,
        prefix_entries: int = 32,
        prefix_max_bytes: int | None = None,
    ) -> None:
        config = model.config
        max_seq_len = config.max_position_embeddings if max_seq_len is None else max_seq_len
        block_size = default_block_size(config) if block_size is None else block_size
        for name, value in (("block_size", block_size), ("max_seqs", max_seqs), ("max_batch_tokens", max_batch_tokens),
                            ("max_seq_len", max_seq_len), ("prefix_entries", prefix_entries)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be a positive integer")
        if prefix_max_bytes is not None and (isinstance(prefix_max_bytes, bool) or not isinstance(prefix_max_bytes, int)
                                             or prefix_max_bytes < 0):
            raise ValueError(f"prefix_max_bytes ({prefix_max_bytes!r}) must be a non-negative integer or None")
        if num_blocks is None:
            num_blocks = max_seqs * math.ceil(max_seq_len / block_size)
        param = next(model.parameters())
        self.model = model
        # with the prefix cache, kept prompts hold window-ring blocks too: a quarter more ring blocks than the
        # live sequences' rings (the default budget of kept state, below, is also a quarter of the pools)
        nrb = ring_geometry(config, block_size, max_seq_len)[2]
        ring_blocks = max_seqs * nrb + max(nrb, max_seqs * nrb // 4) if prefix_cache and nrb else None
        self.cache = PagedKVCache(config, num_blocks, block_size, max_seqs, max_seq_len,
                                  dtype or param.dtype, param.device, ring_blocks=ring_blocks)
        self.max_batch_tokens = max_batch_tokens
        self.detokenize = detokenize
        self.device = param.device
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.requests: dict[int, Request] = {}
        self._next_id = 0
        self.stats = {"steps": 0, "tokens": 0, "preemptions": 0, "peak_used_bytes": 0}
        self.adapters = AdapterRegistry(model)
        self.prefix_stats = {"entries": 0, "bytes": 0, "queries": 0, "hits": 0, "replays": 0, "replayed_tokens": 0}
        if prefix_max_bytes is None:  # kept state outside the pools: at most a quarter of the pools' size
            prefix_max_bytes = self.cache.nbytes // 4
        self.replay_layer = replay_layer(config)
        self.prefix = PrefixCache(self.cache, prefix_entries, replay_span(config), prefix_max_bytes,
                                  replay_from=self.replay_layer) if prefix_cache else None
        self._uids: dict[str, int] = {}  # adapter name -> load identity (a reloaded name is another adapter)
        self._next_uid = 0
        self._replays: list[tuple[Request, PrefixEntry, int]] = []

    def cache_stats(self) -> dict[str, float]:
        """Cache bytes (used, free, total, shared = blocks held more than once, private = the rest of used)
        and the prefix cache's counters (entries, bytes of their copied state, queries, hits, hit rate,
        decoder replays and the tokens they recomputed)."""
        c = self.cache
        shared = c.shared_bytes
        p = self.prefix_stats
        if self.prefix is not None:
            p["entries"], p["bytes"] = len(self.prefix), self.prefix.nbytes
        return {"used_bytes": c.used_bytes, "free_bytes": c.free_bytes, "total_bytes": c.nbytes,
                "shared_bytes": shared, "private_bytes": c.used_bytes - shared,
                "prefix_entries": p["entries"], "prefix_bytes": p["bytes"], "prefix_queries": p["queries"],
                "prefix_hits": p["hits"], "prefix_hit_rate": p["hits"] / p["queries"] if p["queries"] else 0.0,
                "replays": p["replays"], "replayed_tokens": p["replayed_tokens"]}

    # ---- adapters ----------------------------------------------------------------------------------
    def load_adapter(self, name: str, source: str | Path | AdapterFiles) -> Adapter:
        """Install an adapter directory (or files read with ``self.adapters.read``) under ``name``.
        Refuses another base's adapter, a name already loaded and what the adapter layer cannot apply."""
        adapter = self.adapters.load(name, source)
        self._uids[name] = self._next_uid
        self._next_uid += 1
        return adapter

    def unload_adapter(self, name: str, wait: bool = False) -> bool:
        """Unload ``name``. With unfinished requests on it: AdapterBusyError, or with ``wait`` refuse new
        requests for it and unload it once they finish. True when unloaded now."""
        adapter = self.adapters.get(name)
        busy = self._requests_of(name)
        if not busy:
            self._unload(name)
            return True
        if not wait:
            raise AdapterBusyError(f"adapter {name!r} has {len(busy)} unfinished requests ({busy[:8]}); cancel them "
                                   "or unload with wait=True (it then unloads when they finish)")
        adapter.draining = True
        return False

    def _requests_of(self, name: str) -> list[int]:
        return [r.id for r in (*self.running, *self.waiting) if r.adapter == name]

    def _reap_adapters(self) -> None:
        for name in [n for n, a in self.adapters.adapters.items() if a.draining]:
            if not self._requests_of(name):
                self._unload(name)

    def _unload(self, name: str) -> None:
        self.adapters.unload(name)
        uid = self._uids.pop(name, None)
        if self.prefix is not None and uid is not None:
            self.prefix.drop_owner(uid)

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None,
                    adapter: str | None = None) -> int:
        """Queue a request (with a loaded adapter's name, or None for the base); its id. Raises ValueError
        for a request the cache could never hold, UnknownAdapterError (listing the loaded ones) for an
        adapter that is not loaded."""
        sampling = sampling or SamplingParams()
        if adapter is not None and self.adapters.get(adapter).draining:
            raise AdapterError(f"adapter {adapter!r} is being unloaded; it takes no new requests")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must hold at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        total = len(prompt) + sampling.max_new_tokens
        if total > self.cache.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} "
                             f"exceeds the engine's max_seq_len ({self.cache.max_seq_len})")
        blocks = math.ceil(total / self.cache.block_size) if self.cache.block_bytes else 0
        if blocks > self.cache.num_blocks:
            raise ValueError(f"a request of {total} tokens needs {blocks} cache blocks; the cache has "
                             f"{self.cache.num_blocks}")
        if sampling.stop and self.detokenize is None:
            raise ValueError("stop strings need a detokenize function (Engine(..., detokenize=...))")
        rid = self._next_id
        self._next_id += 1
        gen = None
        if sampling.temperature > 0:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
        req = Request(rid, prompt, sampling, adapter, generator=gen)
        if adapter is not None:
            req.owner = self._uids[adapter]
            cert = self.adapters.get(adapter).certificate
            req.shares = bool(cert.get("shares_cache")) and (
                self.replay_layer is None or int(cert["first_adapted_layer"]) >= self.replay_layer)
            if self.replay_layer is None:  # full-attention base: layers below the first changed KV are shared
                kv = [int(g.split(":")[1]) for g in cert.get("touched", ()) if g.startswith("kv:")]
                req.same_below = min(kv) if kv else None
        self.requests[rid] = req
        if sampling.max_new_tokens == 0:
            self._finish(req, "length")
        else:
            self.waiting.append(req)
        return rid

    def cancel(self, request_id: int) -> None:
        """Stop a request now (waiting or running); its blocks are freed. Finished ones are left as they are."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id}")
        if req.status == FINISHED:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "cancelled")
        self._reap_adapters()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def pop_finished(self, request_id: int) -> Request:
        """Forget a finished request and return it."""
        req = self.requests[request_id]
        if req.status != FINISHED:
            raise ValueError(f"request {request_id} is {req.status}")
        return self.requests.pop(request_id)

    # ---- one step ----------------------------------------------------------------------------------
    def schedule(self) -> list[tuple[Request, int]]:
        """Rows of the next step: (request, new tokens), decode rows first, then prefill chunks; their
        blocks are reserved here (preempting the latest-admitted requests when the pool runs out)."""
        budget = self.max_batch_tokens
        rows: list[tuple[Request, int]] = []
        for req in sorted(list(self.running), key=lambda r: len(r.tokens) - r.computed):  # decodes first
            if budget == 0 or req not in self.running:
                continue
            n = self._chunk(req, req.computed, budget)
            while not self.cache.can_extend(req.seq, n):
                if self.prefix is not None and self.prefix.evict_one():
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                budget += sum(k for r, k in rows if r is victim)
                rows = [(r, k) for r, k in rows if r is not victim]
                if victim is req:
                    break
            if req not in self.running:
                continue
            self.cache.extend(req.seq, n)  # reserve now: the next rows see what is left
            rows.append((req, n))
            budget -= n
        while self.waiting and budget > 0 and self.cache.free_slots:
            req = self.waiting[0]
            hit = self._match(req)
            seq = None
            if hit:  # a replay rebuilds what depends on the adapter: that comes fresh, the rest is shared
                recompute = hit[1]
                while seq is None:
                    try:
                        seq = self.cache.restore(hit[0].snap, recompute_from=recompute)
                    except CacheFullError:
                        if not self._evict_other(hit[0]):
                            hit = None
                            break
            if seq is None:  # it may grow to prompt + max new tokens: its blocks then come consecutive
                seq = self.cache.add_sequence(expect_tokens=len(req.prompt) + req.sampling.max_new_tokens)
            computed = hit[0].length if hit else 0
            n = self._chunk(req, computed, budget)
            while not self.cache.can_extend(seq, n) and self.prefix is not None and self.prefix.evict_one():
                pass
            if not self.cache.can_extend(seq, n):
                self.cache.free(seq)
                break
            self.cache.extend(seq, n)
            self.waiting.popleft()
            req.seq, req.status, req.computed = seq, RUNNING, computed
            if self.prefix is not None and len(req.prompt) > self.cache.block_size:
                self.prefix_stats["queries"] += 1
            if hit:
                entry, replay = hit
                self.prefix_stats["hits"] += 1
                if replay is not None:
                    self._replays.append((req, entry, replay))
                if entry.hidden is not None and req.keep_at:
                    req.hidden = [(entry.length - entry.hidden.shape[0], entry.hidden)]
            self.running.append(req)
            rows.append((req, n))
            budget -= n
        return rows

    # ---- the prefix cache ------------------------------------------------------------------------
    def _evict_other(self, keep: PrefixEntry) -> bool:
        """Evict the least recently used prefix entry other than ``keep``; False if there is none."""
        return self.prefix is not None and self.prefix.evict_one(spare=keep)

    def _match(self, req: Request) -> tuple[PrefixEntry, bool] | None:
        """The prefix entry ``req`` reuses (and whether it needs a decoder replay); decides where its own
        prompt is kept (``keep_at``): all but the prompt's last token, and the point where it forks from
        a kept prompt (a shared system prompt, say), so that later requests sharing that part hit."""
        req.keep_at, req.hidden = [], []
        if self.prefix is None or len(req.prompt) <= self.cache.block_size:
            return None
        hit = self.prefix.match(req.prompt, req.owner, req.shares, req.same_below)
        done = hit[0].length if hit else 0
        if hit and hit[1] is not None and self.prefix.span is None:
            done -= 1  # a full-attention replay rebuilds the adapter's own layers: keep them too (after it)
        T = len(req.prompt) - 1
        fork = self.prefix.fork_point(req.prompt)
        for point in (fork, T):
            if self.cache.block_size <= point <= T and point > done and point not in req.keep_at and \
                    not self.prefix.covers(req.prompt[:point], req.owner, req.shares, req.same_below):
                req.keep_at.append(point)
        return hit

    def _chunk(self, req: Request, computed: int, budget: int) -> int:
        """Tokens of ``req`` to run next: the rest, at most ``budget``, ending at the next keep point first."""
        n = min(len(req.tokens) - computed, budget)
        point = next((p for p in req.keep_at if p > computed), None)
        if point is not None:
            n = min(n, point - computed)
        return n

    def _needs_hidden(self, req: Request) -> bool:
        return bool(req.keep_at) and req.shares and self.prefix.span is not None

    def _keep_hidden(self, ctx: BatchContext, rows: list[tuple[Request, int]]) -> None:
        """Keep, for requests whose prompt will be kept, the replay layer's inputs over the replay spans."""
        for i, (req, n) in enumerate(rows):
            if not self._needs_hidden(req):
                continue
            lo = max(req.computed, req.keep_at[0] - self.prefix.span)
            hi = min(req.computed + n, req.keep_at[-1])
            if lo < hi:
                off = ctx.offsets[i] - req.computed
                req.hidden.append((lo, ctx.captured[0, off + lo: off + hi].clone()))

    def _keep_prefix(self, req: Request) -> None:
        """Snapshot ``req``'s cache at its first keep point (``req.computed`` tokens) into the prefix cache."""
        T = req.keep_at.pop(0)
        hidden = None
        if req.shares and self.prefix.span is not None:
            want = T - min(self.prefix.span, T)
            parts, pos = [], want
            for start, h in sorted(req.hidden, key=lambda p: p[0]):
                end = start + h.shape[0]
                if end <= pos or start > pos:
                    continue
                parts.append(h[pos - start: T - start])
                pos = min(end, T)
                if pos >= T:
                    break
            if pos >= T:
                hidden = torch.cat(parts)
        self.prefix.insert(req.prompt[:T], self.cache.snapshot(req.seq), req.owner, req.shares, hidden,
                           req.same_below)
        if req.keep_at:  # drop what the next keep point's span does not need
            first = req.keep_at[0] - self.prefix.span if self.prefix.span else 0
            req.hidden = [(st, h) for st, h in req.hidden if st + h.shape[0] > first]
        else:
            req.hidden = []

    def _run_replays(self) -> None:
        """Rebuild the decoder windows of requests that reuse another adapter's prefix (module
        ``kvgraft.serve.prefix``: the replay rule)."""
        for req, entry, layer in self._replays:
            if req.seq is None:
                continue
            if entry.hidden is not None:  # causal encoder-decoder: the decoder over the replay span
                n = entry.hidden.shape[0]
                ctx = BatchContext(self.cache, [req.seq], [n], adapter_ids=[req.adapter], replay=True)
                self.model.replay(entry.hidden, ctx, self.replay_layer)
            else:  # full-attention base: every position again, in chunks, rewriting layers from ``layer`` on
                n = entry.length
                ids = torch.tensor(entry.tokens, device=self.device)
                for a in range(0, n, self.max_batch_tokens):
                    k = min(self.max_batch_tokens, n - a)
                    ctx = BatchContext(self.cache, [req.seq], [k], adapter_ids=[req.adapter], replay=True,
                                       write_from=layer, replay_at=[a])
                    self.model.replay(self.model.embed_tokens(ids[a:a + k])[None], ctx, 0)
                if req.keep_at and req.keep_at[0] == req.computed:  # its own entry: the next request of
                    self._keep_prefix(req)  # this adapter reuses it as it is (the lower layers are the same blocks)
            self.prefix_stats["replays"] += 1
            self.prefix_stats["replayed_tokens"] += n
        self._replays = []

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Run one scheduled batch; one StepOutput per row (and per request finished by a stop)."""
        rows = self.schedule()
        if not rows:
            return []
        self._run_replays()
        capture = self.prefix is not None and any(self._needs_hidden(r) for r, _ in rows)
        ctx = BatchContext(self.cache, [r.seq for r, _ in rows], [n for _, n in rows],
                           adapter_ids=[r.adapter for r, _ in rows],
                           capture_layer=self.replay_layer if capture else None)
        ids = torch.tensor([t for r, n in rows for t in r.tokens[r.computed:r.computed + n]], device=self.device)
        logits = self.model(ids, ctx=ctx, last_only=True)[0]  # (rows, vocab)
        if capture:
            self._keep_hidden(ctx, rows)
        self.stats["steps"] += 1
        self.stats["tokens"] += ctx.num_tokens
        self.stats["peak_used_bytes"] = max(self.stats["peak_used_bytes"], self.cache.used_bytes)
        outputs = []
        greedy = logits.argmax(dim=-1).tolist()
        for i, (req, n) in enumerate(rows):
            req.computed += n
            if req.keep_at and req.computed == req.keep_at[0]:
                self._keep_prefix(req)
            if req.computed < len(req.tokens):  # a prefill chunk: nothing to sample yet
                continue
            s = req.sampling
            if s.temperature == 0:
                tok = greedy[i]
            else:
                tok = int(sample_next(logits[i:i + 1], s.temperature, s.top_p, req.generator)[0])
            req.output.append(tok)
            reason = None
            if tok in s.stop_token_ids:
                reason = "stop"
            elif s.stop and any(x in self.detokenize(req.output) for x in s.stop):
                reason = "stop"
            elif len(req.output) >= s.max_new_tokens:
                reason = "length"
            if reason:
                self._finish(req, reason)
            outputs.append(StepOutput(req.id, [tok], reason is not None, reason))
        if any(r.status == FINISHED for r, _ in rows):
            self._reap_adapters()
        return outputs

    def run(self) -> None:
        """Step until every request has finished."""
        while self.has_unfinished():
            if not self.step() and not self.running:
                raise RuntimeError("the engine scheduled nothing while requests wait (cache too small?)")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams],
                 adapters: str | None | Sequence[str | None] = None) -> list[list[int]]:
        """Generated ids per prompt (prompt excluded), running the engine until all are done; ``adapters``:
        one adapter name (or None) for all prompts, or one per prompt."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        names = [adapters] * len(prompts) if adapters is None or isinstance(adapters, str) else list(adapters)
        if len(names) != len(prompts):
            raise ValueError(f"{len(names)} adapters for {len(prompts)} prompts")
        ids = [self.add_request(p, s, a) for p, s, a in zip(prompts, params, names)]
        self.run()
        return [self.pop_finished(i).output for i in ids]

    # ---- internals ---------------------------------------------------------------------------------
    def _finish(self, req: Request, reason: str) -> None:
        if req.seq is not None:
            self.cache.free(req.seq)
            req.seq = None
        if req in self.running:
            self.running.remove(req)
        req.status, req.finish_reason = FINISHED, reason

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s cache and put it first in the queue; it recomputes prompt + output later."""
        self._replays = [(r, e, x) for r, e, x in self._replays if r is not req]
        self.cache.free(req.seq)
        req.seq, req.status, req.computed = None, WAITING, 0
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.stats["preemptions"] += 1
