"""Which adapters are resident in the engine: loading, unloading (now, or deferred until their requests
finish), and what a request on an adapter may share (from its certificate).

A name loaded again is another adapter: each load gets a new identity (its ``owner`` in the prefix cache),
so a reloaded name never reuses the entries of the adapter it replaced; unloading drops that identity's
private entries (through ``on_unload``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from kvgraft.runtime.adapters import Adapter, AdapterBusyError, AdapterError, AdapterFiles, AdapterRegistry
from kvgraft.runtime.request import Request


class AdapterResidency:
    """The engine's adapters (``registry``: the loaded ones and their layers). ``unfinished`` lists the
    requests not finished yet; ``on_unload(identity)`` is called when an adapter is unloaded."""

    def __init__(
        self, registry: AdapterRegistry, unfinished: Callable[[], Iterable[Request]], on_unload: Callable[[int], None]
    ) -> None:
        self.registry = registry
        self._unfinished = unfinished
        self._on_unload = on_unload
        self._uids: dict[str, int] = {}  # adapter name -> load identity (a reloaded name is another adapter)
        self._next_uid = 0

    def load(self, name: str, source: str | Path | AdapterFiles) -> Adapter:
        """Install an adapter directory (or files read with ``registry.read``) under ``name``; refuses
        another base's adapter, a name already loaded and what the adapter layer cannot apply."""
        adapter = self.registry.load(name, source)
        self._uids[name] = self._next_uid
        self._next_uid += 1
        return adapter

    def unload(self, name: str, wait: bool = False) -> bool:
        """Unload ``name``. With unfinished requests on it: AdapterBusyError, or with ``wait`` refuse new
        requests for it and unload it once they finish (:meth:`reap`). True when unloaded now."""
        adapter = self.registry.get(name)
        busy = self.requests_of(name)
        if not busy:
            self._unload(name)
            return True
        if not wait:
            raise AdapterBusyError(
                f"adapter {name!r} has {len(busy)} unfinished requests ({busy[:8]}); cancel them "
                "or unload with wait=True (it then unloads when they finish)"
            )
        adapter.draining = True
        return False

    def requests_of(self, name: str) -> list[int]:
        """Ids of the unfinished requests on adapter ``name``."""
        return [r.id for r in self._unfinished() if r.adapter == name]

    def reap(self) -> None:
        """Unload every adapter unloaded with ``wait`` whose last request has finished."""
        for name in [n for n, a in self.registry.adapters.items() if a.draining]:
            if not self.requests_of(name):
                self._unload(name)

    def _unload(self, name: str) -> None:
        self.registry.unload(name)
        uid = self._uids.pop(name, None)
        if uid is not None:
            self._on_unload(uid)

    def check_open(self, name: str) -> None:
        """Whether adapter ``name`` takes new requests: UnknownAdapterError (listing the loaded ones) for one
        that is not loaded, AdapterError for one being unloaded."""
        if self.registry.get(name).draining:
            raise AdapterError(f"adapter {name!r} is being unloaded; it takes no new requests")

    def bind(self, req: Request, replay_layer: int | None) -> None:
        """Give ``req`` (on an adapter that :meth:`check_open` accepted, or the base) its prefix-cache
        identity and what its adapter's certificate lets it share: the base's shared cache groups
        (``shares``; on a causal encoder-decoder only if the adapter changes no layer before the pivot
        ``replay_layer``), and on a full-attention base the layers below its first changed KV (``same_below``)."""
        if req.adapter is None:
            return
        cert = self.registry.get(req.adapter).certificate
        req.owner = self._uids[req.adapter]
        req.shares = bool(cert.get("shares_cache")) and (replay_layer is None or int(cert["first_adapted_layer"]) >= replay_layer)
        if replay_layer is None:  # full-attention base: layers below the first changed KV are shared
            kv = [int(g.split(":")[1]) for g in cert.get("touched", ()) if g.startswith("kv:")]
            req.same_below = min(kv) if kv else None
