"""Adapters on vLLM (``enable_lora``): vLLM routes requests and their adapters, kvgraft's registry applies them.

vLLM's LoRA layers apply a token's delta inside vLLM's own linear layers, and the CED reads two of its
projections where no token of the step is the input (``kv_b`` on shared-stream entries, ``o_proj`` per
request); kvgraft's ``AdapterRegistry`` (``kvgraft.runtime.adapters``) applies every delta exactly, per row,
as kvgraft's engine does, and checks the adapter (fingerprint of the base, sharing certificate). What vLLM
does not hand a model is which request carries which adapter: only its LoRA layers see that. So
:func:`install` wraps ``WorkerLoRAManager.set_active_adapters``, which the model runner calls before every
forward with the step's ``LoRARequest`` set and its per-token mapping, and keeps both for the model's forward
(:func:`step_adapters`). vLLM still loads each adapter with its own loader (the model offers it stand-in
linears named like kvgraft's projections, so vLLM's name check passes).

**Prefix-cache keys** (:func:`install_hash_keys`, called by ``kvgraft.vllm.register`` in every vLLM process,
the scheduler's included). vLLM 0.32 salts every block of a LoRA request with ``("lora", name, path)``
(``vllm.v1.core.kv_cache_utils._gen_lora_extra_hash_keys``), one key for all cache groups of the request. A
plugin can replace that function (a module global looked up at call time), not give groups different keys.
So the one sound change: a kvgraft adapter whose sharing certificate, recomputed here from its modules and
base config, leaves *every* cache group untouched (``touched`` empty: e.g. an adapter on the last layer's
q/o/kv_b/MLP only) computes the base's KV exactly and gets the base's key, sharing every cached block with the
base and with every such adapter. Any other adapter keeps vLLM's salt: a certified decoder-side adapter shares
the encoder's windows and the stream with the base in kvgraft's engine, but its decoder windows differ, and one
key per request cannot say "share these groups, not those" (docs/vllm.md).
"""

from __future__ import annotations

import json
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvgraft.adapters.certificate import certify
from kvgraft.model.config import ModelConfig

_local = threading.local()
_installed = False
_hash_installed = False
_vllm_hash_keys: Any = None  # vLLM's own _gen_lora_extra_hash_keys, once replaced
META = "kvgraft_adapter.json"


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


@lru_cache(maxsize=256)
def kv_neutral(path: str) -> bool:
    """Whether the kvgraft adapter at ``path`` provably changes no cached row of its base (its certificate,
    recomputed from its modules and base config, touches no cache group); False for anything else."""
    meta_file = Path(path) / META
    if not meta_file.is_file():
        return False
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        return not certify(ModelConfig.from_dict(meta["base_config"]), list(meta["modules"])).touched
    except (OSError, ValueError, KeyError, TypeError):
        return False  # not readable as a kvgraft adapter: keep vLLM's salt


def install_hash_keys() -> None:
    """Give KV-neutral kvgraft adapters the base's prefix-cache key (idempotent; see the module docstring)."""
    global _hash_installed, _vllm_hash_keys
    if _hash_installed:
        return
    from vllm.v1.core import kv_cache_utils  # deliberately lazy: called from register(), inside vLLM

    original = _vllm_hash_keys = kv_cache_utils._gen_lora_extra_hash_keys

    def lora_extra_hash_keys(request: Any) -> list[Any]:
        lora = request.lora_request
        if lora is not None and kv_neutral(str(lora.lora_path)):
            return []  # the base's key: this adapter computes the base's KV for every group
        keys: list[Any] = original(request)
        return keys

    kv_cache_utils._gen_lora_extra_hash_keys = lora_extra_hash_keys
    _hash_installed = True


def vllm_hash_keys() -> Any:
    """vLLM's own LoRA hash-key function (what :func:`install_hash_keys` replaced), for comparisons."""
    if _vllm_hash_keys is None:
        raise RuntimeError("install_hash_keys() has not run in this process")
    return _vllm_hash_keys
