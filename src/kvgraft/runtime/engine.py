"""A continuous-batching engine over the paged cache: the engine owns scheduling, the model owns math.

``add_request(prompt_ids, sampling)`` queues a request; each ``step()`` picks rows under a token budget
(every running request's next decode token first, then chunks of prompts being prefilled, then newly
admitted requests), runs the model once on them (one ``BatchContext``: rows at different lengths and
phases), samples each finished row with its own parameters and generator, and returns what each
request produced. When the cache runs out of blocks, the most recently admitted request is preempted:
its blocks are freed and it is re-queued to recompute prompt + output so far (never a crash, and the
same tokens: sampling state is per request). ``cancel(id)`` stops a request at once.

Adapters (``kvgraft.runtime.adapters``): ``load_adapter(name, path)`` installs a kvgraft adapter directory
while the engine runs (between steps), ``add_request(..., adapter=name)`` runs a request with it (rows of
one step may use different adapters, or none), ``unload_adapter(name)`` removes it: refused while
unfinished requests use it, unless ``wait=True``, which refuses new requests for it and unloads it once
the last one finishes.

The engine composes its parts, each in its own module: the scheduler (:mod:`kvgraft.runtime.scheduler`:
which requests run this step, chunked prefill, preemption), the prefix policy
(:mod:`kvgraft.runtime.prefix_policy`: kept prompts, replays), adapter residency
(:mod:`kvgraft.runtime.residency`), the sampler (:mod:`kvgraft.runtime.sampling`) and stop strings
(:mod:`kvgraft.runtime.stops`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvgraft.errors import ConfigError
from kvgraft.model.batch import BatchContext
from kvgraft.model.cache import PagedKVCache
from kvgraft.model.packed import pack_linears, packed_bytes, packing_available
from kvgraft.model.sizes import default_block_size, ring_geometry
from kvgraft.model.transformer import Transformer
from kvgraft.runtime.adapters import Adapter, AdapterFiles, AdapterRegistry
from kvgraft.runtime.budget import KVPool, plan_pool
from kvgraft.runtime.detok import IncrementalText
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.prefix import PrefixCache, replay_layer, replay_span
from kvgraft.runtime.prefix_policy import PrefixPolicy
from kvgraft.runtime.request import FINISHED, RUNNING, WAITING, Request, StepOutput
from kvgraft.runtime.residency import AdapterResidency
from kvgraft.runtime.sampling import Sampler, SamplingParams
from kvgraft.runtime.scheduler import Row, Scheduler
from kvgraft.runtime.stops import StopStrings

__all__ = ["Engine", "Request", "StepOutput", "WAITING", "RUNNING", "FINISHED"]

logger = logging.getLogger(__name__)


class Engine:
    """Continuous batching over one :class:`PagedKVCache`, sized and configured by one
    :class:`~kvgraft.runtime.options.EngineOptions` (None: its defaults).

    The pools are sized from the options' memory budget (:mod:`kvgraft.runtime.budget`); requests are
    admitted while the blocks for their next chunk are free, at most ``max_seqs`` at once, and the latest
    admitted is preempted when the pool runs short. ``self.pool`` (:class:`~kvgraft.runtime.budget.KVPool`)
    says what the budget bought; it is logged at construction (logger ``kvgraft.runtime.engine``, INFO) and
    printed by ``kvgraft serve``. ``detokenize`` turns ids into text for stop strings.

    With ``packed_linears`` on (the default on a CPU that can pack), the model's ``nn.Linear`` layers become
    ``PackedLinear`` in place (training unaffected); results then differ from ``F.linear`` in accumulation
    order only.
    """

    def __init__(
        self,
        model: Transformer,
        options: EngineOptions | None = None,
        *,
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> None:
        if options is None:
            options = EngineOptions()
        if not isinstance(options, EngineOptions):
            raise ConfigError(f"options ({options!r}) must be an EngineOptions or None")
        if detokenize is not None and not callable(detokenize):
            raise ConfigError(f"detokenize ({detokenize!r}) must be a function from token ids to text, or None")
        config = model.config
        self.options = options
        seq_len = config.max_position_embeddings if options.max_seq_len is None else options.max_seq_len
        block_size = default_block_size(config) if options.block_size is None else options.block_size
        max_seqs, max_batch_tokens, packed_linears = options.max_seqs, options.max_batch_tokens, options.packed_linears
        prefix_cache = bool(options.prefix_cache)
        param = next(model.parameters())
        if packed_linears and (param.device.type != "cpu" or not packing_available()):
            raise ConfigError(
                f"packed_linears=True needs a CPU model and a torch build with oneDNN; the model is on "
                f"{param.device} (oneDNN packing {'available' if packing_available() else 'unavailable'}); "
                "pass None (auto) or False"
            )
        cache_dtype = options.torch_dtype or param.dtype
        self.model = model
        # before the pools are sized: a budget taken from free memory sees the packed weights
        self.packed_linears = pack_linears(model) if packed_linears is not False and param.device.type == "cpu" else 0
        # with the prefix cache, kept prompts hold window-ring blocks too: a quarter more ring blocks than the
        # live sequences' rings (the default budget of kept state, below, is also a quarter of the pools)
        nrb = ring_geometry(config, block_size, seq_len)[2]
        ring_blocks = max_seqs * nrb + max(nrb, max_seqs * nrb // 4) if prefix_cache and nrb else None
        self.pool: KVPool = plan_pool(
            config,
            budget=options.kv_budget,
            num_blocks=options.num_blocks,
            block_size=block_size,
            max_seqs=max_seqs,
            max_seq_len=seq_len,
            dtype=cache_dtype,
            device=param.device,
            prefix_cache=prefix_cache,
            ring_blocks=ring_blocks,
        )
        self.cache = PagedKVCache(
            config, self.pool.num_blocks, block_size, max_seqs, seq_len, cache_dtype, param.device, ring_blocks=ring_blocks
        )
        logger.info("%s", self.pool)
        if options.prefault:
            t0 = time.perf_counter()
            self.cache.prefault()
            logger.info("pools written once (prefault): %.1f s", time.perf_counter() - t0)
        if self.packed_linears:
            logger.info(
                "%d linear layers run on oneDNN-packed weights (%.1f MB more)", self.packed_linears, packed_bytes(model) / 1e6
            )
        self.max_batch_tokens = max_batch_tokens
        self.detokenize = detokenize
        self.device = param.device
        self.requests: dict[int, Request] = {}
        self._next_id = 0
        # keys_read / keys_needed: query-key pairs attended per full-attention layer, planned vs needed (padding)
        self.stats = {"steps": 0, "tokens": 0, "preemptions": 0, "peak_used_bytes": 0, "keys_read": 0, "keys_needed": 0}
        self.prefix_stats = {"entries": 0, "bytes": 0, "queries": 0, "hits": 0, "replays": 0, "replayed_tokens": 0}
        prefix_max_bytes = options.prefix_max_bytes
        if prefix_max_bytes is None:  # kept state outside the pools: at most a quarter of the pools' size
            prefix_max_bytes = self.cache.nbytes // 4
        self.replay_layer = replay_layer(config)
        self.prefix = (
            PrefixCache(self.cache, options.prefix_entries, replay_span(config), prefix_max_bytes, replay_from=self.replay_layer)
            if prefix_cache
            else None
        )
        self.prefix_policy = (
            None
            if self.prefix is None
            else PrefixPolicy(model, self.cache, self.prefix, self.replay_layer, max_batch_tokens, self.prefix_stats, self.device)
        )
        self.scheduler = Scheduler(self.cache, max_batch_tokens, self.prefix_policy, self.stats)
        self.adapters = AdapterRegistry(model)
        self.residency = AdapterResidency(self.adapters, self.scheduler.unfinished, self._drop_owner)

    @property
    def waiting(self) -> deque[Request]:
        """Requests waiting for admission, in queue order (the scheduler's queue)."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        """Running requests, in admission order (the scheduler's)."""
        return self.scheduler.running

    def cache_stats(self) -> dict[str, float]:
        """Cache bytes (used, free, total, shared = blocks held more than once, private = the rest of used)
        and the prefix cache's counters (entries, bytes of their copied state, queries, hits, hit rate,
        decoder replays and the tokens they recomputed)."""
        c = self.cache
        shared = c.shared_bytes
        p = self.prefix_stats
        if self.prefix is not None:
            p["entries"], p["bytes"] = len(self.prefix), self.prefix.nbytes
        return {
            "used_bytes": c.used_bytes,
            "free_bytes": c.free_bytes,
            "total_bytes": c.nbytes,
            "shared_bytes": shared,
            "private_bytes": c.used_bytes - shared,
            "prefix_entries": p["entries"],
            "prefix_bytes": p["bytes"],
            "prefix_queries": p["queries"],
            "prefix_hits": p["hits"],
            "prefix_hit_rate": p["hits"] / p["queries"] if p["queries"] else 0.0,
            "replays": p["replays"],
            "replayed_tokens": p["replayed_tokens"],
        }

    # ---- adapters ----------------------------------------------------------------------------------
    def load_adapter(self, name: str, source: str | Path | AdapterFiles) -> Adapter:
        """Install an adapter directory (or files read with ``self.adapters.read``) under ``name``.
        Refuses another base's adapter, a name already loaded and what the adapter layer cannot apply."""
        return self.residency.load(name, source)

    def unload_adapter(self, name: str, wait: bool = False) -> bool:
        """Unload ``name``. With unfinished requests on it: AdapterBusyError, or with ``wait`` refuse new
        requests for it and unload it once they finish. True when unloaded now."""
        return self.residency.unload(name, wait)

    def _drop_owner(self, uid: int) -> None:
        if self.prefix_policy is not None:
            self.prefix_policy.drop_owner(uid)

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None, adapter: str | None = None) -> int:
        """Queue a request (with a loaded adapter's name, or None for the base); its id. Raises ValueError
        for a request the cache could never hold, UnknownAdapterError (listing the loaded ones) for an
        adapter that is not loaded, AdapterError for one being unloaded."""
        sampling = sampling or SamplingParams()
        if adapter is not None:
            self.residency.check_open(adapter)
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must hold at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        total = len(prompt) + sampling.max_new_tokens
        if total > self.cache.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} "
                f"exceeds the engine's max_seq_len ({self.cache.max_seq_len})"
            )
        blocks = math.ceil(total / self.cache.block_size) if self.cache.block_bytes else 0
        if blocks > self.cache.num_blocks:
            raise ValueError(f"a request of {total} tokens needs {blocks} cache blocks; the cache has {self.cache.num_blocks}")
        if sampling.stop and self.detokenize is None:
            raise ValueError("stop strings need a detokenize function (Engine(..., detokenize=...))")
        rid = self._next_id
        self._next_id += 1
        gen = None
        if sampling.temperature > 0:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
        req = Request(rid, prompt, sampling, adapter, generator=gen)
        if sampling.stop and self.detokenize is not None:  # matched on the text as it grows, in linear time
            req.stops, req.decoded = StopStrings(sampling.stop), IncrementalText(self.detokenize)
        self.residency.bind(req, self.replay_layer)
        self.requests[rid] = req
        if sampling.max_new_tokens == 0:
            self.scheduler.finish(req, "length")
        else:
            self.scheduler.enqueue(req)
        return rid

    def cancel(self, request_id: int) -> None:
        """Stop a request now (waiting or running); its blocks are freed. Finished ones are left as they are."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id}")
        if req.status == FINISHED:
            return
        self.scheduler.cancel(req)
        self.residency.reap()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def pop_finished(self, request_id: int) -> Request:
        """Forget a finished request and return it."""
        req = self.requests[request_id]
        if req.status != FINISHED:
            raise ValueError(f"request {request_id} is {req.status}")
        return self.requests.pop(request_id)

    # ---- one step ----------------------------------------------------------------------------------
    def schedule(self) -> list[Row]:
        """Rows of the next step: (request, new tokens); see :meth:`Scheduler.schedule`."""
        return self.scheduler.schedule()

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Run one scheduled batch; one StepOutput per row that sampled a token (a prefill chunk that does not
        reach the end of its prompt samples nothing)."""
        rows = self.schedule()
        if not rows:
            return []
        policy = self.prefix_policy
        if policy is not None:
            policy.run_replays()
        capture = policy is not None and any(policy.needs_hidden(r) for r, _ in rows)
        ctx = BatchContext(
            self.cache,
            [r.cache_seq for r, _ in rows],
            [n for _, n in rows],
            adapter_ids=[r.adapter for r, _ in rows],
            capture_layer=self.replay_layer if capture else None,
        )
        ids = torch.tensor([t for r, n in rows for t in r.tokens[r.computed : r.computed + n]], device=self.device)
        logits = self.model(ids, ctx=ctx, last_only=True)[0]  # (rows, vocab)
        if capture and policy is not None:
            policy.keep_hidden(ctx, rows)
        self.stats["steps"] += 1
        self.stats["tokens"] += ctx.num_tokens
        self.stats["keys_read"] += ctx.plan.keys_read
        self.stats["keys_needed"] += ctx.plan.keys_needed
        self.stats["peak_used_bytes"] = max(self.stats["peak_used_bytes"], self.cache.used_bytes)
        outputs = []
        sampler = Sampler(logits)
        for i, (req, n) in enumerate(rows):
            req.computed += n
            if policy is not None:
                policy.after_row(req)
            if req.computed < len(req.tokens):  # a prefill chunk: nothing to sample yet
                continue
            tok = sampler.token(i, req.sampling, req.generator)
            req.output.append(tok)
            reason = self._finish_reason(req, tok)
            if reason:
                self.scheduler.finish(req, reason)
            outputs.append(StepOutput(req.id, [tok], reason is not None, reason))
        if any(r.status == FINISHED for r, _ in rows):
            self.residency.reap()
        return outputs

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        """Why ``req`` finishes after sampling ``tok`` (None: it goes on): a stop token, a stop string in the
        decoded output, or ``max_new_tokens`` reached."""
        s = req.sampling
        if tok in s.stop_token_ids:
            return "stop"
        if req.stops is not None and req.decoded is not None and req.stops.find(req.decoded.text(req.output)) is not None:
            return "stop"
        if len(req.output) >= s.max_new_tokens:
            return "length"
        return None

    def run(self) -> None:
        """Step until every request has finished."""
        while self.has_unfinished():
            if not self.step() and not self.running:
                raise RuntimeError("the engine scheduled nothing while requests wait (cache too small?)")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        adapters: str | None | Sequence[str | None] = None,
    ) -> list[list[int]]:
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
