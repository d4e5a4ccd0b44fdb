"""How large the engine's cache pools are: a memory budget, not a worst case.

vLLM sizes its KV cache from a budget (``gpu_memory_utilization`` on a GPU; ``VLLM_CPU_KVCACHE_SPACE`` on
the CPU, 4 GiB when unset) and admits requests by the blocks free. The engine does the same: its pools
(token blocks, window rings, state slots) take at most ``kv_budget`` bytes; how many sequences run at once
then follows from the blocks free (``kvgraft.runtime.scheduler``: a request is admitted while the blocks
for its next chunk are free, and the latest admitted is preempted when a running one needs a block that is
not), up to ``max_seqs`` state slots. A budget is

- bytes: an ``int`` (``4 << 30``) or a string with a unit (``"4GiB"``, ``"512MiB"``, ``"2.5GB"``);
- a fraction of the memory available now on the cache's device: a ``float`` in (0, 1] or a string
  (``"0.3"``, ``"30%"``); host memory is ``MemAvailable`` of ``/proc/meminfo`` (at most what the process's
  cgroup limit leaves), a CUDA device's is ``torch.cuda.mem_get_info``'s free bytes;
- None: the default, :data:`DEFAULT_KV_BUDGET` (vLLM CPU's 4 GiB) or half the available memory when that
  is less.

The pools are never larger than the worst case, ``max_seqs`` sequences of ``max_seq_len`` tokens each
(plus a quarter for kept prompts with the prefix cache): a small model gets what it could ever use, a real
one what the budget holds. SmolLM2-135M (8,192 positions, 46,080 bytes a token in float32) needs 12.4 GB
for 32 full-length sequences; the default holds 93,000 tokens in 4 GiB, 11.4 full-length requests at once
and 32 of the benchmark's (at most 464 tokens). A budget that cannot hold one request of ``max_seq_len``
tokens is refused with the numbers, as vLLM refuses one.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvgraft.checks import is_number
from kvgraft.model.config import ModelConfig
from kvgraft.model.sizes import pool_bytes

__all__ = [
    "DEFAULT_KV_BUDGET",
    "KVBudget",
    "KVPool",
    "available_memory",
    "check_kv_budget",
    "format_bytes",
    "parse_kv_budget",
    "plan_pool",
]

GiB = 1 << 30
DEFAULT_KV_BUDGET = 4 * GiB  # vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE unset: 4 GiB)

KVBudget = int | float | str | None

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_BUDGET = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*|%)\s*$")


def parse_kv_budget(text: str) -> int | float:
    """A budget written as text (the CLI's ``--kv-budget``): bytes with an optional unit (``"4GiB"``,
    ``"500MB"``, ``"1e9"``) as an int, or a fraction of available memory (``"0.3"``, ``"30%"``) as a float.
    ValueError naming the text for anything else."""
    match = _BUDGET.match(text)
    if match is None:
        raise ValueError(
            f"kv_budget ({text!r}) must be bytes with an optional unit (e.g. '4GiB', '512MiB', '2GB') "
            "or a fraction of available memory (e.g. '0.3', '30%')"
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise ValueError(f"kv_budget ({text!r}) must be a percentage in (0, 100]")
        return number / 100
    if unit not in _UNITS:
        raise ValueError(f"kv_budget ({text!r}) has an unknown unit {match.group(2)!r}; use one of B, KB, MB, GB, KiB, MiB, GiB")
    if not unit and number <= 1 and "e" not in match.group(1).lower():  # a plain number up to 1: a fraction
        if number <= 0:
            raise ValueError(f"kv_budget ({text!r}) must be positive")
        return number
    value = number * _UNITS[unit]
    if value < 1 or value != math.floor(value) and not unit:
        raise ValueError(f"kv_budget ({text!r}) must be a whole number of bytes >= 1, or a fraction in (0, 1]")
    return int(value)


def available_memory(device: torch.device | str) -> int:
    """Bytes available now for a cache on ``device``: host memory (``MemAvailable``) for the CPU (and the
    meta device, which allocates nothing), free device memory for CUDA. ValueError where it cannot be
    measured (give the budget in bytes there)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type in ("cpu", "meta"):
        host = _host_available()
        if host is not None:
            limit = _cgroup_available()  # a container's memory limit, when it is below what the host has
            return host if limit is None else min(host, limit)
    raise ValueError(f"cannot measure the memory available on device {dev}; give kv_budget in bytes")


