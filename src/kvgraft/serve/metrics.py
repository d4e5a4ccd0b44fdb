"""``GET /metrics``: a Prometheus collector over the engine thread's latest snapshot
(:attr:`~kvgraft.serve.bridge.EngineWorker.snapshot`, taken between steps, so no lock is held across a step)
and the worker's counters.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvgraft.serve.bridge import EngineWorker

if TYPE_CHECKING:  # prometheus_client ships no type information: these read as Any
    from prometheus_client import CollectorRegistry, Metric


def metrics_registry(worker: EngineWorker) -> CollectorRegistry:
    """A registry holding only this worker's metrics (prometheus_client is imported here, when a server is
    built, not when the module is)."""

    registry = CollectorRegistry()
    registry.register(_Metrics(worker))
    return registry


class _Metrics:
    """Prometheus collector reading the engine thread's latest snapshot (no locks held across a step)."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        w, s = self.worker, self.worker.snapshot
        queued = max(w.in_flight - s.get("running", 0), 0)
        yield GaugeMetricFamily("kvgraft_queue_depth", "requests waiting for the engine (submitted, not running)", value=queued)
        yield GaugeMetricFamily("kvgraft_running_requests", "requests in the running batch", value=s.get("running", 0))
        yield GaugeMetricFamily(
            "kvgraft_tokens_per_second", "generated tokens per second over the last 10 s", value=w.tokens_per_second()
        )
        yield CounterMetricFamily("kvgraft_generated_tokens", "tokens generated", value=w.generated_tokens)
        yield CounterMetricFamily("kvgraft_prompt_tokens", "prompt tokens of accepted requests", value=w.prompt_tokens)
        requests = CounterMetricFamily("kvgraft_requests", "finished requests by outcome", labels=["outcome"])
        for outcome, n in w.counts.items():
            requests.add_metric([outcome], n)
        yield requests
        c = s.get("cache", {})
        cache = GaugeMetricFamily(
            "kvgraft_cache_bytes",
            "paged KV cache bytes: used, free, total; shared (blocks "
            "held by more than one sequence or prefix-cache entry, each counted once) and "
            "private (the rest of used)",
            labels=["kind"],
        )
        for kind in ("used", "free", "total", "shared", "private"):
            cache.add_metric([kind], c.get(f"{kind}_bytes", 0))
        yield cache
        yield GaugeMetricFamily("kvgraft_prefix_cache_entries", "prefix-cache entries held", value=c.get("prefix_entries", 0))
        yield GaugeMetricFamily(
            "kvgraft_prefix_cache_state_bytes",
            "bytes of prefix-cache entries outside the "
            "paged cache: copied per-sequence state and hidden states kept for decoder replay "
            "(their blocks count in kvgraft_cache_bytes)",
            value=c.get("prefix_bytes", 0),
        )
        yield GaugeMetricFamily(
            "kvgraft_prefix_cache_hit_rate", "prefix-cache hits / queries since the start", value=c.get("prefix_hit_rate", 0.0)
        )
        yield CounterMetricFamily("kvgraft_prefix_cache_queries", "prefix-cache look-ups", value=c.get("prefix_queries", 0))
        yield CounterMetricFamily(
            "kvgraft_prefix_cache_hits", "prefix-cache look-ups that found a cached prefix", value=c.get("prefix_hits", 0)
        )
        yield CounterMetricFamily(
            "kvgraft_decoder_replays",
            "adapter switches on a cached prefix served by replaying the decoder layers",
            value=c.get("replays", 0),
        )
        yield CounterMetricFamily(
            "kvgraft_decoder_replayed_tokens", "token positions recomputed by decoder replays", value=c.get("replayed_tokens", 0)
        )
        yield GaugeMetricFamily("kvgraft_adapters_loaded", "adapters loaded", value=s.get("adapters", 0))
        yield CounterMetricFamily("kvgraft_engine_steps", "engine steps", value=s.get("steps", 0))
        yield CounterMetricFamily("kvgraft_preemptions", "requests preempted (recomputed later)", value=s.get("preemptions", 0))
        yield CounterMetricFamily("kvgraft_engine_errors", "failed engine steps", value=w.errors)
