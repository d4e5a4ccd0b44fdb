"""``export_deepseek_v3``: write the stock DeepSeek-V3 checkpoint, its ``ExportReport`` and README card.

A sliding window (Mistral): stock DeepSeek-V3 has none, so the export is the closest stock model (full
attention): exact for contexts up to the window, said in config.json (``kvgraft_export``), README.md and the
report, and measured on both sides of the window.
``ExportReport`` carries the measured logit error, KL and perplexities on the calibration tail.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from kvgraft.checks import check_int
from kvgraft.errors import CheckpointError, ConfigError, UnsupportedModelError
from kvgraft.hf.deepseek.checks import (
    MLALayer,
    config_problems,
    deepseek_v3_fast_path,
    has_nonzero,
    mla_layers,
    weight_problems,
)
from kvgraft.hf.deepseek.folds import EngineFold, collect_input_moments, engine_folds
from kvgraft.hf.deepseek.latent import (
    ENGINE_LATENT_RMS,
    LATENT_NORM_STRATEGIES,
    PIN_DELTA,
    STOCK_LATENT_NORM_EPS,
    Latent,
    approx_latent,
    collect_latents,
    exact_latent,
    latent_unit,
    pad_latent,
)
from kvgraft.hf.deepseek.measure import measure_export
from kvgraft.hf.deepseek.rope import stock_rope_parameters
from kvgraft.hf.deepseek.tensors import attention_bias_needed, deepseek_v3_config, query_bias_layers, stock_tensors
from kvgraft.hf.save import TOKENIZER_FILES, OutputExistsError, write_checkpoint_dir
from kvgraft.model.config import ModelConfig
from kvgraft.model.mla import MLAttention
from kvgraft.model.transformer import Block, Transformer

# Who must compute the export's function. "engines" (the default): vLLM and SGLang as well as transformers.
# Their DeepSeek-V2/V3 models build every attention projection with bias=False and skip bias tensors they
# have no parameter for (vllm/model_executor/models/deepseek_v2.py, "Skip loading extra bias"; SGLang's
# deepseek_v2.py likewise), and serve in fp16/bf16: no bias tensor, every weight within fp16's range.
# "transformers": the exact constructions (a constant latent / query coordinate held by attention biases,
# constants up to ~1e7), which only transformers computes as written.
STOCK_TARGETS = ("engines", "transformers")
FP16_MAX = 65504.0


@dataclass(frozen=True)
class ExportOptions:
    """How ``export_deepseek_v3`` (and the streamed export) write and check the stock checkpoint; the meaning
    of each is in ``export_deepseek_v3``'s docstring. ``overwrite``: replace an existing ``out_dir``.
    ``dtype``: of the written tensors (None: the model's). ``measure``: load the result with stock
    transformers and measure it. ``max_fit_tokens``: calibration tokens the latent fit and the engine folds
    read. ``verbose``: print the report. ``tail_sequences``: the calibration rows the error is measured on."""

    overwrite: bool = False
    latent_norm: str | None = None
    target: str = "engines"
    dtype: torch.dtype | None = None
    measure: bool = True
    max_fit_tokens: int = 8192
    verbose: bool = False
    tail_sequences: int = 8


@dataclass
class ExportReport:
    """What ``export_deepseek_v3`` wrote and how far the checkpoint is from the kvgraft model.

    ``latent_norm``: "exact" (the model has its own latent norm), "pad" (exact: a constant latent coordinate
    pins the stock norm's rms), "scale" or "fit" (approximations). ``exact``: the exported model computes the
    kvgraft model's function for every input (to fp rounding; the pinned constructions add at most
    ``PIN_DELTA`` / 2 relative error to a latent or query scale); False lists the reasons in
    ``approximations``. ``exact_up_to_tokens``: contexts up to this length are exact even when ``exact`` is
    False (a sliding window exported as full attention).
    ``max_abs_logit_diff`` / ``mean_kl`` (KL(ours || exported) per token, nats) / ``perplexity`` ({"kvgraft":,
    "deepseek_v3":}, next-token perplexity): measured in fp32 with stock transformers on ``measured_on`` ids (the
    calibration tail, or random ids); ``max_abs_logit_diff_within_window``: the same on the first
    ``exact_up_to_tokens`` positions. None when not measured.
    ``kv_lora_rank`` / ``q_lora_rank``: the exported ranks; ``extra_parameters``: parameters the export adds
    over the kvgraft model (pad coordinate, low-rank query path).
    ``latent_rms_cv``: per layer, std/mean of the exported latent's rms over calibration tokens ("fit"/"scale"
    only). ``warnings``: fast-path, serving-stack and fallback notes.
    """

    path: Path
    latent_norm: str
    max_abs_logit_diff: float | None = None
    mean_kl: float | None = None
    measured_on: str | None = None
    latent_rms_cv: tuple[float, ...] = ()
    warnings: list[str] = field(default_factory=list)
    exact: bool = True
    approximations: list[str] = field(default_factory=list)
    exact_up_to_tokens: int | None = None
    max_abs_logit_diff_within_window: float | None = None
    perplexity: dict | None = None
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    extra_parameters: int = 0
    folded: list[str] = field(default_factory=list)
    target: str = "engines"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["path"] = str(self.path)
        out["latent_rms_cv"] = list(self.latent_rms_cv)
        return out

    def summary(self) -> list[str]:
        """The report as printed lines (what ``kvgraft convert --format deepseek_v3`` shows)."""
        if self.exact:
            what = "exact"
        elif self.exact_up_to_tokens is not None:
            what = f"exact up to {self.exact_up_to_tokens} tokens of context, approximate beyond"
        else:
            what = "approximate"
        lines = [
            (
                f"stock DeepSeek-V3 export -> {self.path}: {what} (for {self.target}; latent norm "
                f"{self.latent_norm}; kv_lora_rank {self.kv_lora_rank}, q_lora_rank {self.q_lora_rank})"
            )
        ]
        lines += [f"  folded: {f}" for f in self.folded]
        lines += [f"  not exact: {a}" for a in self.approximations]
        if self.max_abs_logit_diff is not None:
            m = (
                f"  measured on {self.measured_on}: max |logit diff| vs the kvgraft model "
                f"{self.max_abs_logit_diff:.3g}, mean KL {self.mean_kl:.3g} nats"
            )
            if self.perplexity:
                m += (
                    f", perplexity {self.perplexity['kvgraft']:.4g} (kvgraft) -> "
                    f"{self.perplexity['deepseek_v3']:.4g} (deepseek_v3)"
                )
            lines.append(m)
        if self.max_abs_logit_diff_within_window is not None:
            lines.append(
                f"  within the first {self.exact_up_to_tokens} tokens: max |logit diff| "
                f"{self.max_abs_logit_diff_within_window:.3g}"
            )
        lines += [f"  note: {w}" for w in self.warnings]
        return lines


def export_deepseek_v3(
    model: Transformer,
    out_dir: str | Path,
    options: ExportOptions | None = None,
    *,
    tokenizer_dir: str | Path | None = None,
    calibration: torch.Tensor | None = None,
) -> ExportReport:
    """Write ``model`` (every layer MLA) as a stock DeepSeek-V3 checkpoint at ``out_dir``, as ``options`` (an
    :class:`ExportOptions`; None: its defaults) say.

    ``target``: "engines" (default) writes what vLLM and SGLang load as transformers does: no attention bias
    tensors (``attention_bias: false``; those engines build the projections without biases and skip bias
    tensors), every weight within fp16's range (checked; they serve in fp16/bf16). The latent norm is then
    "fit" (or "scale"), and any attention bias of the model is folded into the weights through the attention
    input's least-squares mean direction (``EngineFold``; needs ``calibration``), its error measured.
    "transformers": the exact constructions below ("pad", a query bias through the low-rank query path, an
    o_proj bias), which hold constants up to ~1e7 in attention biases: exact in transformers only; a warning
    says so.
    ``latent_norm`` (None: "fit" for engines, "pad" for transformers) applies only to models without their
    own latent norm (``mla_latent_norm=False``):
    "pad" (exact, target "transformers" only): the exported latent has one more coordinate (d_c + 1), a constant so large that
    stock's kv_a_layernorm divides every token by the same rms (to within ``PIN_DELTA`` / 2, from a bound on
    the weights, whatever the input); the norm weight undoes that constant and kv_b ignores the coordinate.
    It costs one cached value per token and layer (and moves d_c off FlashMLA's 512: graft d_c = 511 for
    that). "fit" (needs ``calibration`` token ids (N, T); falls back to "scale" with a warning) and "scale"
    keep d_c and approximate the norm: "scale" keeps the latent basis (normalised to unit mean rms) and sets
    the norm weight to the constant that best restores the latent's magnitude on calibration tokens (about
    its mean rms; without calibration, estimated from the weights for isotropic unit-rms attention inputs).
    "fit" also changes the latent basis, c' = M c and kv_b' = kv_b M^-1, with M^T M =
    ``fit_latent_metric(latents)``, so that rms(c') is as constant as possible.
    A query bias (Qwen2, attention_bias) goes through stock's low-rank query path, exactly by the same
    construction: q_lora_rank = min(hidden, H (d_nope + d_rope)) + 1. A sliding window is exported as full
    attention: exact for contexts up to the window, stated in config.json (``kvgraft_export``), README.md and
    the report, and measured on both sides of it.
    ``calibration``: the last ``tail_sequences`` rows serve the error measurement (max |logit diff|, KL,
    perplexity; random ids without it). ``dtype``: of the written tensors (default: the model's).
    ``measure``: load the result with stock transformers and measure it. ``verbose``: print the report.
    Raises UnsupportedModelError naming what stock DeepSeek-V3 cannot express and what would make it possible.
    """
    o = options or ExportOptions()
    target, dtype, max_fit_tokens, tail_sequences = o.target, o.dtype, o.max_fit_tokens, o.tail_sequences
    out_dir = Path(out_dir)
    latent_norm = check_arguments(out_dir, o.overwrite, target, o.latent_norm, tail_sequences)
    cfg = model.config
    refuse_problems(config_problems(cfg) + weight_problems(model))
    layers = mla_layers(model)  # every layer is MLA (config_problems)
    rope_parameters, q_fold, rope_notes, tokenizer_files = check_inputs(cfg, calibration, tokenizer_dir)
    if target == "engines" and calibration is None:
        refuse_unfolded_biases(_biased_layers(layers, cfg))
    notes, approximations, window = opening_notes(cfg, target, rope_notes)
    folded: list[str] = []
    was_training = model.training
    model.eval()
    try:
        strategy = latent_strategy(cfg, latent_norm, calibration, notes, approximations, folded)
        fit = strategy in ("fit", "scale")
        raw = collect_latents(model, calibration, max_fit_tokens) if fit and calibration is not None else None
        latents = [layer_latent(strategy, b.block, cfg, None if raw is None else raw[i]) for i, b in enumerate(layers)]
        folds = None
        if target == "engines":
            folds = _engine_folds(model, latents, calibration, max_fit_tokens, approximations, folded)
        q_bias_layers = query_bias_layers(model) if cfg.qkv_bias and target == "transformers" else []
        kv_a_bias, kv_b_bias = (any(has_nonzero(getattr(b.attn, n).bias) for b in layers) for n in ("kv_a_proj", "kv_b_proj"))
        low_rank_q, q_lora_rank, extra = bias_messages(cfg, target, strategy, q_bias_layers, kv_a_bias, kv_b_bias, folded)
        dc_out = latents[0].M.shape[0]
        notes = deepseek_v3_fast_path(cfg.replace(kv_lora_rank=dc_out), cfg.kv_width) + notes
        attention_bias = target == "transformers" and attention_bias_needed(model, latents, low_rank_q)
        dtype = dtype or model.embed_tokens.weight.dtype
        tensors = stock_tensors(model, latents, q_fold, attention_bias, low_rank_q, folds)
        tensors = _checked_dtype(tensors, dtype, fp16_safe=target == "engines")
        report = ExportReport(
            path=out_dir,
            latent_norm=strategy,
            warnings=notes,
            latent_rms_cv=tuple(lat.cv for lat in latents),
            exact=not approximations,
            approximations=approximations,
            exact_up_to_tokens=window,
            kv_lora_rank=dc_out,
            q_lora_rank=q_lora_rank,
            extra_parameters=extra,
            folded=folded,
            target=target,
        )
        config_json = export_config(cfg, report, rope_parameters, attention_bias, dtype)
        write_checkpoint_dir(out_dir, config_json, tensors, cfg, tokenizer_files, {"README.md": export_card(report)}, o.overwrite)
        if o.measure:
            _measure(report, model, out_dir, measured_ids(report, cfg, calibration, tail_sequences), window)
    finally:
        model.train(was_training)
    if o.verbose:
        print("\n".join(report.summary()), flush=True)
    return report


def _biased_layers(layers: list[MLALayer], cfg: ModelConfig) -> list[int]:
    """The layers with a nonzero attention bias that only a fold through calibration statistics removes."""
    return [
        i
        for i, b in enumerate(layers)
        if any(has_nonzero(getattr(b.attn, n).bias) for n in ("q_proj", "kv_a_proj", "o_proj"))
        or (
            b.attn.kv_b_proj.bias is not None
            and has_nonzero(b.attn.kv_b_proj.bias.view(cfg.num_heads, -1)[:, cfg.latent_dims()[2] :])
        )
    ]


def _engine_folds(
    model: Transformer,
    latents: list[Latent],
    calibration: torch.Tensor | None,
    max_fit_tokens: int,
    approximations: list[str],
    folded: list[str],
) -> list[EngineFold | None]:
    """The engine-safe bias folds of every layer (``EngineFold``), the latents' units they need filled in, and
    what they approximate added to ``approximations`` and ``folded``."""
    layers = mla_layers(model)
    has_bias = any(has_nonzero(getattr(b.attn, n).bias) for b in layers for n in ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj"))
    moments = collect_input_moments(model, calibration) if has_bias and calibration is not None else None
    folds = engine_folds(model, moments)
    if any(f is not None and f.value is not None for f in folds) and any(lat.unit is None for lat in latents):
        assert calibration is not None  # engine_folds refuses a value fold without it
        raw_c = collect_latents(model, calibration, max_fit_tokens)
        for i, lat in enumerate(latents):
            if lat.unit is None:
                lat.unit = latent_unit(lat, raw_c[i])
    fold_messages(folds, any(has_nonzero(b.attn.kv_b_proj.bias) for b in layers), approximations, folded)
    return folds


def _checked_dtype(tensors: dict[str, torch.Tensor], dtype: torch.dtype, fp16_safe: bool) -> dict[str, torch.Tensor]:
    """``tensors`` in ``dtype``, refused when one overflows it (or, ``fp16_safe``, fp16's range)."""
    if fp16_safe:
        refuse_fp16_overflow({k: e for k, v in tensors.items() if (e := fp16_excess(v)) is not None})
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    refuse_overflow([k for k, v in tensors.items() if not bool(torch.isfinite(v).all())], dtype)
    return tensors


def _measure(report: ExportReport, model: Transformer, out_dir: Path, ids: torch.Tensor, window: int | None) -> None:
    """Load the export with stock transformers, measure it against ``model`` on ``ids`` into ``report``, and
    rewrite the card with the figures."""
    m = measure_export(model, out_dir, ids, window=window)
    report.max_abs_logit_diff, report.mean_kl = m["max_abs_logit_diff"], m["mean_kl"]
    report.perplexity = m["perplexity"]
    report.max_abs_logit_diff_within_window = m.get("max_abs_logit_diff_within_window")
    (out_dir / "README.md").write_text(export_card(report), encoding="utf-8")


# The steps of the export that the whole-model ``export_deepseek_v3`` and the streamed one
# (``kvgraft.hf.deepseek.stream``) share: the same checks, messages and report in the same order.


def check_arguments(out_dir: Path, overwrite: bool, target: str, latent_norm: str | None, tail_sequences: int) -> str:
    """The export's arguments checked (before any work); the latent-norm strategy asked for (None resolved)."""
    if out_dir.exists() and not overwrite:
        raise OutputExistsError(f"{out_dir} already exists; pass overwrite=True to replace it")
    if target not in STOCK_TARGETS:
        raise ConfigError(
            f"target {target!r} is not one of {', '.join(STOCK_TARGETS)} ('engines': vLLM, SGLang and "
            "transformers; 'transformers': the exact bias constructions, transformers only)"
        )
    if latent_norm is None:
        latent_norm = "fit" if target == "engines" else "pad"
    if latent_norm not in LATENT_NORM_STRATEGIES:
        raise ConfigError(f"latent_norm {latent_norm!r} is not one of {', '.join(LATENT_NORM_STRATEGIES)}")
    if target == "engines" and latent_norm == "pad":
        raise ConfigError(
            "latent_norm 'pad' holds its constant coordinate in kv_a_proj_with_mqa's bias, which vLLM "
            "and SGLang do not load (they would silently compute another model); use latent_norm 'fit' "
            "or 'scale' for target 'engines', or target='transformers' for the exact, transformers-only "
            "export"
        )
    check_int("tail_sequences", tail_sequences, low=1)
    return latent_norm


def refuse_problems(problems: list[str]) -> None:
    if problems:
        raise UnsupportedModelError("cannot export to stock DeepSeek-V3: " + "; ".join(problems))


def check_inputs(
    cfg: ModelConfig, calibration: torch.Tensor | None, tokenizer_dir: str | Path | None
) -> tuple[dict, float, list[str], list[Path]]:
    """(rope_parameters, q fold, RoPE notes, tokenizer files): the RoPE re-expressed for stock (refused when it
    cannot be), the calibration's shape and the tokenizer directory checked."""
    rope_parameters, q_fold, rope_notes = stock_rope_parameters(cfg)
    if calibration is not None and (calibration.dim() != 2 or calibration.numel() == 0):
        raise ConfigError(f"calibration must be token ids of shape (N, T), got shape {tuple(calibration.shape)}")
    tokenizer_files: list[Path] = []
    if tokenizer_dir is not None:
        tokenizer_files = [Path(tokenizer_dir) / n for n in TOKENIZER_FILES if (Path(tokenizer_dir) / n).is_file()]
        if not tokenizer_files:
            raise CheckpointError(f"tokenizer directory {tokenizer_dir} has none of {', '.join(TOKENIZER_FILES)}")
    return rope_parameters, q_fold, rope_notes, tokenizer_files


def refuse_unfolded_biases(biased: list[int]) -> None:
    """``target="engines"`` without calibration: layers ``biased`` have attention biases it cannot fold."""
    if biased:
        raise ConfigError(
            f"layers {biased} have attention biases: the engine-safe stock export folds them into bias-free weights "
            "through the attention input's mean direction, measured on calibration text; pass calibration token "
            "ids, or export with target='transformers' (exact, transformers only)"
        )


def opening_notes(cfg: ModelConfig, target: str, rope_notes: list[str]) -> tuple[list[str], list[str], int | None]:
    """(notes, approximations, sliding window or None) before the latents: the RoPE's serving caveats (warned),
    the "transformers" construction's warning, a sliding window exported as full attention."""
    for note in rope_notes:
        if not note.endswith(": exact"):  # serving-stack caveats; an exact re-expression is only reported
            warnings.warn(note, stacklevel=3)
    notes = list(rope_notes)
    if target == "transformers":
        msg = (
            "target 'transformers': the exact constructions keep constants (up to ~1e7) in attention bias tensors; "
            "only transformers computes this checkpoint as written: vLLM and SGLang skip attention biases without "
            "an error and would serve a different model, and fp16 overflows; use target 'engines' for them"
        )
        warnings.warn(msg, stacklevel=3)
        notes.append(msg)
    approximations: list[str] = []
    window = None
    if "sliding_attention" in cfg.layer_types:
        window = cfg.sliding_window
        sliding = [i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention"]
        approximations.append(
            f"layers {sliding} attend within a sliding window of {window} tokens; stock DeepSeek-V3 has no sliding "
            f"window, so they are exported with full attention (the closest stock model): exact for contexts up to "
            f"{window} tokens, different beyond"
        )
    return notes, approximations, window


def latent_strategy(
    cfg: ModelConfig,
    latent_norm: str,
    calibration: torch.Tensor | None,
    notes: list[str],
    approximations: list[str],
    folded: list[str],
) -> str:
    """How the latent norm is exported ("exact", "pad", "fit" or "scale"; "fit" without calibration falls back
    to "scale"), its notes, approximation or fold appended."""
    dc = cfg.latent_dims()[0]
    if cfg.mla_latent_norm:
        if cfg.rms_norm_eps != STOCK_LATENT_NORM_EPS:
            notes.append(
                f"rms_norm_eps is {cfg.rms_norm_eps}: the latent is rescaled so transformers' kv_a_layernorm "
                f"(eps {STOCK_LATENT_NORM_EPS}) matches exactly; vLLM/SGLang apply rms_norm_eps there, i.e. an "
                f"effective latent-norm eps of {cfg.rms_norm_eps**2 / STOCK_LATENT_NORM_EPS:.3g}"
            )
        return "exact"
    if latent_norm == "pad":
        folded.append(
            f"latent RMSNorm: one constant latent coordinate (kv_lora_rank {dc} -> "
            f"{dc + 1}) pins stock's kv_a_layernorm to a constant rms (relative error <= "
            f"{PIN_DELTA / 2:.0e} for any input), undone by its weight; +1 cached value per token and layer"
        )
        return "pad"
    strategy = latent_norm
    if strategy == "fit" and calibration is None:
        msg = (
            "latent_norm 'fit' needs calibration token ids; falling back to 'scale' with the latent rms "
            "estimated from the weights alone"
        )
        warnings.warn(msg, stacklevel=3)
        notes.append(msg)
        strategy = "scale"
    approximations.append(
        f"latent RMSNorm approximated ('{strategy}'): stock always normalises the latent and this model "
        "has no latent norm (target='transformers' with latent_norm='pad' makes it exact at one more cached "
        "value per token, in transformers only; a graft with its own latent norm, mla_latent_norm, exports "
        "exactly everywhere)"
    )
    return strategy


def layer_latent(strategy: str, block: Block, cfg: ModelConfig, raw: torch.Tensor | None) -> Latent:
    """One layer's ``Latent`` for ``strategy`` (``raw``: its raw calibration latents for "fit"/"scale", or None)."""
    attn = cast(MLAttention, block.self_attn)
    if strategy == "exact":
        return exact_latent(attn, cfg.rms_norm_eps)
    if strategy == "pad":
        return pad_latent(attn, block.input_layernorm.weight)
    lat = approx_latent(attn, raw, strategy, block.input_layernorm.weight.detach())
    lat.M = lat.M * ENGINE_LATENT_RMS  # scale-free after the norm: only the engines' different eps sees this
    return lat


def fold_messages(folds: list[EngineFold | None], kv_b_bias: bool, approximations: list[str], folded: list[str]) -> None:
    """The engine-safe bias folds' approximations and folds (``folds``: per layer; only which parts are set,
    ``input_cv`` and ``o_residual`` are read). ``kv_b_bias``: some layer has a non-zero kv_b bias."""
    biased = [i for i, f in enumerate(folds) if f is not None]
    if biased:
        kinds = sorted(
            {
                k
                for f in folds
                if f is not None
                for k, v in (("query", f.q_delta), ("latent / RoPE key", f.a_delta), ("value / output", f.value))
                if v is not None
            }
        )
        cvs = [f.input_cv for f in folds if f is not None and (f.q_delta is not None or f.a_delta is not None)]
        approximations.append(
            f"attention biases ({', '.join(kinds)}; layers {biased}) folded into the weights for engines that "
            "load no bias: a bias b after W becomes W + b u^T with u . x ~ 1 on calibration inputs"
            + (f" (u . x varies by {max(cvs):.3g} relative std)" if cvs else "")
            + "; a constant value rides on kv_b through the normalised latent (target='transformers' keeps "
            "them exact, transformers only)"
        )
        if any(f is not None and f.o_residual > 1e-6 for f in folds):
            worst = max(f.o_residual for f in folds if f is not None)
            approximations.append(
                f"o_proj bias: o_proj cannot produce all of it from the values (relative "
                f"residual up to {worst:.3g}); the rest is dropped"
            )
    if kv_b_bias:
        folded.append("key bias: adds the same amount to every logit of a query (softmax ignores it): dropped")


def bias_messages(
    cfg: ModelConfig,
    target: str,
    strategy: str,
    q_bias_layers: list[int],
    kv_a_bias: bool,
    kv_b_bias: bool,
    folded: list[str],
) -> tuple[bool, int | None, int]:
    """(low-rank query path, q_lora_rank, extra parameters): a query bias's low-rank path ("transformers";
    ``q_bias_layers``), the "pad" coordinate's parameters, and the exact bias folds' messages."""
    low_rank_q = bool(q_bias_layers)
    _, dr, dn, dv = cfg.latent_dims()
    H, h = cfg.num_heads, cfg.hidden_size
    Hq = H * (dn + dr)
    q_rank = min(h, Hq) + 1  # the low-rank query path's width, when a query bias needs it
    q_lora_rank = q_rank if low_rank_q else None
    extra = 0
    if strategy == "pad":
        extra += cfg.num_layers * (h + 2 + H * (dn + dv))
    if low_rank_q:
        extra += cfg.num_layers * (q_rank * h + 2 * q_rank + Hq * q_rank - Hq * h)
        folded.append(
            f"query bias (layers {q_bias_layers}): stock's q_proj has no bias, so the queries go through its "
            f"low-rank path q_a_proj (with bias) -> q_a_layernorm -> q_b_proj with q_lora_rank {q_rank} "
            f"(min(hidden {h}, heads x qk_head_dim {Hq}) + 1): a constant coordinate pins the norm's rms "
            f"(relative error <= {PIN_DELTA / 2:.0e}) and carries the bias; "
            f"+{cfg.num_layers * (q_rank * h + 2 * q_rank + Hq * q_rank - Hq * h):,} parameters"
        )
    if target == "transformers" and kv_b_bias:
        folded.append(
            "key bias: adds the same amount to every logit of a query (softmax ignores it); value "
            "bias: through attention (weights sum to one) into o_proj's bias"
        )
    if target == "transformers" and kv_a_bias:
        folded.append("latent / RoPE-key bias: kv_a_proj_with_mqa's bias (attention_bias)")
    return low_rank_q, q_lora_rank, extra


def fp16_excess(tensor: torch.Tensor) -> float | None:
    """max |tensor| when it exceeds fp16's range (``target="engines"`` refuses it), else None."""
    if not tensor.numel():
        return None
    m = float(tensor.abs().max())
    return m if m > FP16_MAX else None


def refuse_fp16_overflow(big: dict[str, float]) -> None:
    """``target="engines"``: ``big`` (name -> max |value|) exceed fp16's range."""
    if big:
        name = max(big, key=lambda k: big[k])
        raise UnsupportedModelError(
            f"{len(big)} exported tensors exceed fp16's range ({FP16_MAX:.0f}), e.g. {name} up to {big[name]:.4g}: "
            "vLLM and SGLang serve in fp16/bf16; rescale the source model's weights, or export with "
            "target='transformers' (transformers only)"
        )


def refuse_overflow(bad: list[str], dtype: torch.dtype) -> None:
    """The tensors ``bad`` are not finite in the written ``dtype``."""
    if bad:
        raise UnsupportedModelError(
            f"the export overflows {str(dtype).removeprefix('torch.')} in {bad[0]} ({len(bad)} tensors); export in "
            "bfloat16 or float32 (dtype=...), or use latent_norm='fit'"
        )


def export_config(
    cfg: ModelConfig, report: ExportReport, rope_parameters: dict, attention_bias: bool, dtype: torch.dtype
) -> dict:
    """config.json of the export ``report`` describes (not yet measured)."""
    window = report.exact_up_to_tokens
    info = {"exact": report.exact, "latent_norm": report.latent_norm, "target": report.target}
    if window is not None:
        info |= {
            "exact_up_to_tokens": window,
            "sliding_window_of_the_source": window,
            "note": (
                f"the source model attends within a sliding window of {window} tokens; this stock "
                f"DeepSeek-V3 model uses full attention: identical for contexts up to {window} tokens, "
                "different beyond"
            ),
        }
    return deepseek_v3_config(
        cfg,
        rope_parameters,
        attention_bias,
        str(dtype).removeprefix("torch."),
        kv_lora_rank=report.kv_lora_rank,
        q_lora_rank=report.q_lora_rank,
        export_info=info,
    )


def measured_ids(report: ExportReport, cfg: ModelConfig, calibration: torch.Tensor | None, tail_sequences: int) -> torch.Tensor:
    """The ids the export's error is measured on (the calibration tail, or seeded random ids), said in
    ``report.measured_on``."""
    if calibration is not None:
        ids = calibration[-tail_sequences:]
        report.measured_on = f"the calibration tail ({ids.shape[0]} x {ids.shape[1]} tokens)"
    else:
        t = min(64, cfg.max_position_embeddings)
        ids = torch.randint(0, cfg.vocab_size, (4, t), generator=torch.Generator().manual_seed(0))
        report.measured_on = f"random ids ({ids.shape[0]} x {ids.shape[1]} tokens)"
    return ids


def export_card(report: ExportReport) -> str:
    """README.md of the export: what it is, what is exact, what is not, and the measured error."""
    lines = [
        "# Stock DeepSeek-V3 export (kvgraft)",
        "",
        (
            "Loads with unmodified `transformers.AutoModelForCausalLM` (`model_type: deepseek_v3`, no remote code). "
            "Converted from a grafted kvgraft model by `kvgraft convert --format deepseek_v3`."
        ),
        "",
        "## Exactness",
        "",
    ]
    if report.exact:
        lines.append(
            "**Exact**: this model computes the same function as the kvgraft model it was exported from "
            "(up to floating-point rounding)."
        )
    elif report.exact_up_to_tokens is not None:
        lines.append(f"**Exact for contexts up to {report.exact_up_to_tokens} tokens**; approximate beyond.")
    else:
        lines.append("**Approximate**: the closest stock DeepSeek-V3 model; the measured cost is below.")
    lines.append("")
    lines += [f"- folded exactly: {f}" for f in report.folded]
    lines += [f"- not exact: {a}" for a in report.approximations]
    if report.max_abs_logit_diff is not None:
        lines += [
            "",
            "## Measured",
            "",
            f"On {report.measured_on}, fp32, against the kvgraft model:",
            "",
            f"- max |logit difference|: {report.max_abs_logit_diff:.3g}",
            f"- mean KL(kvgraft || export): {report.mean_kl:.3g} nats per token",
        ]
        if report.perplexity:
            lines.append(
                f"- perplexity: {report.perplexity['kvgraft']:.4g} (kvgraft) vs "
                f"{report.perplexity['deepseek_v3']:.4g} (this export)"
            )
        if report.max_abs_logit_diff_within_window is not None:
            lines.append(
                f"- max |logit difference| within the first {report.exact_up_to_tokens} tokens: "
                f"{report.max_abs_logit_diff_within_window:.3g}"
            )
    lines += ["", "## Serving", ""]
    if report.target == "engines":
        lines += [
            "Written for engines (`--stock-construction engines`): no attention bias tensor and every weight "
            "within fp16's range, so vLLM and SGLang (whose DeepSeek models load no attention bias) compute "
            "what transformers computes.",
            "",
            "vLLM on a CPU: run it in its default compiled mode, or with `--enforce-eager` add "
            '`--compilation-config \'{"custom_ops": ["-rotary_embedding"]}\'`: vLLM 0.32\'s CPU rotary '
            "kernel rotates the wrong rows of MLA's query/key views under eager mode (only position 0 comes "
            "out right; kvgraft's docs/vllm.md). MLA backends on vLLM's CPUs need kv_lora_rank 512 and "
            "qk_rope_head_dim 64 (`kvgraft convert --target vllm`).",
        ]
    else:
        lines += [
            "**Transformers only** (`--stock-construction transformers`): the exact constructions hold "
            "constants in attention bias tensors, which vLLM and SGLang skip without an error: they would "
            "serve a different model. Export with the default `--stock-construction engines` for them."
        ]
    if report.warnings:
        lines += ["", "## Notes", ""] + [f"- {w}" for w in report.warnings]
    return "\n".join(lines) + "\n"


__all__ = [
    "FP16_MAX",
    "STOCK_TARGETS",
    "ExportReport",
    "export_card",
    "export_deepseek_v3",
]
