"""``plan_conversion``: everything ``kvgraft convert`` decides before the weights load, as one :class:`ConvertPlan`.

The plan is built from the options (``kvgraft.graft.options.ConvertOptions``), the source's ``config.json``,
its tokenizer and the calibration tokens; the weights are never read. Every check ``convert`` makes before
the work starts is made here, in one order, so that a bad argument is refused (ValueError, FileExistsError,
FileNotFoundError, ``kvgraft.errors`` errors, each naming the value) before anything is loaded or written.
What remains for ``kvgraft.graft.convert.execute`` is the work: refusing non-finite weights, the grafts,
the measurements and writing the output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgraft.checks import check_device, check_writable
from kvgraft.errors import ConfigError, UnsupportedModelError
from kvgraft.graft.calibration import CalibrationPlan, plan_calibration
from kvgraft.graft.ced import CEDGraftConfig, default_kv_sources
from kvgraft.graft.mla import GraftConfig, mla_model_config
from kvgraft.graft.options import ConvertOptions
from kvgraft.graft.ranks import (
    DEFAULT_CED_COMPRESSION,
    DEFAULT_COMPRESSION,
    STOCK_LAYOUTS,
    STOCK_ROPE_SELECTION,
    default_ranks,
)
from kvgraft.graft.staging import check_staging
from kvgraft.hf.deepseek import config_problems, stock_rope_parameters
from kvgraft.hf.engines import VLLM_PREFERRED, vllm_rope_problem, vllm_shape_problem
from kvgraft.hf.load import load_config, load_tokenizer_dir
from kvgraft.model.config import ModelConfig
from kvgraft.model.fields import known
from kvgraft.reference import resolve_model

_STOCK_HEAD_NOTE = (
    "(stock DeepSeek-V3 rotates each frequency once in its one shared RoPE key, so the RoPE parts "
    "of {heads} KV heads cannot all keep their rotation: --rope-dim {head_dim} is the closest stock "
    "export, its measured error printed)"
)


@dataclass(frozen=True)
class ConvertPlan:
    """A conversion, decided: what ``execute`` does, with nothing left to choose.

    ``source``: the checkpoint directory (resolved), ``source_config`` its config; ``out``: the output
    directory; ``options``: what was asked, as given. ``output_format``: the format(s) written (the default
    resolved). ``kv_lora_rank``/``qk_rope_head_dim``: the ranks the graft uses (d_c, d_rope; for the stock
    format's "transformers" construction d_c is one less than the budget's, the export adds a constant
    coordinate), ``rank_notes`` how the rule chose them (empty when given). ``mla``: the MLA graft (None: the
    input is all-MLA already and ``to == "ced"`` uses it as it is); ``ced``: the share graft (``to == "ced"``
    only); ``calibration``: the tokens read (None for objective "weights"); ``has_tokenizer``: the source has
    a tokenizer.json (copied to the output). Validated on construction (ValueError naming what disagrees).
    """

    source: Path
    out: Path
    options: ConvertOptions
    source_config: ModelConfig
    output_format: str
    kv_lora_rank: int
    qk_rope_head_dim: int
    rank_notes: tuple[str, ...]
    mla: GraftConfig | None
    ced: CEDGraftConfig | None
    calibration: CalibrationPlan | None
    has_tokenizer: bool

    def __post_init__(self) -> None:
        o, config = self.options, self.source_config
        if self.output_format != o.resolved_format:
            raise ConfigError(f"output_format {self.output_format!r} is not the options' {o.resolved_format!r}")
        if (self.ced is not None) != (o.to == "ced"):
            raise ConfigError(f"to {o.to!r} {'needs' if o.to == 'ced' else 'takes no'} share graft (ced)")
        if self.mla is None:
            if o.to != "ced" or set(known(config.attention_kinds, "attention_kinds")) != {"mla"}:
                raise ConfigError("only --to ced of an all-MLA model skips the MLA graft (mla None)")
        else:
            if (self.mla.kv_lora_rank, self.mla.qk_rope_head_dim) != (self.kv_lora_rank, self.qk_rope_head_dim):
                raise ConfigError(
                    f"the MLA graft's ranks ({self.mla.kv_lora_rank}, {self.mla.qk_rope_head_dim}) are "
                    f"not the plan's ({self.kv_lora_rank}, {self.qk_rope_head_dim})"
                )
            if self.stock and self.mla.rope_selection not in STOCK_LAYOUTS:
                raise ConfigError(f"rope selection {self.mla.rope_selection!r} cannot be exported to stock DeepSeek-V3")
            self.mla.check_against(config)
        if o.target is not None:
            if (self.kv_lora_rank, self.qk_rope_head_dim) != VLLM_PREFERRED:
                raise ConfigError(f"target {o.target!r} needs d_c + d_rope = {VLLM_PREFERRED[0]} + {VLLM_PREFERRED[1]}")
        if (self.calibration is None) != (o.objective == "weights"):
            raise ConfigError(f"objective {o.objective!r} {'takes no' if o.objective == 'weights' else 'needs'} calibration")
        if self.ced is not None:
            self.ced.check_against(self.predicted_config())

    # ---- what was asked, resolved
    @property
    def to(self) -> str:
        return self.options.to

    @property
    def stock(self) -> bool:
        """A stock DeepSeek-V3 export is written (``output_format`` "deepseek_v3" or "both")."""
        return self.output_format in ("deepseek_v3", "both")

    @property
    def serve_target(self) -> str | None:
        return self.options.target

    @property
    def stock_construction(self) -> str:
        return self.options.stock_construction

    @property
    def device(self) -> str:
        return self.options.device

    @property
    def overwrite(self) -> bool:
        return self.options.overwrite

    @property
    def progress(self) -> bool:
        return self.options.progress

    @property
    def qk_norm_linearised_for_stock_export(self) -> bool:
        return bool(self.stock and self.source_config.qk_norm)

    def predicted_config(self) -> ModelConfig:
        """The config the MLA graft will produce (the source's own when there is none), with a stand-in for
        the RoPE layout that calibration chooses."""
        return self.source_config if self.mla is None else _predicted_config(self.source_config, self.mla)

    def to_dict(self) -> dict[str, Any]:
        """The plan, JSON-ready (paths as strings; conversion.json records it under "plan")."""
        return {
            "source": str(self.source),
            "out": str(self.out),
            "to": self.to,
            "output_format": self.output_format,
            "serve_target": self.serve_target,
            "stock_construction": self.stock_construction,
            "ranks": {"kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim, "how": list(self.rank_notes)},
            "mla": None if self.mla is None else dataclasses.asdict(self.mla),
            "ced": None if self.ced is None else dataclasses.asdict(self.ced),
            "calibration": None if self.calibration is None else self.calibration.to_dict(),
            "has_tokenizer": self.has_tokenizer,
            "device": self.device,
            "overwrite": self.overwrite,
            "progress": self.progress,
            "options": self.options.to_dict(),
        }


def _predicted_config(config: ModelConfig, graft: GraftConfig) -> ModelConfig:
    """``mla_model_config`` with the stand-in RoPE layout: the fastest pairs for "prefix", else every k-th."""
    d_rope, hd = graft.qk_rope_head_dim, known(config.head_dim, "head_dim")
    half = hd // 2
    if graft.rope_selection == "prefix":
        layout = tuple(range(d_rope // 2))
    else:
        layout = (
            tuple(range(0, half, hd // d_rope)) if hd % d_rope == 0 else tuple(i % half for i in range(d_rope // 2))
        )  # (wider than a head: pairs from several heads)
    return mla_model_config(config, graft, {i: layout for i in range(config.num_layers)})


DEFAULT_NORM_REFINE_EPOCHS = 4  # refinement epochs when the graft has its own latent norm and none are asked for


def plan_conversion(model: str | Path | None, out: str | Path, options: ConvertOptions | None = None) -> ConvertPlan:
    """Check everything and decide everything for converting ``model`` to ``out``; load no weights.

    ``options``: what ``convert`` is asked to do (None: ``ConvertOptions()``, the defaults). Reads the
    source's ``config.json``, its tokenizer (when it has one) and the calibration tokens
    (``kvgraft.graft.calibration``), probes ``out`` for writing and checks the device. Raises what ``convert``
    raises for a bad argument, before any work."""

    o = ConvertOptions() if options is None else options  # checked when built: the checks that need no model
    output_format, stock, to = o.resolved_format, o.stock, o.to
    check_device(o.device)
    src = resolve_model(model)
    out = _check_output(Path(out), o)
    config = load_config(src)  # config.json only
    # the stock export always normalises the latent: graft that norm so the export is exact by construction. Not by
    # default with attention biases (Qwen2, Llama attention_bias): the engine-safe export folds them approximately
    # either way, and only the fitted norm's error is measured against the gate there (<= 2.4% / 0.016 nats on
    # tiny checkpoints, tests/test_export_tolerance.py); --latent-norm asks for it
    biased = config.qkv_bias or config.o_bias
    latent_norm = (stock and to == "mla" and not biased) if o.latent_norm is None else o.latent_norm
    # the latent norm starts as a constant scale, far from what the latent needs on a real model (SmolLM2-135M at
    # 4x: 194x the original's perplexity unrefined, 8.8x refined; bench/RESULTS.md): refine it by default
    refine_epochs = o.refine_epochs if o.refine_epochs is not None else (DEFAULT_NORM_REFINE_EPOCHS if latent_norm else 0)
    hd = known(config.head_dim, "head_dim")
    kv_lora_rank, qk_rope_head_dim = o.kv_lora_rank, o.qk_rope_head_dim
    if o.target is not None:
        kv_lora_rank, qk_rope_head_dim = _target_ranks(o.target, config)
    seq_len = min(o.calibration_seq_len, config.max_position_embeddings)
    if o.calibration_tokens < seq_len and o.objective != "weights":
        raise ConfigError(
            f"calibration_tokens ({o.calibration_tokens}) must be at least one calibration sequence ({seq_len} tokens)"
        )
    already_mla = to == "ced" and set(known(config.attention_kinds, "attention_kinds")) == {"mla"}  # skip MLA step
    d_c, d_rope, rank_notes = _ranks(config, o, already_mla, latent_norm, kv_lora_rank, qk_rope_head_dim)
    rope_rotation = o.rope_rotation
    if rope_rotation is None:  # complex measured better for MLA (bench/mla_ood.py); the share graft is unmeasured
        rope_rotation = "real" if to == "ced" else "complex"
    rope_selection = _rope_selection(o.rope_selection, o, config, d_rope)
    graft = GraftConfig(
        kv_lora_rank=d_c,
        qk_rope_head_dim=d_rope,
        objective=o.objective,
        rope_selection=rope_selection,
        layerwise=o.layerwise,
        layers=o.layers,
        rope_expectation=o.rope_expectation and o.objective != "weights",
        calibration_shrinkage=o.calibration_shrinkage,
        rope_rotation=rope_rotation,
        refine_epochs=refine_epochs if o.objective != "weights" else 0,
        refine_lr=o.refine_lr,
        latent_norm=latent_norm,
        # stock DeepSeek-V3 has no per-head q/k norms: the stock export takes their linear fits
        qk_norm="linearise" if to == "ced" or (stock and config.qk_norm) else "keep",
    )
    if rope_selection == "stride" and (d_rope > hd or hd % d_rope):
        note = " " + _STOCK_HEAD_NOTE.format(heads=config.num_kv_heads, head_dim=hd)
        divisors = [v for v in range(2, hd + 1, 2) if hd % v == 0]
        raise ConfigError(
            f"rope selection 'stride' needs d_rope ({d_rope}) to divide head_dim ({hd}); "
            f"pass --rope-dim with one of {divisors} or leave it to the default rule"
            f"{note if stock and d_rope > hd else ''}"
        )
    predicted = config
    if not already_mla:
        graft.check_against(config)
        predicted = _predicted_config(config, graft)
    ced = None
    if to == "ced":
        sources = default_kv_sources(config.num_layers) if o.kv_source_layers is None else o.kv_source_layers
        ced = CEDGraftConfig(kv_source_layers=sources, sliding_window=o.sliding_window, compress_rate=o.compress_rate)
        ced.check_against(predicted)
    if stock:
        _check_stock(predicted, output_format)
    tokenizer = load_tokenizer_dir(src)
    calibration = None
    if o.objective != "weights":
        calibration = plan_calibration(src, o.calibration, o.calibration_tokens, seq_len, tokenizer, config.vocab_size)
    return ConvertPlan(
        source=src,
        out=out,
        options=o,
        source_config=config,
        output_format=output_format,
        kv_lora_rank=d_c,
        qk_rope_head_dim=d_rope,
        rank_notes=rank_notes,
        mla=None if already_mla else graft,
        ced=ced,
        calibration=calibration,
        has_tokenizer=tokenizer is not None,
    )


def _check_output(out: Path, o: ConvertOptions) -> Path:
    """``out`` when it may be written: refused when it exists (unless ``overwrite``), when an interrupted
    conversion's finished layers would be discarded silently, or when it cannot be written."""
    if out.exists() and not o.overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    check_staging(out, o.resume, o.overwrite)  # an interrupted conversion's finished layers are not discarded silently
    check_writable(out, what="output directory")
    return out


def _target_ranks(target: str, config: ModelConfig) -> tuple[int, int]:
    """(d_c, d_rope) a serve ``target`` asks for, or ConfigError saying why the model cannot take them."""
    problem = vllm_shape_problem(config.kv_width, known(config.head_dim, "head_dim"))
    if problem:
        raise ConfigError(f"--target {target}: {problem}")
    problem = vllm_rope_problem(config.rope.rope_type)
    if problem:
        raise ConfigError(
            f"--target {target}: {problem}; --format deepseek_v3 without --target writes the "
            "export exactly for transformers (with this warning)"
        )
    return VLLM_PREFERRED


def _ranks(
    config: ModelConfig,
    o: ConvertOptions,
    already_mla: bool,
    latent_norm: bool,
    kv_lora_rank: int | None,
    qk_rope_head_dim: int | None,
) -> tuple[int, int, tuple[str, ...]]:
    """(d_c, d_rope, how they were chosen): an all-MLA source's own, else the default rule's
    (``kvgraft.graft.ranks.default_ranks``) for what was given."""
    stock, to, rope_selection = o.stock, o.to, o.rope_selection
    if already_mla:
        d_rope, d_c = known(config.qk_rope_head_dim, "qk_rope_head_dim"), known(config.kv_lora_rank, "kv_lora_rank")
        rank_notes: tuple[str, ...] = ()
    else:
        ranks = default_ranks(
            config,
            compression=o.compression,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            stock=stock,
            stock_layout=rope_selection if rope_selection in STOCK_LAYOUTS else STOCK_ROPE_SELECTION,
            default_compression=DEFAULT_CED_COMPRESSION if to == "ced" else DEFAULT_COMPRESSION,
        )
        d_c, d_rope, rank_notes = ranks.kv_lora_rank, ranks.qk_rope_head_dim, ranks.how
        if stock and o.stock_construction == "transformers" and kv_lora_rank is None and d_c > 1 and not latent_norm:
            # the stock export pins DeepSeek-V3's latent RMSNorm with one constant latent coordinate
            # (kvgraft.hf.deepseek, latent_norm "pad"): graft one value less so the export caches the budget
            d_c -= 1
            rank_notes = (
                *rank_notes,
                (
                    f"stock DeepSeek-V3 export: one of the d_c values is a constant coordinate that makes its latent "
                    f"RMSNorm exact, so the graft keeps d_c = {d_c} and the export caches {d_c + 1} + {d_rope}"
                ),
            )
    return d_c, d_rope, rank_notes


def _rope_selection(rope_selection: str, o: ConvertOptions, config: ModelConfig, d_rope: int) -> str:
    """The RoPE selection ``auto`` stands for, checked against the stock export and the prefix layout."""
    stock, to, output_format, hd = o.stock, o.to, o.resolved_format, known(config.head_dim, "head_dim")
    if rope_selection == "auto":  # the best measured ("norm") unless a stock export needs one of its layouts
        rope_selection = STOCK_ROPE_SELECTION if stock else "shared" if to == "ced" else "norm"
    if stock and rope_selection not in STOCK_LAYOUTS:
        raise ConfigError(
            f"rope selection {rope_selection!r} cannot be exported to stock DeepSeek-V3 (--format {output_format}): "
            "its one shared RoPE key rotates each frequency once, in every layer, at theta'^(-2j/d_rope); use "
            "--rope-selection prefix or stride (or auto), or --format kvgraft"
        )
    note = " " + _STOCK_HEAD_NOTE.format(heads=config.num_kv_heads, head_dim=hd)
    if rope_selection == "prefix" and d_rope > hd:
        raise ConfigError(
            f"rope selection 'prefix' needs d_rope ({d_rope}) <= head_dim ({hd}): it keeps "
            f"one rotated head at the d_rope/2 fastest frequencies; pass --rope-dim with an even value <= "
            f"{hd} or leave it to the default rule{note if stock else ''}"
        )
    return rope_selection


def _check_stock(predicted: ModelConfig, output_format: str) -> None:
    """UnsupportedModelError when stock DeepSeek-V3 cannot hold the converted model."""
    problems = config_problems(predicted)
    if problems:
        raise UnsupportedModelError(
            "cannot export to stock DeepSeek-V3 (--format "
            + output_format
            + "): "
            + "; ".join(problems)
            + "; use --format kvgraft"
        )
    stock_rope_parameters(predicted)


__all__ = ["ConvertPlan", "plan_conversion"]
