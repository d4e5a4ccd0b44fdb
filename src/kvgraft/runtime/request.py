"""A request as the engine's parts see it (:class:`Request`), and what a step returns for it (:class:`StepOutput`).

The scheduler moves a request between ``WAITING`` and ``RUNNING`` (admission, preemption) and to
``FINISHED``; the prefix policy fills ``keep_at`` and ``hidden``; adapter residency fills ``owner``,
``shares`` and ``same_below`` from the adapter's certificate; the engine appends ``output`` and sets
``finish_reason``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvgraft.runtime.detok import IncrementalText
from kvgraft.runtime.sampling import SamplingParams
from kvgraft.runtime.stops import StopStrings

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Request:
    """One request: its prompt, sampling, adapter, output so far and where it stands in the cache.

    Compared by identity (two requests are never equal), as the scheduler's queues hold them."""

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
    stops: StopStrings | None = None  # the sampling's stop strings, matched as the output grows
    decoded: IncrementalText | None = None  # the output's text, decoded as it grows (with stop strings)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def cache_seq(self) -> int:
        """The cache sequence of a running request (RuntimeError for one that holds none)."""
        if self.seq is None:
            raise RuntimeError(f"request {self.id} holds no cache sequence (it is {self.status})")
        return self.seq


@dataclass(frozen=True)
class StepOutput:
    request_id: int
    new_token_ids: list[int]  # tokens produced by this step (0 or 1)
    finished: bool
    finish_reason: str | None
