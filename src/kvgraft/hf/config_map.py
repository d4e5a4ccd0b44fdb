"""transformers ``config.json`` <-> kvgraft ``ModelConfig``, for the Llama family. Pure functions.

Reading honours what transformers 5 does with each family's file (its defaults, ``rope_parameters``
and the older ``rope_scaling`` + ``rope_theta``, Qwen's ``use_sliding_window``/``max_window_layers``/
``layer_types``); anything kvgraft cannot run exactly raises ``UnsupportedModelError`` naming the file.
Writing produces a dict transformers loads into the same architecture.
"""

from __future__ import annotations

from typing import Any

from kvgraft.errors import CheckpointError, UnsupportedModelError
from kvgraft.model.config import ROPE_TYPES, ModelConfig, RopeConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# transformers' per-family defaults for keys a config.json may omit.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {"max_position_embeddings": 4096 * 32, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28, "head_dim": 128},
}

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")

# rope_parameters keys -> RopeConfig fields (rope_type, type, rope_theta are handled separately).
_ROPE_FIELDS = {
    "factor": "factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
    "attention_factor": "attention_factor",
    "truncate": "truncate",
}


def _first(value: Any) -> Any:
    """eos/bos ids may be a list in transformers' files: kvgraft keeps the first."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def _rope_from_hf(d: dict[str, Any], source: str, max_pos: int, layer_types: list[str] | None) -> RopeConfig:
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}  # transformers: rope_scaling wins
    if not isinstance(params, dict):
        raise CheckpointError(f"{source}: rope parameters must be a JSON object, got {params!r}")
    nested = [k for k in params if layer_types and k in layer_types]
    if nested:  # one dict per layer type: fine only when they all agree
        first = params[nested[0]]
        if any(params[k] != first for k in nested):
            raise UnsupportedModelError(f"{source}: per-layer-type rope parameters differ ({params}); expected one set")
        params = first
    params = dict(params)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope type {rope_type!r} is not supported; expected one of {', '.join(ROPE_TYPES)}"
        )
    theta = params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
    partial = params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor {partial} is not supported; expected 1.0")
    if rope_type == "default":  # transformers ignores scaling keys for the default kind
        return RopeConfig(theta=float(theta))
    unknown = sorted(set(params) - set(_ROPE_FIELDS))
    if unknown:
        raise UnsupportedModelError(
            f"{source}: unknown {rope_type!r} rope parameters {unknown}; expected only {sorted(_ROPE_FIELDS)}"
        )
    fields = {_ROPE_FIELDS[k]: v for k, v in params.items() if v is not None}
    if rope_type in ("llama3", "yarn"):  # transformers: a top-level value wins, max_position_embeddings is last
        top = d.get("original_max_position_embeddings")
        fields["original_max_position_embeddings"] = top or fields.get("original_max_position_embeddings") or max_pos
    try:
        return RopeConfig(rope_type=rope_type, theta=float(theta), **fields)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{source}: invalid rope parameters: {exc}") from exc


def _sliding(model_type: str, d: dict[str, Any], layers: int, source: str) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as transformers runs the file."""
    window = d.get("sliding_window", _DEFAULTS[model_type].get("sliding_window"))
    if model_type == "mistral":  # one window for every layer (Mistral ignores layer_types)
        return window, None
    if model_type == "llama":
        return None, None
    if not d.get("use_sliding_window", False):
        window = None  # what Qwen2Config/Qwen3Config do
    if d.get("layer_types") is not None:
        layer_types = tuple(d["layer_types"])
        if "sliding_attention" in layer_types and window is None:
            raise CheckpointError(
                f"{source}: layer_types lists sliding_attention layers but the sliding window is off "
                f"(use_sliding_window={d.get('use_sliding_window', False)}, sliding_window={d.get('sliding_window')}); "
                "expected use_sliding_window true and an integer sliding_window"
            )
        return window, layer_types
    if window is None:
        return None, None
    first_sliding = d.get("max_window_layers", _DEFAULTS[model_type]["max_window_layers"])
    return window, tuple("sliding_attention" if i >= first_sliding else "full_attention" for i in range(layers))


