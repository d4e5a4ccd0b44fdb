"""Typed, validated configuration of kvgraft's decoder-only transformer.

One dataclass per component; every check raises ``ValueError`` naming the field and the value.
The config is the single source of truth for shapes, RoPE, attention kind per layer, the
``layer -> cache slot`` map that cross-layer KV sharing builds on, and the table of what each layer
stores in the KV cache (:func:`cache_layout`, which the paged cache allocates from).

This module is the floor of ``kvgraft.model``: it imports no other model module. What needs more than
the config lives above it (parameter counts: ``kvgraft.model.shapes.num_parameters``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvgraft.checks import check_int
from kvgraft.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")
ATTENTION_KINDS = ("gqa", "mla", "ced")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding and its context-extension scaling (the transformers families' kinds)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None  # linear, dynamic, llama3, yarn
    original_max_position_embeddings: int | None = None  # llama3, yarn
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn (default 32)
    beta_slow: float | None = None  # yarn (default 1)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn
    truncate: bool = True  # yarn

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_type {self.rope_type!r} is not supported; expected one of {', '.join(ROPE_TYPES)}")
        if self.theta <= 0:
            raise ConfigError(f"rope theta ({self.theta}) must be > 0")
        if self.rope_type in ("linear", "dynamic", "llama3") and (self.factor is None or self.factor <= 0):
            raise ConfigError(f"rope_type {self.rope_type!r} needs factor > 0, got {self.factor}")
        if self.rope_type == "llama3":
            for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if getattr(self, name) is None:
                    raise ConfigError(f"rope_type 'llama3' needs {name}")
            low, high = self.low_freq_factor, self.high_freq_factor
            if low is not None and high is not None and high <= low:
                raise ConfigError(
                    f"llama3 rope: high_freq_factor ({self.high_freq_factor}) must exceed "
                    f"low_freq_factor ({self.low_freq_factor})"
                )
        if self.rope_type == "yarn" and self.factor is None and self.original_max_position_embeddings is None:
            raise ConfigError("rope_type 'yarn' needs factor or original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder: Llama, Mistral, Qwen2, Qwen3 (and the grafts built on them).

    ``kv_slots[l]`` is the cache slot layer ``l`` reads. The first layer mapping to a slot writes it;
    later layers mapping to the same slot only read it (cross-layer KV sharing). Default: identity.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    # Fields that default to None and are derived from the others in __post_init__ (never None after
    # construction) are typed as what they hold: a dataclass cannot say "optional in __init__ only".
    head_dim: int = None  # type: ignore[assignment]  # default hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope: RopeConfig = field(default_factory=RopeConfig)
    qkv_bias: bool = False  # Qwen2 (and Llama attention_bias)
    o_bias: bool = False  # Llama/Qwen3 attention_bias also biases o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = None  # type: ignore[assignment]  # per layer: full_attention | sliding_attention
    attention_kinds: tuple[str, ...] = None  # type: ignore[assignment]  # per layer: gqa | mla | ced
    kv_slots: tuple[int, ...] = None  # type: ignore[assignment]  # per layer cache slot (default: its own)
    # Multi-head latent attention (layers whose attention_kinds entry is "mla"), DeepSeek's names:
    kv_lora_rank: int | None = None  # d_c, the cached latent width
    qk_rope_head_dim: int | None = None  # d_rope, the shared RoPE key width (cached too)
    qk_nope_head_dim: int | None = None  # per-head no-RoPE query/key width
    v_head_dim: int | None = None  # per-head value width
    # per layer, per RoPE pair of d_rope: which of the head_dim/2 base frequencies it rotates at
    # (None: every (head_dim/d_rope)-th frequency, DeepSeek's layout); entries of GQA layers are ()
    rope_freq_index: tuple[tuple[int, ...], ...] | None = None
    mla_latent_norm: bool = False  # RMSNorm on the latent before caching (DeepSeek's kv_a_layernorm)
    # Causal encoder-decoder (every layer "ced"; see kvgraft.model.ced): layers that write a shared
    # compressed KV segment (the last is the pivot, the first decoder layer), and the compression rate m
    # (each shared entry pools m consecutive tokens). Uses sliding_window, kv_lora_rank (d_c),
    # qk_rope_head_dim (d_rope), qk_nope_head_dim, v_head_dim; num_kv_heads are the window's K/V heads.
    kv_source_layers: tuple[int, ...] | None = None
    compress_rate: int = 1
    # Optional indexer (off when None): each query attends to only the index_topk shared entries its
    # layer's indexer scores highest (see kvgraft.model.ced). index_head_dim values per entry are cached.
    index_topk: int | None = None
    index_heads: int = 4
    index_head_dim: int = 32
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    # fields that __post_init__ fills in when left as None; replace() derives them again
    _DERIVED = ("head_dim", "layer_types", "attention_kinds", "kv_slots", "rope_freq_index")

    def __post_init__(self) -> None:
        object.__setattr__(self, "_derived", tuple(n for n in self._DERIVED if getattr(self, n) is None))
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} ({value!r}) must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}) unless head_dim is given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"head_dim ({self.head_dim}) must be a positive even number (RoPE rotates pairs)")
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps ({self.rms_norm_eps}) must be > 0")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window ({self.sliding_window}) must be a positive integer or None")
        if isinstance(self.rope, dict):
            object.__setattr__(self, "rope", RopeConfig(**self.rope))
        L = self.num_layers
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            object.__setattr__(self, "layer_types", (kind,) * L)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != L or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ConfigError(f"layer_types {self.layer_types} must list one of {LAYER_TYPES} for each of {L} layers")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ConfigError("layer_types has sliding_attention layers but sliding_window is None")
        if self.kv_source_layers is not None:
            object.__setattr__(self, "kv_source_layers", tuple(int(i) for i in self.kv_source_layers))
        if self.attention_kinds is None:
            object.__setattr__(self, "attention_kinds", ("ced" if self.kv_source_layers else "gqa",) * L)
        object.__setattr__(self, "attention_kinds", tuple(self.attention_kinds))
        if len(self.attention_kinds) != L or any(k not in ATTENTION_KINDS for k in self.attention_kinds):
            raise ConfigError(f"attention_kinds {self.attention_kinds} must list one of {ATTENTION_KINDS} for each of {L} layers")
        if "ced" in self.attention_kinds or self.kv_source_layers is not None:
            self._check_ced()
        if "mla" in self.attention_kinds or "ced" in self.attention_kinds:
            self._check_mla()
        if self.kv_slots is None:
            object.__setattr__(self, "kv_slots", tuple(range(L)))
        object.__setattr__(self, "kv_slots", tuple(int(s) for s in self.kv_slots))
        if len(self.kv_slots) != L:
            raise ConfigError(f"kv_slots has {len(self.kv_slots)} entries, expected one per layer ({L})")
        for layer, slot in enumerate(self.kv_slots):
            writer = self.kv_slots.index(slot)
            if slot < 0 or writer > layer:
                raise ConfigError(f"kv_slots[{layer}] = {slot} is invalid: slots must be >= 0")
            if self.layer_types[writer] != self.layer_types[layer]:
                raise ConfigError(f"layer {layer} reads slot {slot} written by layer {writer}, but their layer_types differ")

    def _check_ced(self) -> None:
        L, src = self.num_layers, self.kv_source_layers
        if set(self.attention_kinds) != {"ced"}:
            raise ConfigError(
                f"attention_kinds {self.attention_kinds}: a causal encoder-decoder has 'ced' in every layer "
                "(leave attention_kinds unset with kv_source_layers)"
            )
        if not src:
            raise ConfigError("kv_source_layers must list at least one layer for 'ced' attention")
        if list(src) != sorted(set(src)) or src[0] < 0 or src[-1] >= L:
            raise ConfigError(f"kv_source_layers {src} must be strictly increasing layer indices in [0, {L})")
        if self.sliding_window is None:
            raise ConfigError("a causal encoder-decoder needs sliding_window (every layer keeps its own window)")
        if not isinstance(self.compress_rate, int) or self.compress_rate < 1:
            raise ConfigError(f"compress_rate ({self.compress_rate!r}) must be a positive integer")
        if self.sliding_window < self.compress_rate:
            raise ConfigError(
                f"sliding_window ({self.sliding_window}) must be >= compress_rate ({self.compress_rate}): the "
                "window covers the tokens of the block being filled"
            )
        if self.qk_norm:
            raise ConfigError("qk_norm is not supported with 'ced' attention")
        if self.index_topk is not None:
            for name in ("index_topk", "index_heads", "index_head_dim"):
                value = getattr(self, name)
                check_int(name, value, low=1, accepted="a positive integer when the indexer is on")

    def _latent_dim(self, name: str) -> int:
        """The MLA width ``name`` (kv_lora_rank, ...), checked: a positive integer (qk_nope_head_dim may be 0)."""
        value = getattr(self, name)
        if not isinstance(value, int) or value < 0 or (value == 0 and name != "qk_nope_head_dim"):
            raise ConfigError(f"{name} ({value!r}) must be a positive integer for MLA layers")
        return value

    def _check_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            self._latent_dim(name)
        dr = self._latent_dim("qk_rope_head_dim")
        if dr % 2:
            raise ConfigError(f"qk_rope_head_dim ({dr}) must be even (RoPE rotates pairs)")
        half = self.head_dim // 2
        mla_layers = [i for i, k in enumerate(self.attention_kinds) if k in ("mla", "ced")]
        given = self.rope_freq_index
        if given is None:
            if self.head_dim % dr:
                raise ConfigError(
                    f"qk_rope_head_dim ({dr}) must divide head_dim ({self.head_dim}) unless rope_freq_index is given"
                )
            stride = tuple(range(0, half, self.head_dim // dr))
            given = tuple(stride if i in mla_layers else () for i in range(self.num_layers))
        index = tuple(tuple(int(f) for f in layer) for layer in given)
        object.__setattr__(self, "rope_freq_index", index)
        if len(index) != self.num_layers:
            raise ConfigError(f"rope_freq_index has {len(index)} entries, expected one per layer ({self.num_layers})")
        if "ced" in self.attention_kinds and len(set(index)) != 1:
            raise ConfigError(
                "rope_freq_index must be the same for every layer of a causal encoder-decoder "
                "(all layers attend over the same shared RoPE keys)"
            )
        for layer in mla_layers:
            idx = index[layer]
            if len(idx) != dr // 2 or any(not 0 <= f < half for f in idx):
                raise ConfigError(
                    f"rope_freq_index[{layer}] = {idx} must hold qk_rope_head_dim/2 = {dr // 2} frequency indices in [0, {half})"
                )

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def kv_width(self) -> int:
        """Values cached per token by a GQA layer: keys plus values."""
        return 2 * self.num_kv_heads * self.head_dim

    def cache_entry_shapes(self, layer: int) -> tuple[tuple[int, int], ...]:
        """Per stored tensor, its (heads, width) per token; the cache stores (B, heads, T, width).

        GQA: keys and values, (K, d) each. MLA: one tensor (1, d_c + d_rope), latent then RoPE key,
        so absorbed decode attends over it as a single key/value head (MQA).
        """
        if self.attention_kinds[layer] == "mla":
            dc, dr, _, _ = self.latent_dims()
            return ((1, dc + dr),)
        return ((self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim))

    def latent_dims(self) -> tuple[int, int, int, int]:
        """(d_c, d_rope, d_nope, d_v): kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, the
        widths of MLA and causal encoder-decoder layers; ValueError when the config sets none."""
        dims = (self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim)
        if dims[0] is None or dims[1] is None or dims[2] is None or dims[3] is None:
            raise ConfigError(
                f"latent widths (kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim) = {dims}: "
                "this config has no MLA or causal encoder-decoder layers"
            )
        return dims[0], dims[1], dims[2], dims[3]

    @property
    def is_ced(self) -> bool:
        return self.kv_source_layers is not None

    @property
    def pivot_layer(self) -> int:
        """The last kv_source layer: the first decoder layer, whose compressor writes what the decoder reads."""
        if self.kv_source_layers is None:
            raise ConfigError("pivot_layer: this model is not a causal encoder-decoder (no kv_source_layers)")
        return self.kv_source_layers[-1]

    def kv_source_of(self, layer: int) -> int | None:
        """The layer whose stored KV ``layer`` reads: the one place cross-layer sharing is decided.

        GQA/MLA: the first layer of its ``kv_slots`` slot (itself when it writes its own KV). A causal
        encoder-decoder: the nearest kv_source layer at or before it (None: it reads only its window)."""
        if self.kv_source_layers is not None:
            before = [s for s in self.kv_source_layers if s <= layer]
            return before[-1] if before else None
        return self.kv_slots.index(self.kv_slots[layer])

    def kv_cache_bytes(self, context: int, bytes_per_value: int = 2) -> int:
        """KV cache bytes of one sequence holding ``context`` tokens: the paged cache's own layout table
        (:func:`cache_layout`): per-token entries, pooled shared entries, window rings of
        ``min(W, context)`` tokens and pending tokens of an incomplete block."""
        return cache_layout(self).values(context) * bytes_per_value

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def is_kv_writer(self, layer: int) -> bool:
        """Whether ``layer`` stores KV that it or later layers read (every CED layer writes its window)."""
        return self.is_ced or self.kv_source_of(layer) == layer

    @property
    def num_slots(self) -> int:
        return len(set(self.kv_slots))

    def kv_bytes_per_token(self, bytes_per_value: int = 2, context: int | None = None) -> float:
        """Cache bytes per token of context (all layers), at ``bytes_per_value`` (2 for bf16/fp16).

        For GQA/MLA layers the rate of every KV-writing layer (a sliding window layer counted as if
        unbounded: the doctor's before/after rate; ``kv_cache_bytes`` gives the exact, ring-bounded
        figure at a context). A causal encoder-decoder's windows are a fixed cost, so its figure depends
        on the context (default: max_position_embeddings)."""
        layout = cache_layout(self)
        if layout.segments:
            context = context or self.max_position_embeddings
            return self.kv_cache_bytes(context, bytes_per_value) / context
        return (sum(layout.paged.values()) + sum(layout.rings.values())) * bytes_per_value

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields: {unknown}")
        d = dict(d)
        if isinstance(d.get("rope"), dict):
            d["rope"] = RopeConfig(**d["rope"])
        for name in ("layer_types", "attention_kinds", "kv_slots", "kv_source_layers"):
            if d.get(name) is not None:
                d[name] = tuple(d[name])
        if d.get("rope_freq_index") is not None:
            d["rope_freq_index"] = tuple(tuple(x) for x in d["rope_freq_index"])
        return cls(**d)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes``; fields that were derived (not given) are derived again."""
        rederive: dict[str, Any] = {name: None for name in getattr(self, "_derived", ()) if name not in changes}
        return dataclasses.replace(self, **rederive, **changes)


