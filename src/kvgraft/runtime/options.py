"""``EngineOptions``: how an engine sizes its pools and steps, one typed object validated on construction
(the engine, ``kvgraft serve`` and the benchmarks all pass one)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgraft.checks import check_int
from kvgraft.errors import ConfigError
from kvgraft.runtime.budget import KVBudget, check_kv_budget

__all__ = ["DTYPES", "EngineOptions"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineOptions:
    """An engine's sizes, memory budget and features; every value is checked here, before any work.

    ``max_seqs`` sequences run at once at most; ``max_batch_tokens`` new tokens a step at most;
    ``max_seq_len`` bounds prompt + new tokens (None: the model's ``max_position_embeddings``);
    ``block_size`` tokens a cache block (None: 16, rounded up to a multiple of an encoder-decoder's
    compression rate).

    The pools are sized from ``kv_budget`` (:mod:`kvgraft.runtime.budget`: bytes as an int or ``"4GiB"``, a
    fraction of the memory available on the model's device as a float in (0, 1] or ``"30%"``, or None for
    the default: 4 GiB, vLLM CPU's, or half the available memory when that is less), never more than
    ``max_seqs`` full-length sequences need; ``num_blocks`` sets the token blocks directly instead (not with
    ``kv_budget``).

    ``dtype``: the cache's dtype, a ``torch.dtype`` or its name (``"float32"``, ``"bfloat16"``,
    ``"float16"``; stored as the ``torch.dtype``); None: the weights' dtype. ``kvgraft serve`` also loads the
    weights in it.

    ``prefix_cache``: keep prompts' caches for later requests (:mod:`kvgraft.runtime.prefix`), at most
    ``prefix_entries`` entries and ``prefix_max_bytes`` of kept state outside the pools (None: a quarter of
    the pools' bytes); None means the caller's default: off in ``Engine``, on in ``kvgraft serve``.

    ``prefault``: write every page of the pools when the engine is built (``PagedKVCache.prefault``), as vLLM
    zeroes its cache at start: the first requests then pay no page faults (the first write of a page is the
    dear part of a cold step on our VMs), at the price of start time and the pools' memory taken at once.
    Default off: the pools take memory as their blocks are written.

    ``packed_linears``: run the model's linear layers on oneDNN-packed weights
    (:mod:`kvgraft.model.packed`; one more copy of the linear weights). None: on when the model is on the CPU
    and torch can pack; True where it cannot is an error when the engine is built.
    """

    max_seqs: int = 32
    max_batch_tokens: int = 512
    max_seq_len: int | None = None
    block_size: int | None = None
    kv_budget: KVBudget = None
    num_blocks: int | None = None
    dtype: torch.dtype | str | None = None
    prefix_cache: bool | None = None
    prefix_entries: int = 32
    prefix_max_bytes: int | None = None
    packed_linears: bool | None = None
    prefault: bool = False

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_batch_tokens", "prefix_entries"):
            check_int(name, getattr(self, name), low=1)
        for name in ("max_seq_len", "block_size", "num_blocks"):
            check_int(name, getattr(self, name), low=1, optional=True)
        check_int("prefix_max_bytes", self.prefix_max_bytes, low=0, optional=True)
        if check_kv_budget(self.kv_budget) is not None and self.num_blocks is not None:
            raise ConfigError(f"give num_blocks ({self.num_blocks!r}) or kv_budget ({self.kv_budget!r}), not both")
        if isinstance(self.dtype, str) and self.dtype in DTYPES:
            object.__setattr__(self, "dtype", DTYPES[self.dtype])
        elif self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"dtype ({self.dtype!r}) must be a torch.dtype, one of {sorted(DTYPES)} or None")
        for name in ("prefix_cache", "packed_linears"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} ({getattr(self, name)!r}) must be True, False or None (the default)")
        if not isinstance(self.prefault, bool):
            raise ConfigError(f"prefault ({self.prefault!r}) must be True or False")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """``dtype`` as a ``torch.dtype`` (None: the weights')."""
        assert self.dtype is None or isinstance(self.dtype, torch.dtype)
        return self.dtype
