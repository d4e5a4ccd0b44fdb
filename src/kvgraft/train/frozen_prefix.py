"""The frozen prefix's outputs, cached across epochs: a training step that runs only the trainable layers.

When every layer before ``k`` (the *boundary*: the first layer with a trainable parameter, the embedding
frozen too) is frozen, what those layers hand to layers ``k``.. is a pure function of the base's weights
and the example's token ids: the hidden state entering layer ``k`` and the cross-layer KV that layers
``k``.. read but do not write (a causal encoder-decoder's shared segments written by kv_source layers
before ``k``; for a GQA/MLA model with shared KV slots, a slot written before ``k``). A decoder-half
adapter with the pivot's KV writers frozen has ``k`` = the pivot: the whole encoder half is skipped once
an example has been seen. Layers ``k``.. recompute their own windows and, at the pivot, its segment.

:class:`FrozenPrefixCache` holds the entries (one per example, keyed by the base's weights, the boundary,
precision and token ids); :class:`CachedLMLoss` is the training loop's ``loss_fn`` through it;
:func:`run_prefix` and :func:`run_suffix` rebuild ``Transformer.forward``'s cache-free path from the model's
public modules (tested bit for bit against it); :func:`shared_cache` is the process's one cache.

Exactness: every training item of a task has the same length (``kvgraft.train.adapt.encode_split``), so a
batch's shapes never change; the cached rows were computed in a batch of the same shape, and no
operation of the prefix mixes rows, so a step with the cache gives bit-identical losses and gradients
(tested against the uncached forward). A prefix with a random module in it (dropout with p > 0) is not
a pure function: :func:`cache_obstacle` says so and the cache does not apply.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from kvgraft.adapters.fingerprint import weights_sample
from kvgraft.checks import check_int
from kvgraft.errors import ConfigError
from kvgraft.model.batch import DenseContext, active_context
from kvgraft.model.ced import rope_tables
from kvgraft.model.transformer import Transformer
from kvgraft.train.config import PRECISIONS

MODES = ("auto", "on", "off")  # auto: on where the placement allows it (a note where not); on: required
DEFAULT_MAX_MB = 1024
Entry = dict[tuple[str, int], torch.Tensor]  # ("x", k) -> (T, h) hidden state entering k; ("seg"|"kv", s) -> (., E)


def transformer_in(model: nn.Module) -> Transformer:
    """The kvgraft Transformer of ``model``: itself, or inside a PeftModel (its modules carry the LoRA layers)."""
    if isinstance(model, Transformer):
        return model
    base = getattr(model, "get_base_model", None)
    inner = getattr(base(), "model", None) if base is not None else None
    if isinstance(inner, Transformer):
        return inner
    raise TypeError(f"the frozen-prefix cache runs a kvgraft Transformer (or a PeftModel over one), not {type(model).__name__}")


def cache_obstacle(model: nn.Module) -> str | None:
    """Why the prefix's outputs cannot be cached for ``model`` (None: they can, at :func:`boundary`)."""
    if isinstance(model, DistributedDataParallel) or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return "training runs on several processes (the cache runs the layers outside DistributedDataParallel's forward)"
    tf = transformer_in(model)
    k = tf.first_trainable_layer()
    if k == 0:
        trains = "the token embedding" if tf.embed_tokens.weight.requires_grad else "layer 0"
        return f"{trains} has trainable parameters: no layer before the first trainable one to cache"
    for name, m in tf.layers[:k].named_modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return f"layers.{name} (before the first trainable layer, {k}) is a dropout with p={m.p}: the prefix is random"
    return None


def boundary(model: nn.Module) -> int:
    """The cached boundary: the first layer with a trainable parameter (everything before it is frozen)."""
    return transformer_in(model).first_trainable_layer()


def planned_boundary(modules: list[str]) -> int | None:
    """The first layer an adapter on ``modules`` (names like ``layers.4.self_attn.q_proj``) trains: the
    boundary before the model is built (0 for the embedding; None when no layer is adapted)."""
    layers = [
        0 if m.startswith("embed_tokens") else int(m.split(".")[1]) for m in modules if m.startswith(("layers.", "embed_tokens"))
    ]
    return min(layers) if layers else None


def read_keys(config, k: int) -> list[tuple[str, int]]:
    """The cross-layer KV that layers ``k``.. read and a layer before ``k`` writes (besides the hidden state)."""
    sources = sorted({s for lay in range(k, config.num_layers) if (s := config.kv_source_of(lay)) is not None and s < k})
    return [("seg" if config.is_ced else "kv", s) for s in sources]