def _host_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_available() -> int | None:
    """The memory limit of this process's cgroup less what it uses (v2, else v1); None without a limit."""
    root = Path("/sys/fs/cgroup")
    for limit_file, used_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            limit = (root / limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:  # v1 reports "no limit" as a huge number
                return None
            return max(0, int(limit) - int((root / used_file).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def format_bytes(n: float) -> str:
    """``n`` bytes for people: ``4.00 GiB``, ``512.0 MiB``, ``12.3 KiB``, ``17 B``."""
    for unit, size, digits in (("GiB", 1 << 30, 2), ("MiB", 1 << 20, 1), ("KiB", 1 << 10, 1)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class KVPool:
    """What the engine's pools hold and why: the budget they were sized from, the blocks it bought, and the
    concurrency that follows. ``str()`` is the line printed at start."""

    budget_bytes: int | None  # None: ``num_blocks`` was given, no budget applied
    source: str  # how the budget was stated ("default: ...", "0.3 of 20.1 GiB available", "4 GiB", ...)
    num_blocks: int
    block_size: int
    block_bytes: int  # one token block over every paged pool and segment
    fixed_bytes: int  # window rings and state slots
    max_seqs: int
    max_seq_len: int
    worst_case_blocks: int  # blocks for max_seqs full-length sequences (the cap)

    @property
    def nbytes(self) -> int:
        """Bytes of the pools (``PagedKVCache.nbytes``)."""
        return self.fixed_bytes + self.num_blocks * self.block_bytes

    @property
    def tokens(self) -> int:
        """Token positions the token blocks hold."""
        return self.num_blocks * self.block_size

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request of ``max_seq_len`` tokens takes."""
        return math.ceil(self.max_seq_len / self.block_size)

    @property
    def concurrency(self) -> float:
        """Requests of ``max_seq_len`` tokens the token blocks hold at once (vLLM's "maximum concurrency"),
        before the ``max_seqs`` cap; unbounded (inf) for a model that stores no tokens in blocks."""
        if not self.block_bytes:
            return math.inf
        return self.num_blocks / self.blocks_per_request

    @property
    def max_concurrency(self) -> int:
        """Requests of ``max_seq_len`` tokens that run at once: the blocks' concurrency, at most ``max_seqs``."""
        c = self.concurrency
        return self.max_seqs if math.isinf(c) else min(self.max_seqs, int(c))

    def __str__(self) -> str:
        budget = "none (num_blocks given)" if self.budget_bytes is None else f"{format_bytes(self.budget_bytes)} ({self.source})"
        capped = ", all that max_seqs full-length sequences need" if self.num_blocks == self.worst_case_blocks else ""
        conc = "unbounded" if math.isinf(self.concurrency) else f"{self.concurrency:.2f}x"
        return (
            f"KV cache budget {budget}: {self.num_blocks:,} blocks of {self.block_size} tokens = {self.tokens:,} tokens"
            f"{capped}; {format_bytes(self.nbytes)} with window rings and state slots; maximum concurrency for "
            f"{self.max_seq_len:,}-token requests: {conc} ({self.max_concurrency} at once; shorter requests up to "
            f"max_seqs {self.max_seqs})"
        )


def check_kv_budget(budget: KVBudget) -> int | float | None:
    """``budget`` as bytes (int) or a fraction of available memory (float), None for None; ValueError naming
    the value for anything else."""
    if budget is None:
        return None
    if isinstance(budget, str):
        return parse_kv_budget(budget)
    if not is_number(budget):
        raise ValueError(f"kv_budget ({budget!r}) must be bytes (int), a fraction in (0, 1] (float), a string or None")
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(
                f"kv_budget ({budget!r}) as a float is a fraction of available memory and must be in (0, 1]; give bytes as an int"
            )
        return budget
    if budget < 1:
        raise ValueError(f"kv_budget ({budget!r}) must be a positive number of bytes")
    return budget


def plan_pool(
    config: ModelConfig,
    *,
    budget: KVBudget,
    num_blocks: int | None,
    block_size: int,
    max_seqs: int,
    max_seq_len: int,
    dtype: torch.dtype,
    device: torch.device | str,
    prefix_cache: bool = False,
    ring_blocks: int | None = None,
) -> KVPool:
    """The engine's pool: ``num_blocks`` as given (``budget`` must then be None), else as many blocks as
    ``budget`` holds after the rings and state slots, at most the worst case (``max_seqs`` full-length
    sequences, a quarter more with ``prefix_cache``). ValueError naming the value for a bad budget, and with
    the numbers for one that cannot hold a request of ``max_seq_len`` tokens."""
    value = check_kv_budget(budget)
    per_block, fixed = pool_bytes(config, block_size, max_seqs, max_seq_len, dtype, ring_blocks)
    per_seq = math.ceil(max_seq_len / block_size)
    worst = max_seqs * (per_seq + (max(1, per_seq // 4) if prefix_cache else 0))
    if num_blocks is not None:
        if value is not None:
            raise ValueError(f"give num_blocks ({num_blocks!r}) or kv_budget ({budget!r}), not both")
        return KVPool(None, "num_blocks given", num_blocks, block_size, per_block, fixed, max_seqs, max_seq_len, worst)
    if value is None:
        try:
            half = available_memory(device) // 2
        except ValueError:
            half = DEFAULT_KV_BUDGET
        if half < DEFAULT_KV_BUDGET:
            nbytes, source = half, f"default: half the {format_bytes(2 * half)} available, less than 4 GiB"
        else:
            nbytes, source = DEFAULT_KV_BUDGET, "default: 4 GiB, vLLM CPU's"
    elif isinstance(value, float):
        avail = available_memory(device)
        where = "device" if torch.device(device).type == "cuda" else "host"
        nbytes, source = int(value * avail), f"{value:g} of the {format_bytes(avail)} of {where} memory available"
    else:
        nbytes, source = value, "given"
    if not per_block:  # nothing stored in token blocks (every layer a window ring): blocks cost nothing
        blocks = worst
    else:
        blocks = min(worst, max(0, nbytes - fixed) // per_block)
    if fixed > nbytes or blocks < per_seq:
        raise ValueError(
            f"kv_budget {format_bytes(nbytes)} ({source}) holds {blocks} blocks of {block_size} tokens "
            f"({format_bytes(per_block)} each) after {format_bytes(fixed)} of window rings and state slots for "
            f"max_seqs {max_seqs}; one request of max_seq_len {max_seq_len} tokens needs {per_seq} blocks "
            f"({format_bytes(fixed + per_seq * per_block)} in all): raise the budget or lower max_seq_len or max_seqs"
        )
    return KVPool(nbytes, source, blocks, block_size, per_block, fixed, max_seqs, max_seq_len, worst)
