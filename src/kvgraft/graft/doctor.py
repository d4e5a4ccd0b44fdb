"""Pre-conversion check-up for the MLA graft: what the model is, what the graft saves, what stops it.

``doctor(model)`` reads only a checkpoint's ``config.json`` (no weights) -- or takes a ``ModelConfig`` --
and returns a :class:`DoctorReport`: the architecture facts that matter to the graft, the KV bytes per
token before and after conversion at the chosen ranks, the KV-cache size per sequence at a few context
lengths, fast-path notes (FlashMLA), warnings, compatibility notes and blockers, and a one-line verdict.

Default ranks: the one rule ``kvgraft convert`` uses (``kvgraft.graft.ranks.default_ranks``): a budget of
KV width / 4 values per layer (KV width = ``2 x num_kv_heads x head_dim``), d_rope the largest even width
<= min(64, head_dim, budget/2), d_c the rest; see ``docs/ranks.md``.

Sizes use decimal units (1 GB = 10^9 bytes, 1 MB = 10^6 bytes).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgraft.checks import check_int
from kvgraft.errors import ConfigError
from kvgraft.graft.mla import GraftConfig, mla_model_config
from kvgraft.graft.options import FORMATS
from kvgraft.graft.ranks import default_ranks
from kvgraft.hf.engines import EngineSupport, engine_support, format_engine_table
from kvgraft.hf.load import CONFIG, load_config
from kvgraft.model.config import ModelConfig
from kvgraft.model.fields import known
from kvgraft.model.shapes import num_parameters
from kvgraft.reference import resolve_model

VERDICTS = ("convertible", "convertible with notes", "blocked")
DEFAULT_CONTEXTS = (1024, 4096, 8192, 32768)
FLASHMLA_KV_LORA_RANK = 512
FLASHMLA_ROPE_DIM = 64
_ROPE_SCALING_FIELDS = (
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
)


# ---- KV-cache table -------------------------------------------------------------------------------


def _context_label(tokens: int) -> str:
    if tokens >= 1024 and tokens % 1024 == 0:
        return f"{tokens // 1024}K"
    return str(tokens)


def kv_cache_table(
    bytes_per_token_before: float,
    bytes_per_token_after: float,
    contexts: tuple[int, ...] | list[int] = DEFAULT_CONTEXTS,
) -> list[dict[str, Any]]:
    """KV-cache size of one sequence at each context length, before and after, as JSON-ready rows.

    Each row: ``context`` (tokens), ``label`` ("1K" for 1024, ...), ``bytes_before``, ``bytes_after``,
    ``gb_before``, ``gb_after`` (10^9 bytes) and ``reduction_pct`` (100 x (1 - after/before); negative
    when the cache grows; None when ``before`` is 0).
    """
    if bytes_per_token_before < 0 or bytes_per_token_after < 0:
        raise ConfigError(f"bytes per token must be >= 0, got {bytes_per_token_before} before and {bytes_per_token_after} after")
    rows = []
    for tokens in contexts:
        if int(tokens) != tokens or tokens <= 0:
            raise ConfigError(f"context lengths must be positive integers, got {tokens!r}")
        tokens = int(tokens)
        before = bytes_per_token_before * tokens
        after = bytes_per_token_after * tokens
        rows.append(
            {
                "context": tokens,
                "label": _context_label(tokens),
                "bytes_before": before,
                "bytes_after": after,
                "gb_before": before / 1e9,
                "gb_after": after / 1e9,
                "reduction_pct": None if before == 0 else 100.0 * (1.0 - after / before),
            }
        )
    return rows


def _num(value: float) -> str:
    """About three significant digits: 14.7, 1.84, 0.06, 459."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _unit(smallest: float) -> tuple[str, float]:
    """The largest unit in which ``smallest`` still reads as at least 0.1."""
    for name, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if smallest >= 0.1 * scale:
            return name, scale
    return "B", 1.0


