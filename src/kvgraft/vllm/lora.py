"""Adapters on vLLM (``enable_lora``): vLLM routes requests and their adapters, kvgraft's registry applies them.

vLLM's LoRA layers apply a token's delta inside vLLM's own linear layers, and the CED reads two of its
projections where no token of the step is the input (``kv_b`` on shared-stream entries, ``o_proj`` per
request); kvgraft's ``AdapterRegistry`` (``kvgraft.runtime.adapters``) applies every delta exactly, per row,
as kvgraft's engine does, and checks the adapter (fingerprint of the base, sharing certificate). What vLLM
does not hand a model is which request carries which adapter: only its LoRA layers see that. So
:func:`install` wraps ``WorkerLoRAManager.set_active_adapters``, which the model runner calls before every
forward with the step's ``LoRARequest`` set and its per-token mapping, and keeps both for the model's forward
(:func:`step_adapters`). vLLM still loads each adapter with its own loader (the model offers it stand-in
linears named like kvgraft's projections, so vLLM's name check passes) and still salts prefix-cache hashes with
the adapter's name and path.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

_local = threading.local()
_installed = False


def install() -> None:
    """Record each step's LoRA requests and token mapping (idempotent; in the process that runs the model)."""
    global _installed
    if _installed:
        return
    from vllm.lora.worker_manager import WorkerLoRAManager  # deliberately lazy: only with enable_lora

    original = WorkerLoRAManager.set_active_adapters

    def set_active_adapters(self: Any, requests: set[Any], mapping: Any | None) -> None:
        original(self, requests, mapping)
        _local.step = (list(requests), None if mapping is None else tuple(mapping.index_mapping))

    WorkerLoRAManager.set_active_adapters = set_active_adapters
    _installed = True


def step_adapters(query_start: list[int]) -> list[tuple[str, Path] | None]:
    """Per request of the step (``query_start``: its token offsets), its adapter (name, directory) or None."""
    step = getattr(_local, "step", None)
    if step is None or step[1] is None:
        return [None] * (len(query_start) - 1)
    requests, mapping = step
    by_id = {int(r.lora_int_id): r for r in requests}
    out: list[tuple[str, Path] | None] = []
    for r in range(len(query_start) - 1):
        lora_id = int(mapping[query_start[r]]) if query_start[r] < len(mapping) else 0
        req = by_id.get(lora_id) if lora_id > 0 else None
        out.append(None if req is None else (str(req.lora_name), Path(req.lora_path)))
    return out