def model_config_from_hf(d: dict[str, Any], source: str) -> ModelConfig:
    """Map a transformers config.json dict (``source`` names the file, for errors) to a ModelConfig."""
    model_type = d.get("model_type")
    if model_type == KVGRAFT_MODEL_TYPE:
        return _kvgraft_config(d, source)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported; expected one of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (or {KVGRAFT_MODEL_TYPE!r}, kvgraft's own format)"
        )
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise CheckpointError(f"{source}: missing required field(s) {missing}")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported; expected 'silu'")
    if d.get("quantization_config"):
        raise UnsupportedModelError(f"{source}: quantized checkpoints are not supported; expected plain weights")
    defaults = _DEFAULTS[model_type]
    layers, heads = d["num_hidden_layers"], d["num_attention_heads"]
    max_pos = d.get("max_position_embeddings", defaults["max_position_embeddings"])
    head_dim = d.get("head_dim", defaults.get("head_dim"))
    window, layer_types = _sliding(model_type, d, layers, source)
    attention_bias = bool(d.get("attention_bias", False))
    try:
        return ModelConfig(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            intermediate_size=d["intermediate_size"],
            head_dim=head_dim,  # type: ignore[arg-type]  # None: ModelConfig derives it (hidden / heads)
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            rope=_rope_from_hf(d, source, max_pos, d.get("layer_types")),
            qkv_bias=True if model_type == "qwen2" else attention_bias and model_type != "mistral",
            o_bias=attention_bias and model_type in ("llama", "qwen3"),
            mlp_bias=bool(d.get("mlp_bias", False)) and model_type == "llama",
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            layer_types=layer_types,  # type: ignore[arg-type]  # None: ModelConfig derives them
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            initializer_range=float(d.get("initializer_range", 0.02)),
            bos_token_id=_first(d.get("bos_token_id", defaults.get("bos_token_id"))),
            eos_token_id=_first(d.get("eos_token_id", defaults.get("eos_token_id"))),
            pad_token_id=_first(d.get("pad_token_id")),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{source}: invalid model config: {exc}") from exc


def _rope_to_hf(rope: RopeConfig, max_position_embeddings: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type == "default":
        return out
    for key, name in _ROPE_FIELDS.items():
        value = getattr(rope, name)
        if name == "truncate":
            if rope.rope_type == "yarn" and not value:
                out[key] = False
        elif value is not None:
            out[key] = value
    if rope.rope_type == "yarn":  # transformers' yarn needs both explicitly
        original = out.setdefault("original_max_position_embeddings", max_position_embeddings)
        out.setdefault("factor", max_position_embeddings / original)
    return out


KVGRAFT_MODEL_TYPE = "kvgraft"


def _kvgraft_config(d: dict[str, Any], source: str) -> ModelConfig:
    """kvgraft's own format: the full ModelConfig under the "kvgraft" key (see kvgraft_format.md)."""
    body = d.get("kvgraft")
    if not isinstance(body, dict):
        raise CheckpointError(f"{source}: model_type 'kvgraft' needs a 'kvgraft' object holding the ModelConfig")
    try:
        return ModelConfig.from_dict(body)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{source}: invalid kvgraft config: {exc}") from exc


def kvgraft_config_dict(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """config.json of kvgraft's own format: the ModelConfig plus the common top-level fields tools read."""
    return {
        "architectures": ["KvgraftForCausalLM"],
        "model_type": KVGRAFT_MODEL_TYPE,
        "kvgraft_format_version": 1,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "dtype": dtype,
        "torch_dtype": dtype,
        "kvgraft": cfg.to_dict(),
    }


def _check_representable(cfg: ModelConfig, model_type: str) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise UnsupportedModelError(f"model_type {model_type!r} cannot express this model: {what}")

    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    need(all(k == "gqa" for k in cfg.attention_kinds), f"attention_kinds {cfg.attention_kinds}, expected all 'gqa'")
    need(cfg.kv_slots == tuple(range(cfg.num_layers)), f"kv_slots {cfg.kv_slots}, expected no cross-layer sharing")
    sliding = "sliding_attention" in cfg.layer_types
    need(cfg.mlp_bias is False or model_type == "llama", "mlp_bias needs model_type 'llama'")
    need(cfg.qk_norm == (model_type == "qwen3"), f"qk_norm={cfg.qk_norm}; only qwen3 has (and needs) q/k norms")
    if model_type == "qwen2":
        need(cfg.qkv_bias and not cfg.o_bias, "qwen2 needs q/k/v biases and no o_proj bias")
    elif model_type == "mistral":
        need(not cfg.qkv_bias and not cfg.o_bias, "mistral has no attention biases")
    else:
        need(cfg.qkv_bias == cfg.o_bias, f"{model_type} biases q/k/v and o together (attention_bias)")
    if model_type == "llama":
        need(not sliding, "llama has no sliding-window layers")
    if model_type == "mistral":
        need(
            cfg.sliding_window is None or all(t == "sliding_attention" for t in cfg.layer_types),
            "mistral applies its sliding window to every layer",
        )


def natural_model_type(cfg: ModelConfig) -> str:
    """ "llama" for a plain Llama-family model, else kvgraft's own format (MLA grafts, encoder-decoders)."""
    return "llama" if set(cfg.attention_kinds) == {"gqa"} else KVGRAFT_MODEL_TYPE


def hf_config_from_model(cfg: ModelConfig, model_type: str, dtype: str = "float32") -> dict[str, Any]:
    """A config.json dict for ``model_type`` that transformers loads into the same architecture."""
    if model_type == KVGRAFT_MODEL_TYPE:
        return kvgraft_config_dict(cfg, dtype)
    _check_representable(cfg, model_type)
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": _rope_to_hf(cfg.rope, cfg.max_position_embeddings),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,  # the key transformers 4 reads
    }
    if model_type == "llama":
        d["attention_bias"] = cfg.qkv_bias
        d["mlp_bias"] = cfg.mlp_bias
    elif model_type == "qwen3":
        d["attention_bias"] = cfg.qkv_bias
    if model_type == "mistral":
        d["sliding_window"] = cfg.sliding_window  # explicit null: Mistral's default is 4096
    elif model_type in ("qwen2", "qwen3"):
        d["use_sliding_window"] = cfg.sliding_window is not None
        d["sliding_window"] = cfg.sliding_window
        sliding = [i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention"]
        d["max_window_layers"] = sliding[0] if sliding else cfg.num_layers
        d["layer_types"] = list(cfg.layer_types)
    return d
