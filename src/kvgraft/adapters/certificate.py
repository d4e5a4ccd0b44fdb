"""The sharing certificate: which cache groups an adapter provably cannot change.

Cache groups (what ``kvgraft.model.cache.cache_layout`` stores): ``segment:S`` (the shared compressed
segment of kv_source layer S), ``window:L`` (layer L's window ring), ``kv:L`` (the per-token KV of a
GQA/MLA layer L that writes its own).

The rule, from the architecture alone: a group stored by layer l is computed from the hidden state
entering layer l by that layer's KV-writing projections. Every adapted module changes the output of its
layer (the residual stream carries it), so a group is untouched iff no adapted module sits in a layer
before l and none of l's own writers for that group is adapted. Adapted modules of layer l that do not
write the group (its query, output, kv_b or MLP) change only what comes after it.

An adapter whose certificate leaves every shared segment untouched can read the base model's shared
cache (``shares_cache``); one that touches any layer at or before the pivot's compressor input, or the
pivot's KV writers, needs a private cache. For GQA/MLA models, ``kv:L`` groups below the first adapted
layer are shared, the rest private. Tested against the model: with random non-zero adapter weights, the
groups claimed untouched are bit-identical to the base's.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgraft.adapters.placement import layer_modules, module_layer
from kvgraft.errors import ConfigError
from kvgraft.model.config import ModelConfig


@dataclass(frozen=True)
class Certificate:
    untouched: tuple[str, ...]  # cache groups equal to the base model's for any adapter weights
    touched: tuple[str, ...]  # groups the adapter may change (kept per adapter)
    first_adapted_layer: int
    shares_cache: bool  # every shared segment untouched (causal encoder-decoder) / every kv group (others)
    reason: str

    def to_dict(self) -> dict:
        return {
            "untouched": list(self.untouched),
            "touched": list(self.touched),
            "first_adapted_layer": self.first_adapted_layer,
            "shares_cache": self.shares_cache,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Certificate:
        return cls(
            tuple(d["untouched"]), tuple(d["touched"]), int(d["first_adapted_layer"]), bool(d["shares_cache"]), str(d["reason"])
        )


def cache_groups(config: ModelConfig) -> dict[str, tuple[int, tuple[str, ...]]]:
    """Group name -> (the layer that stores it, the module names that write it)."""
    groups: dict[str, tuple[int, tuple[str, ...]]] = {}
    for layer in range(config.num_layers):
        writers = layer_modules(config, layer)["kv-writers"]
        full = tuple(f"layers.{layer}.{m}" for m in writers)
        if config.is_ced:
            groups[f"window:{layer}"] = (layer, tuple(n for n in full if ".compressor." not in n))
            if layer in (config.kv_source_layers or ()):
                groups[f"segment:{layer}"] = (layer, tuple(n for n in full if ".compressor." in n))
        elif config.is_kv_writer(layer):
            groups[f"kv:{layer}"] = (layer, full)
    return groups


def certify(config: ModelConfig, modules: list[str]) -> Certificate:
    """The certificate of an adapter on ``modules`` (full kvgraft module names) over a base ``config``."""
    if not modules:
        raise ConfigError("certify: the adapter has no modules")
    adapted = set(modules)
    first = min(module_layer(n) for n in modules)
    untouched: list[str] = []
    touched: list[str] = []
    for name, (layer, writers) in cache_groups(config).items():
        clean = layer < first or (layer == first and not adapted.intersection(writers))
        (untouched if clean else touched).append(name)
    if config.is_ced:
        hit = [g for g in touched if g.startswith("segment:")]
        shares = not hit
        reason = (
            "every shared segment is the base model's: decoder-side adapter (layers before "
            f"{first} and the pivot's KV writers untouched)"
            if shares
            else f"changes shared segments {', '.join(hit)}: needs a private cache"
        )
    else:
        shares = not touched
        reason = (
            "no KV-writing layer is changed"
            if shares
            else f"layers from {first} on store different KV: private cache for {len(touched)} of "
            f"{len(untouched) + len(touched)} layers, the rest shared"
        )
    return Certificate(tuple(untouched), tuple(touched), first, shares, reason)


def _layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(out)


def sharing_obstacle(config: ModelConfig, modules: list[str]) -> str | None:
    """Why an adapter on ``modules`` cannot share a causal encoder-decoder's cache, and what would; None when
    it can, or when the base has no shared cache (see :func:`sharing_verdict`)."""
    if not config.is_ced or certify(config, modules).shares_cache:
        return None
    pivot = config.pivot_layer
    why = []
    early = sorted({module_layer(m) for m in modules if module_layer(m) < pivot})
    if early:
        why.append(
            f"it adapts layers {_layer_ranges(early)}, before the pivot (layer {pivot}), which change the "
            "hidden states the shared segments are computed from"
        )
    writers = set(cache_groups(config)[f"segment:{pivot}"][1])
    hit = [m for m in modules if m in writers]
    if hit:
        why.append(f"it adapts the pivot's KV writers ({', '.join(hit)}), which write the shared segment")
    return (
        "; ".join(why) + ". Its requests need a private cache; a placement from the pivot on with the pivot's "
        "KV writers frozen shares it (the default: decoder-half, --freeze-kv-writers)"
    )


def sharing_verdict(config: ModelConfig, modules: list[str], base_name: str | None = None) -> str:
    """One line: does an adapter on ``modules`` share the base's cache, and why (``shares the cache: yes|no|
    does not apply: ...``)."""
    cert = certify(config, modules)
    if not config.is_ced:
        kept = sorted(int(g.split(":")[1]) for g in cert.untouched if g.startswith("kv:"))
        own = (
            f"layers {_layer_ranges(kept)} keep the base's KV (the engine shares those blocks)"
            if kept
            else "every layer's KV is the adapter's own"
        )
        return (
            f"shares the cache: does not apply: {base_name or 'the base'} has no shared cache (not a causal "
            f"encoder-decoder: no kv_source layers); {own}"
        )
    if cert.shares_cache:
        return f"shares the cache: yes: {cert.reason}"
    return f"shares the cache: no: {sharing_obstacle(config, modules)}"