def _pct(reduction: float | None) -> str:
    if reduction is None:
        return "n/a"
    if reduction >= 0:
        return f"-{reduction:.1f}%"
    return f"+{-reduction:.1f}%"


def format_kv_cache_table(rows: list[dict[str, Any]], indent: str = "") -> str:
    """The rows of :func:`kv_cache_table` as an aligned text table in one unit (GB, MB or KB: the largest
    in which every "now" size reads as at least 0.1), e.g. ``1K  0.47 GB -> 0.06 GB  -87.5%``."""
    if not rows:
        return ""
    unit, scale = _unit(min(r["bytes_before"] for r in rows))
    cells = [("context", "now", "", "after", "change")]
    for r in rows:
        cells.append(
            (
                r["label"],
                f"{_num(r['bytes_before'] / scale)} {unit}",
                "->",
                f"{_num(r['bytes_after'] / scale)} {unit}",
                _pct(r["reduction_pct"]),
            )
        )
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    lines = []
    for c in cells:
        lines.append(f"{indent}{c[0]:<{widths[0]}}  {c[1]:>{widths[1]}} {c[2]:2} {c[3]:>{widths[3]}}  {c[4]:>{widths[4]}}")
    return "\n".join(lines)


# ---- the report -----------------------------------------------------------------------------------


@dataclass
class Blocker:
    """Something that stops the conversion: a stable ``code`` and a human ``reason``."""

    code: str
    reason: str


@dataclass
class DoctorReport:
    """Everything :func:`doctor` found. ``to_dict()`` is JSON-ready; ``format()`` renders terminal text."""

    source: str | None  # the checkpoint directory, or None for an in-memory ModelConfig
    model_type: str | None  # config.json's model_type (llama, mistral, qwen2, qwen3, kvgraft); None if unknown
    # architecture
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_kind: str  # "MHA", "GQA 4:1", "MQA" (+ MLA layers if any)
    mla_layers: list[int]
    rope: dict[str, Any]  # rope_type, theta and the scaling parameters that are set
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    sliding_layers: list[int]
    tie_word_embeddings: bool
    num_parameters: int
    num_parameters_after: int | None  # of the converted model (None when blocked)
    # the graft
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype_bytes: int
    kv_width: int  # values per layer per token now: 2 x num_kv_heads x head_dim
    kv_bytes_per_token_before: float  # (a causal encoder-decoder's depends on the context: not whole)
    kv_bytes_per_token_after: int
    kv_compression: float  # before / after (> 1: smaller cache)
    kv_saving_pct: float  # 100 x (1 - after / before); negative when the cache grows
    kv_cache: list[dict[str, Any]]
    info: list[str] = field(default_factory=list)  # how the ranks were chosen
    fast_path: list[str] = field(default_factory=list)
    # per engine and MLA backend: will a stock DeepSeek-V3 export of these ranks run (kvgraft.hf.engines)
    engines: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    blockers: list[Blocker] = field(default_factory=list)
    verdict: str = "convertible"

    @property
    def convertible(self) -> bool:
        return not self.blockers

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def format(self) -> str:
        """A readable multi-line report for the terminal."""
        title = self.source or "(ModelConfig)"
        kind = f" ({self.model_type})" if self.model_type else ""
        out = [f"kvgraft doctor: {title}{kind}", f"verdict: {self.verdict}", "", "architecture"]

        def row(key: str, value: str) -> None:
            out.append(f"  {key:<18} {value}")

        row("layers", str(self.num_layers))
        row("hidden size", str(self.hidden_size))
        row("attention", f"{self.attention_kind}: {self.num_heads} heads, {self.num_kv_heads} kv heads, head_dim {self.head_dim}")
        row("RoPE", _rope_text(self.rope))
        row("q/k/v bias", _yes(self.qkv_bias))
        row("o bias", _yes(self.o_bias))
        if self.mlp_bias:
            row("mlp bias", "yes")
        row("q/k norm", "yes (per head, Qwen3)" if self.qk_norm else "no")
        if self.sliding_window is None:
            row("sliding window", "none")
        else:
            row("sliding window", f"{self.sliding_window} tokens on layers {_ranges(self.sliding_layers, self.num_layers)}")
        row("tied embeddings", _yes(self.tie_word_embeddings))
        params = _count(self.num_parameters)
        if self.num_parameters_after is not None:
            params += f" -> {_count(self.num_parameters_after)} after"
        row("parameters", params)

        out += [
            "",
            f"MLA graft: d_c (kv_lora_rank) = {self.kv_lora_rank}, "
            f"d_rope (qk_rope_head_dim) = {self.qk_rope_head_dim}, {self.dtype_bytes} bytes per value",
        ]
        before, after = self.kv_bytes_per_token_before, self.kv_bytes_per_token_after
        row("KV per layer", f"{self.kv_width} values now -> {self.kv_lora_rank + self.qk_rope_head_dim} after (d_c + d_rope)")
        change = (
            f"{self.kv_compression:.2f}x smaller, {_pct(self.kv_saving_pct)}"
            if self.kv_saving_pct >= 0
            else f"{1 / self.kv_compression:.2f}x LARGER, {_pct(self.kv_saving_pct)}"
        )
        row("KV per token", f"{before:,} B now -> {after:,} B after ({change})")
        for line in self.info:
            out.append(f"  - {line}")
        out += [
            "",
            "KV cache per sequence (decimal units: 1 GB = 10^9 bytes, 1 MB = 10^6 bytes)",
            format_kv_cache_table(self.kv_cache, "  "),
        ]
        if self.engines:
            out += [
                "",
                f"engines for a stock DeepSeek-V3 export of these ranks (d_c + d_rope = "
                f"{self.kv_lora_rank + self.qk_rope_head_dim}; no attention biases, the default export)",
                format_engine_table([EngineSupport(**e) for e in self.engines], "  "),
            ]
        sections = (
            ("fast path", self.fast_path, ""),
            ("warnings", self.warnings, "WARNING: "),
            ("notes", self.notes, ""),
            ("blockers", [f"[{b.code}] {b.reason}" for b in self.blockers], "BLOCKER: "),
        )
        for name, lines, prefix in sections:
            if lines:
                out += ["", name] + [f"  - {prefix}{line}" for line in lines]
        return "\n".join(out)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _count(n: int) -> str:
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n:,} ({n / scale:.2f}{suffix})"
    return f"{n:,}"


