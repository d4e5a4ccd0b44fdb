"""Placement by meaning: where an adapter goes, compiled to plain module names and layer indices.

A :class:`Placement` picks layers (``all``, ``encoder-half``, ``decoder-half``, ``from:K``, or an explicit
list) and module groups by what they do (``all-linear``, ``attention``, ``attention-out``, ``query``,
``kv-writers``, ``mlp``, ``mlp-gate-up``, ``mlp-down``), then applies include/exclude globs and, with
``freeze_kv_writers``, leaves the pivot's KV-writing projections frozen. :func:`compile_placement`
returns the exact module names (``layers.4.self_attn.q_proj``, kvgraft's names, which are
transformers' without the ``model.`` prefix) and the layers they sit in: what PEFT's ``target_modules``
and ``layers_to_transform`` express. Matching nothing is an error that lists what exists.

Module groups per attention kind (the indexer's projections are never targeted: top-k passes them no
gradient, so an adapter there stays zero):

| group | GQA | MLA | causal encoder-decoder |
|---|---|---|---|
| query | q_proj | q_proj | q_proj |
| kv-writers | k_proj, v_proj | kv_a_proj | k_proj, v_proj (its window), compressor.kv_a_proj, compressor.gate_proj (shared segment) |
| attention-out | o_proj | o_proj | o_proj |
| attention | all of the above | + kv_b_proj | + kv_b_proj |
| mlp-gate-up / mlp-down | mlp.gate_proj, mlp.up_proj / mlp.down_proj | same | same |

``encoder-half`` is the layers before the pivot (the last kv_source layer) of a causal encoder-decoder,
``decoder-half`` the pivot and after; for other models the first and second half of the layers.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from kvgraft.checks import is_int
from kvgraft.errors import ConfigError
from kvgraft.model.config import ModelConfig

MODULE_GROUPS = ("all-linear", "attention", "attention-out", "query", "kv-writers", "mlp", "mlp-gate-up", "mlp-down")
LAYER_SELECTORS = ("all", "encoder-half", "decoder-half")


def layer_modules(config: ModelConfig, layer: int) -> dict[str, tuple[str, ...]]:
    """Group -> module names (relative to ``layers.{layer}.``) of one layer, for the basic groups."""
    kind = config.attention_kinds[layer]
    writer = config.is_kv_writer(layer)
    query, out = ("self_attn.q_proj",), ("self_attn.o_proj",)
    writers: tuple[str, ...]
    read: tuple[str, ...]
    if kind == "gqa":
        writers = ("self_attn.k_proj", "self_attn.v_proj") if writer else ()
        read = ()
    elif kind == "mla":
        writers = ("self_attn.kv_a_proj",) if writer else ()
        read = ("self_attn.kv_b_proj",)
    else:  # ced
        writers = ("self_attn.k_proj", "self_attn.v_proj")
        if layer in (config.kv_source_layers or ()):
            writers += ("self_attn.compressor.kv_a_proj",)
            if config.compress_rate > 1:
                writers += ("self_attn.compressor.gate_proj",)
        read = ("self_attn.kv_b_proj",) if config.kv_source_of(layer) is not None else ()
    gate_up, down = ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)
    attention = query + writers + read + out
    return {
        "query": query,
        "kv-writers": writers,
        "attention-out": out,
        "attention": attention,
        "mlp-gate-up": gate_up,
        "mlp-down": down,
        "mlp": gate_up + down,
        "all-linear": attention + gate_up + down,
    }


def pivot_kv_writers(config: ModelConfig) -> tuple[str, ...]:
    """Full names of the projections whose outputs the pivot layer stores (frozen by freeze_kv_writers).

    For a causal encoder-decoder: the pivot's window keys/values and its compressor (which writes the
    shared segment every decoder layer reads). For other models: the first decoder-half layer's KV writers."""
    pivot = config.pivot_layer if config.is_ced else config.num_layers // 2
    return tuple(f"layers.{pivot}.{m}" for m in layer_modules(config, pivot)["kv-writers"])


def every_linear(config: ModelConfig) -> list[str]:
    """Every targetable projection of the model (the indexer's excluded)."""
    return [f"layers.{i}.{m}" for i in range(config.num_layers) for m in layer_modules(config, i)["all-linear"]]