def _dense(tf: Transformer, B: int, T: int, device: torch.device) -> tuple[DenseContext, torch.Tensor, torch.Tensor]:
    """What ``Transformer.forward`` builds for a cache-free (B, T) batch at positions 0..T-1."""
    cfg = tf.config
    positions = torch.arange(T, device=device).expand(B, T)
    step = DenseContext(positions, True, cfg.compress_rate if cfg.is_ced else 1)
    cos, sin = tf.rotary(positions, tf.embed_tokens.weight.dtype)
    if cfg.is_ced:
        cos, sin = rope_tables(cfg, cos, sin)
    return step, cos, sin


@torch.no_grad()
def run_prefix(tf: Transformer, input_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, dict[tuple[str, int], torch.Tensor]]:
    """Layers 0..k-1 over ``input_ids`` (B, T): the hidden state entering ``k`` (B, T, h) and the KV of
    :func:`read_keys`, each (B, ., E)."""
    B, T = input_ids.shape
    step, cos, sin = _dense(tf, B, T, input_ids.device)
    x = tf.embed_tokens(input_ids)
    with active_context(step):
        for block in tf.layers[:k]:
            x = block(x, cos, sin, step)
    return x, {key: step.scratch[key] for key in read_keys(tf.config, k)}


def run_suffix(tf: Transformer, x: torch.Tensor, kv: dict[tuple[str, int], torch.Tensor], k: int) -> torch.Tensor:
    """Layers k.., the final norm and the LM head from the hidden state entering ``k`` (B, T, h) and the
    prefix's KV: logits (B, T, vocab), as ``Transformer.forward`` computes them (checkpointing, aux loss)."""
    B, T = x.shape[:2]
    step, cos, sin = _dense(tf, B, T, x.device)
    step.scratch.update(kv)
    with active_context(step):
        for block in tf.layers[k:]:
            if tf.gradient_checkpointing and tf.training:
                x = checkpoint(block, x, cos, sin, step, use_reentrant=False)
            else:
                x = block(x, cos, sin, step)
    aux = step.scratch.get("aux")
    tf.aux_loss = torch.stack(aux).sum() if aux else None
    logits: torch.Tensor = tf.lm_head(tf.norm(x))
    return logits


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0
    peak_bytes: int = 0
    max_bytes: int = 0


class FrozenPrefixCache:
    """Per-example prefix outputs, least recently used evicted first, at most ``max_bytes`` in all.

    Each entry holds its own tensors (not views of a batch) and is keyed by a digest of the base's weights
    fingerprint (``kvgraft.adapters.fingerprint``), the boundary, the autocast precision, the dtype, any frozen
    adapter weights in the prefix, and the example's token ids."""

    def __init__(self, max_bytes: int) -> None:
        check_int("max_bytes", max_bytes, low=1)
        self._entries: OrderedDict[bytes, tuple[Entry, int]] = OrderedDict()
        self.stats = CacheStats(max_bytes=max_bytes)

    @property
    def max_bytes(self) -> int:
        return self.stats.max_bytes

    def resize(self, max_bytes: int) -> None:
        """A new bound (evicting down to it)."""
        check_int("max_bytes", max_bytes, low=1)
        self.stats.max_bytes = max_bytes
        self._evict(0)

    def get(self, key: bytes) -> Entry | None:
        item = self._entries.get(key)
        if item is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return item[0]

    def put(self, key: bytes, entry: Entry) -> bool:
        """Store ``entry`` (tensors it owns); False when it alone is larger than the bound (not stored)."""
        size = sum(t.numel() * t.element_size() for t in entry.values())
        if size > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.stats.bytes -= old[1]
        self._evict(size)
        self._entries[key] = (entry, size)
        self.stats.bytes += size
        self.stats.entries = len(self._entries)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes)
        return True

    def _evict(self, room: int) -> None:
        while self._entries and self.stats.bytes + room > self.max_bytes:
            _, (_, size) = self._entries.popitem(last=False)
            self.stats.bytes -= size
            self.stats.evictions += 1
        self.stats.entries = len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.stats = CacheStats(max_bytes=self.max_bytes)


_SHARED: FrozenPrefixCache | None = None