@dataclass(frozen=True)
class CacheLayout:
    """What every layer stores, per sequence. Widths are values per token (per entry for segments)."""

    paged: dict[int, int]  # full-attention KV-writing layer -> values per token
    rings: dict[int, int]  # sliding-window storing layer -> values per token (ring of ``window`` tokens)
    window: int | None  # ring length W (one window size per model)
    segments: dict[int, int]  # kv_source layer -> values per pooled entry (latent, RoPE key, index key)
    compress_rate: int  # m: tokens per pooled entry
    pending: dict[int, int]  # kv_source layer -> values per pending token (entry + gate scores), m > 1

    def values(self, context: int, ring_len: int | None = None) -> int:
        """Values one sequence holding ``context`` tokens stores (rings of ``ring_len``, default
        ``min(W, context)``; pooled entries for complete blocks only)."""
        if ring_len is None:
            ring_len = min(self.window, context) if self.window else 0
        total = sum(self.paged.values()) * context
        total += sum(self.segments.values()) * (context // self.compress_rate)
        total += sum(self.rings.values()) * ring_len
        total += sum(self.pending.values()) * (self.compress_rate - 1)
        return total


def cache_layout(config: ModelConfig) -> CacheLayout:
    """The one table of cache storage, derived from the config."""
    paged: dict[int, int] = {}
    rings: dict[int, int] = {}
    segments: dict[int, int] = {}
    pending: dict[int, int] = {}
    if config.kv_source_layers is not None:
        dc, dr, dn, dv = config.latent_dims()
        D = dc + dr
        E = D + (config.index_head_dim if config.index_topk else 0)
        K = config.num_kv_heads
        for layer in range(config.num_layers):
            rings[layer] = K * (dn + dr + dv)
        for s in config.kv_source_layers:
            segments[s] = E
            if config.compress_rate > 1:
                pending[s] = E + D
        return CacheLayout(paged, rings, config.sliding_window, segments, config.compress_rate, pending)
    for layer in range(config.num_layers):
        if not config.is_kv_writer(layer):
            continue
        width = sum(h * w for h, w in config.cache_entry_shapes(layer))
        (rings if config.window(layer) is not None else paged)[layer] = width
    return CacheLayout(paged, rings, config.sliding_window if rings else None, segments, 1, pending)