@dataclass(frozen=True)
class Placement:
    """Where an adapter goes, by meaning. Validated on construction (ValueError naming the value)."""

    layers: str | tuple[int, ...] = "all"  # all | encoder-half | decoder-half | from:K | explicit indices
    modules: tuple[str, ...] = ("all-linear",)  # module groups (MODULE_GROUPS), union
    include: tuple[str, ...] = ()  # globs over full module names, added (e.g. "layers.2.mlp.*")
    exclude: tuple[str, ...] = ()  # globs over full module names, removed (e.g. "*.q_proj")
    freeze_kv_writers: bool = False  # keep the pivot's KV-writing projections frozen

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, list):
            layers = tuple(layers)
            object.__setattr__(self, "layers", layers)
        if isinstance(layers, str):
            if layers not in LAYER_SELECTORS and not layers.startswith("from:"):
                raise ConfigError(
                    f"layers {layers!r} must be one of {', '.join(LAYER_SELECTORS)}, 'from:K' or a list of layer indices"
                )
            if layers.startswith("from:"):
                k = layers[5:]
                if not k.isdigit():
                    raise ConfigError(f"layers {layers!r}: 'from:K' needs a non-negative integer K")
        elif not layers or any(not is_int(i) or i < 0 for i in layers):
            raise ConfigError(f"layers {layers!r} must be a non-empty list of layer indices >= 0")
        object.__setattr__(self, "modules", (self.modules,) if isinstance(self.modules, str) else tuple(self.modules))
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        bad = [m for m in self.modules if m not in MODULE_GROUPS]
        if bad:
            raise ConfigError(f"module groups {bad} are unknown; known: {', '.join(MODULE_GROUPS)}")
        if not self.modules and not self.include:
            raise ConfigError("a placement needs module groups or include globs")

    def layer_indices(self, config: ModelConfig) -> list[int]:
        L = config.num_layers
        half = config.pivot_layer if config.is_ced else L // 2
        if self.layers == "all":
            return list(range(L))
        if self.layers == "encoder-half":
            return list(range(half))
        if self.layers == "decoder-half":
            return list(range(half, L))
        if isinstance(self.layers, str):  # from:K
            k = int(self.layers[5:])
            if k >= L:
                raise ConfigError(f"layers 'from:{k}' is past the model's {L} layers")
            return list(range(k, L))
        bad = [i for i in self.layers if i >= L]
        if bad:
            raise ConfigError(f"layers {bad} do not exist: the model has layers 0..{L - 1}")
        return sorted(set(self.layers))

    def to_dict(self) -> dict:
        return {
            "layers": self.layers if isinstance(self.layers, str) else list(self.layers),
            "modules": list(self.modules),
            "include": list(self.include),
            "exclude": list(self.exclude),
            "freeze_kv_writers": self.freeze_kv_writers,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Placement:
        d = dict(d)
        if isinstance(d.get("layers"), list):
            d["layers"] = tuple(d["layers"])
        return cls(**d)


def compile_placement(config: ModelConfig, placement: Placement) -> list[str]:
    """The exact module names the placement selects, in model order. Raises ValueError when nothing
    matches (listing the module names that exist)."""
    layers = placement.layer_indices(config)
    chosen: set[str] = set()
    for i in layers:
        groups = layer_modules(config, i)
        for g in placement.modules:
            chosen.update(f"layers.{i}.{m}" for m in groups[g])
    universe = every_linear(config)
    for pattern in placement.include:
        hits = fnmatch.filter(universe, pattern)
        if not hits:
            raise ConfigError(
                f"include glob {pattern!r} matches no module; modules look like {universe[:4]} ... (all: {', '.join(universe)})"
            )
        chosen.update(hits)
    for pattern in placement.exclude:
        chosen -= set(fnmatch.filter(sorted(chosen), pattern))
    if placement.freeze_kv_writers:
        chosen -= set(pivot_kv_writers(config))
    names = [n for n in universe if n in chosen]
    if not names:
        raise ConfigError(
            f"placement {placement.to_dict()} matches no module; the model's projections are: " + ", ".join(universe)
        )
    return names


def module_layer(name: str) -> int:
    """``layers.4.self_attn.q_proj`` -> 4."""
    return int(name.split(".")[1])


@dataclass(frozen=True)
class Preset:
    placement: Placement
    rank: int


# The configurations of Mind Lab's article on LoRA placement (MISSION.md Part B): placement and rank.
PRESETS: dict[str, Preset] = {
    "all-linear-r16": Preset(Placement("all", ("all-linear",)), 16),
    "encoder-half-r16": Preset(Placement("encoder-half", ("all-linear",)), 16),
    "decoder-half-r16": Preset(Placement("decoder-half", ("all-linear",)), 16),
    "all-linear-r8": Preset(Placement("all", ("all-linear",)), 8),
    # no query projection, no compressor (the seed: 1.6% of the parameters, no loss)
    "slim-attention-r16": Preset(Placement("all", ("all-linear",), exclude=("*.q_proj", "*.compressor.*")), 16),
    # no MLP down projection (the seed: a third of the parameters, no loss)
    "no-mlp-down-r16": Preset(Placement("all", ("all-linear",), exclude=("*.mlp.down_proj",)), 16),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown adapter preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]