def _ranges(layers: list[int], total: int) -> str:
    if len(layers) == total:
        return f"all ({total})"
    spans, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            spans.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(spans)


def _g(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _rope_text(rope: dict[str, Any]) -> str:
    params = [f"theta {_g(rope['theta'])}"]
    params += [f"{k} {_g(v)}" for k, v in rope.items() if k not in ("rope_type", "theta")]
    return f"{rope['rope_type']} ({', '.join(params)})"


def _rope_dict(config: ModelConfig) -> dict[str, Any]:
    rope = config.rope
    d: dict[str, Any] = {"rope_type": rope.rope_type, "theta": rope.theta}
    if rope.rope_type == "default":
        return d
    for name in _ROPE_SCALING_FIELDS:
        value = getattr(rope, name)
        if value is not None:
            d[name] = value
    if rope.rope_type == "yarn" and not rope.truncate:
        d["truncate"] = False
    return d


def attention_kind(num_heads: int, num_kv_heads: int) -> str:
    """ "MHA" (as many kv heads as query heads), "MQA" (one kv head) or "GQA H/K:1"."""
    if num_kv_heads == num_heads:
        return "MHA"
    if num_kv_heads == 1:
        return "MQA"
    return f"GQA {num_heads // num_kv_heads}:1"


def default_kv_lora_rank(config: ModelConfig) -> int:
    """The default d_c of ``doctor`` and ``convert`` (``kvgraft.graft.ranks.default_ranks`` at 4x)."""

    return default_ranks(config).kv_lora_rank


def _load(model: str | os.PathLike[str] | ModelConfig | None) -> tuple[ModelConfig, str | None, str | None]:
    if isinstance(model, ModelConfig):
        return model, None, None

    path = resolve_model(model)
    config = load_config(path)  # CheckpointError for a missing directory or config.json, bad JSON, ...
    model_type = json.loads((Path(path) / CONFIG).read_text(encoding="utf-8")).get("model_type")
    return config, str(path), model_type


def _positive_int(name: str, value: Any) -> int:
    check_int(name, value, low=1)
    return int(value)


# check_against's messages -> the blocker code doctor gives the same problem
_CHECK_CODES = (
    ("already MLA", "already_mla"),
    ("qk_rope_head_dim", "d_rope_too_large"),
    ("kv_lora_rank", "d_c_too_large"),
    ("q/k RMSNorm", "qk_norm"),
    ("cross-layer", "cross_layer_kv"),
)


def _blockers(config: ModelConfig, d_c: int, d_rope: int) -> list[Blocker]:
    K, hd, L = config.num_kv_heads, known(config.head_dim, "head_dim"), config.num_layers
    out: list[Blocker] = []
    mla = [i for i, k in enumerate(known(config.attention_kinds, "attention_kinds")) if k == "mla"]
    if mla:
        out.append(Blocker("already_mla", f"layers {_ranges(mla, L)} are already MLA; only GQA/MHA layers can be grafted"))
    if config.is_ced:
        out.append(
            Blocker(
                "already_ced",
                f"this is a causal encoder-decoder (kv_source layers "
                f"{list(known(config.kv_source_layers, 'kv_source_layers'))}): its KV "
                "cache is already shared "
                "and compressed",
            )
        )
        return out
    if config.num_slots != L:
        out.append(
            Blocker(
                "cross_layer_kv",
                f"cross-layer shared KV ({config.num_slots} cache slots for {L} "
                "layers): the graft converts one KV cache per layer",
            )
        )
    if d_rope > K * hd:
        out.append(
            Blocker(
                "d_rope_too_large",
                f"d_rope ({d_rope}) exceeds the model's RoPE key width "
                f"num_kv_heads x head_dim = {K} x {hd} = {K * hd}: the shared "
                "RoPE key is chosen from the existing keys' rotary pairs",
            )
        )
    if d_c > config.kv_width:
        out.append(
            Blocker(
                "d_c_too_large",
                f"d_c ({d_c}) exceeds the model's KV width "
                f"2 x num_kv_heads x head_dim = {config.kv_width}: the latent "
                "cannot be wider than the keys and values it replaces",
            )
        )
    try:
        graft = GraftConfig(kv_lora_rank=d_c, qk_rope_head_dim=d_rope)
    except ValueError as exc:  # GraftConfig's own checks (d_rope even, ...)
        out.append(Blocker("invalid_ranks", str(exc)))
        return out
    try:
        graft.check_against(config)
    except ValueError as exc:  # reported once: under doctor's code for the same problem, else as is
        message = str(exc)
        code = next((c for key, c in _CHECK_CODES if key in message), "graft_check")
        if code not in {b.code for b in out}:
            out.append(Blocker(code, message))
    return out


def doctor(
    model: str | os.PathLike[str] | ModelConfig | None,
    kv_lora_rank: int | None = None,
    qk_rope_head_dim: int | None = None,
    dtype_bytes: int = 2,
    compression: float | None = None,
    output_format: str = "kvgraft",
) -> DoctorReport:
    """Check whether (and how well) ``model`` converts to MLA at the given ranks; nothing is loaded but
    ``config.json``.

    ``model``: a checkpoint directory, the name of a shipped reference model (None: the default one),
    or a ``ModelConfig``. Ranks not given come from the rule ``convert`` uses
    (``kvgraft.graft.ranks.default_ranks``): ``compression`` (default 4) or ``kv_lora_rank`` sets the budget;
    ``output_format`` "deepseek_v3"/"both" makes the rule pick a stock-exportable d_rope, as convert does.
    ``dtype_bytes``: bytes per cached value (2: bf16/fp16).

    Raises ``kvgraft.errors.CheckpointError`` for a missing or unreadable checkpoint (and
    ``UnsupportedModelError`` for a model kvgraft cannot load), ``ValueError`` for a non-positive rank or
    ``dtype_bytes``. Problems with the conversion itself are reported as blockers, not raised.
    """

    if output_format not in FORMATS:
        raise ConfigError(f"format {output_format!r} is not one of {', '.join(FORMATS)}")
    config, source, model_type = _load(model)
    dtype_bytes = _positive_int("dtype_bytes", dtype_bytes)
    ranks = default_ranks(
        config,
        compression=compression,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        stock=output_format != "kvgraft",
    )
    d_c, d_rope = ranks.kv_lora_rank, ranks.qk_rope_head_dim
    info = list(ranks.how)
    if ranks.how:
        info.insert(0, "ranks from the default rule, the same as kvgraft convert's (docs/ranks.md):")
        info.append("DeepSeek-V2/V3 cache d_c = 512 plus d_rope = 64; the rule gives exactly that at a 576-value budget")

    L, K, hd = config.num_layers, config.num_kv_heads, known(config.head_dim, "head_dim")
    before = config.kv_bytes_per_token(dtype_bytes)
    after = L * (d_c + d_rope) * dtype_bytes
    mla_layers = [i for i, k in enumerate(known(config.attention_kinds, "attention_kinds")) if k == "mla"]
    kind = attention_kind(config.num_heads, K)
    if len(mla_layers) == L:
        kind = "MLA"
    elif mla_layers:
        kind = f"{kind} + MLA on {len(mla_layers)}/{L} layers"
    sliding_layers = [i for i, t in enumerate(known(config.layer_types, "layer_types")) if t == "sliding_attention"]

    fast_path, warnings, notes = _fast_path(d_c, d_rope), _warnings(config, d_c, d_rope), _notes(config, sliding_layers, d_rope)
    blockers = _blockers(config, d_c, d_rope)
    engines = [e.to_dict() for e in engine_support(d_c, d_rope, hd)]  # the graft keeps qk_nope = head_dim
    params_after = None if blockers else _params_after(config, d_c, d_rope)
    verdict = "blocked" if blockers else "convertible with notes" if warnings or notes else "convertible"
    return DoctorReport(
        source=source,
        model_type=model_type,
        num_layers=L,
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        num_kv_heads=K,
        head_dim=hd,
        attention_kind=kind,
        mla_layers=mla_layers,
        rope=_rope_dict(config),
        qkv_bias=config.qkv_bias,
        o_bias=config.o_bias,
        mlp_bias=config.mlp_bias,
        qk_norm=config.qk_norm,
        sliding_window=config.sliding_window if sliding_layers else None,
        sliding_layers=sliding_layers,
        tie_word_embeddings=config.tie_word_embeddings,
        num_parameters=num_parameters(config),
        num_parameters_after=params_after,
        kv_lora_rank=d_c,
        qk_rope_head_dim=d_rope,
        dtype_bytes=dtype_bytes,
        kv_width=config.kv_width,
        kv_bytes_per_token_before=before,
        kv_bytes_per_token_after=after,
        kv_compression=before / after,
        kv_saving_pct=100.0 * (1.0 - after / before),
        kv_cache=kv_cache_table(before, after),
        info=info,
        fast_path=fast_path,
        engines=engines,
        warnings=warnings,
        notes=notes,
        blockers=blockers,
        verdict=verdict,
    )


def _fast_path(d_c: int, d_rope: int) -> list[str]:
    """Whether the ranks match FlashMLA's decode kernels."""
    fast_path = []
    if (d_c, d_rope) == (FLASHMLA_KV_LORA_RANK, FLASHMLA_ROPE_DIM):
        fast_path.append("d_c = 512 and d_rope = 64 match FlashMLA's decode kernels (576-wide cache rows)")
    else:
        fast_path.append(
            f"FlashMLA's decode kernels need d_c = 512 and d_rope = 64; these ranks (d_c = {d_c}, "
            f"d_rope = {d_rope}) miss them, so decode runs on the generic MLA path"
        )
    return fast_path


def _warnings(config: ModelConfig, d_c: int, d_rope: int) -> list[str]:
    """Ranks that would not shrink the KV cache."""
    K, hd = config.num_kv_heads, known(config.head_dim, "head_dim")
    warnings = []
    per_layer_after = d_c + d_rope
    if per_layer_after > config.kv_width:
        warnings.append(
            f"d_c + d_rope = {d_c} + {d_rope} = {per_layer_after} values per layer is MORE than the "
            f"model's current KV cache of {config.kv_width} per layer (2 x {K} kv heads x {hd}): "
            f"the graft would grow the KV cache {per_layer_after / config.kv_width:.2f}x; choose "
            f"d_c + d_rope < {config.kv_width}"
        )
    elif per_layer_after == config.kv_width:
        warnings.append(
            f"d_c + d_rope = {per_layer_after} values per layer equals the model's current KV cache "
            f"({config.kv_width} per layer): the graft would not shrink the KV cache"
        )
    return warnings


def _notes(config: ModelConfig, sliding_layers: list[int], d_rope: int) -> list[str]:
    """What the graft keeps, approximates or cannot carry to the stock export."""
    L, K, hd = config.num_layers, config.num_kv_heads, known(config.head_dim, "head_dim")
    notes = []
    if sliding_layers:
        notes.append(
            f"sliding window ({config.sliding_window} tokens on layers "
            f"{_ranges(sliding_layers, L)}) is kept in kvgraft's format, but stock DeepSeek-V3 "
            "export cannot express it"
        )
    if config.qkv_bias:
        notes.append(
            "q/k/v biases are folded into the MLA projections in kvgraft's format; the stock DeepSeek-V3 "
            "export for engines (the default) folds them into bias-free weights through the attention "
            "input's mean direction (approximate, error measured), --stock-construction exact keeps them "
            "exact for transformers only (vLLM and SGLang load no attention bias)"
        )
    if config.o_bias:
        notes.append("the o_proj bias is kept in kvgraft's format")
    if config.qk_norm:
        notes.append(
            "per-head q/k RMSNorm (Qwen3): the query norm is kept (kvgraft format); the key norm sits "
            "between k_proj and RoPE, so it is replaced by its least-squares linear fit on calibration "
            "text (not exact: heal afterwards); the stock DeepSeek-V3 export linearises both (error "
            "measured)"
        )
    if config.mlp_bias:
        notes.append("MLP biases are kept in kvgraft's format; stock DeepSeek-V3 MLPs have no bias")
    if config.rope.rope_type != "default":
        rope = _rope_dict(config)
        notes.append(f"RoPE scaling {_rope_text(rope)} is carried over to the MLA RoPE key")
    if d_rope <= K * hd and (d_rope > hd or hd % d_rope):
        notes.append(
            f"d_rope ({d_rope}) does not divide head_dim ({hd}): the 'stride' RoPE selection cannot be "
            "used; the 'prefix' one (the stock DeepSeek-V3 export's default) can"
            + ("" if d_rope <= hd else f" only with d_rope <= head_dim ({hd})")
            + ", and so can convert's default 'norm' selection (kvgraft format)"
        )
    return notes


def _params_after(config: ModelConfig, d_c: int, d_rope: int) -> int | None:
    """The converted model's parameter count (None when its config cannot be built)."""
    half = known(config.head_dim, "head_dim") // 2
    index = {layer: tuple(i % half for i in range(d_rope // 2)) for layer in range(config.num_layers)}
    try:
        return num_parameters(mla_model_config(config, GraftConfig(d_c, d_rope), index))
    except ValueError:
        return None


__all__ = [
    "Blocker",
    "DoctorReport",
    "attention_kind",
    "default_kv_lora_rank",
    "doctor",
    "format_kv_cache_table",
    "kv_cache_table",
]