def shared_cache(max_bytes: int) -> FrozenPrefixCache:
    """The process's one cache (runs on the same base and boundary, e.g. a study's seeds, reuse each
    other's entries: the key names the base's weights), bounded by the latest ``max_bytes`` asked."""
    global _SHARED
    if _SHARED is None:
        _SHARED = FrozenPrefixCache(max_bytes)
    elif _SHARED.max_bytes != max_bytes:
        _SHARED.resize(max_bytes)
    return _SHARED


class CachedLMLoss:
    """``lm_loss`` through the frozen-prefix cache: a ``loss_fn`` for ``kvgraft.train.loop.train`` (and its
    evaluations). Built for one model; refuses one whose prefix cannot be cached (:func:`cache_obstacle`).

    The same numbers as ``kvgraft.train.loop.lm_loss``: each row is looked up; when one is missing the prefix
    runs over the whole batch (under ``torch.no_grad``, as ``Transformer.forward`` does for the layers below the
    first trainable one) and the missing rows are kept; then layers ``k``.., the final norm and the LM head, with
    activation checkpointing and the indexers' ``aux_loss`` as ``Transformer.forward`` has them."""

    def __init__(
        self, model: nn.Module, cache: FrozenPrefixCache, precision: str = "fp32", fingerprint: str | None = None
    ) -> None:
        if precision not in PRECISIONS:
            raise ConfigError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
        why = cache_obstacle(model)
        if why is not None:
            raise ConfigError(f"the frozen-prefix cache does not apply: {why}")
        self.tf = transformer_in(model)
        self.k = boundary(model)
        self.cache = cache
        if fingerprint is None:
            meta = getattr(model, "kvgraft_meta", None)  # a PeftModel from kvgraft.adapters.lora: fingerprinted base
            fingerprint = meta["base"]["fingerprint"] if meta else weights_sample(self.tf)[0]
        h = hashlib.sha256(f"{fingerprint};k={self.k};{precision};{self.tf.embed_tokens.weight.dtype}".encode())
        for name, t in self.tf.layers[: self.k].state_dict().items():
            if "lora_" in name:  # frozen adapter weights before the boundary change the prefix: hash them whole
                h.update(name.encode())
                h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        self.prefix_digest = h.digest()
        self.hits = self.misses = 0  # this loss's rows (the cache's own counters may span several runs)

    def key(self, ids: torch.Tensor) -> bytes:
        """One example's key: the prefix digest and its token ids (T,)."""
        row = ids.detach().to("cpu", torch.int64).contiguous().numpy()
        return hashlib.blake2b(self.prefix_digest + row.tobytes(), digest_size=20).digest()

    def prefix_outputs(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[tuple[str, int], torch.Tensor]]:
        """The batch's hidden state entering the boundary and the prefix's KV, from the cache where held."""
        keys = [self.key(r) for r in input_ids]
        entries = [self.cache.get(key) for key in keys]
        missing = [i for i, e in enumerate(entries) if e is None]
        self.misses += len(missing)
        self.hits += len(entries) - len(missing)
        names = [("x", self.k)] + read_keys(self.tf.config, self.k)
        if missing:  # the whole batch: its rows come out as in a step without the cache (the same shapes)
            x, kv = run_prefix(self.tf, input_ids, self.k)
            for i in missing:
                entry: Entry = {("x", self.k): x[i].clone()} | {name: t[i].clone() for name, t in kv.items()}
                self.cache.put(keys[i], entry)
            return x, kv
        stacked = {name: torch.stack([e[name] for e in entries if e is not None]) for name in names}
        return stacked.pop(("x", self.k)), stacked

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        if transformer_in(model) is not self.tf:
            raise ConfigError("this CachedLMLoss was built for another model")
        x, kv = self.prefix_outputs(batch["input_ids"])
        logits = run_suffix(self.tf, x, kv, self.k)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        return loss, {}

    def summary(self) -> dict[str, Any]:
        """What a run records: the boundary, this run's hits and misses (rows), the cache's bytes held, peak
        and bound (its evictions and entries over its whole life: one cache serves a process's runs)."""
        return {**asdict(self.cache.stats), "boundary": self.k, "hits": self.hits, "misses": self.misses}


__all__ = [
    "DEFAULT_MAX_MB",
    "MODES",
    "CacheStats",
    "CachedLMLoss",
    "FrozenPrefixCache",
    "boundary",
    "cache_obstacle",
    "planned_boundary",
    "read_keys",
    "run_prefix",
    "run_suffix",
    "shared_cache",
    "transformer_in",
]
