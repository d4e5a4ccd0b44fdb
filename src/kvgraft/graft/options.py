"""The options of ``kvgraft convert``: one declaration, the object ``convert()`` and ``plan_conversion()`` take and the CLI builds.

:class:`ConvertOptions` is what a caller asks for, as given (None where a rule decides later). Each field
carries its command-line form (:class:`CliOption`: flag, type, choices, help) in its metadata, so the
``convert`` subcommand's options are built from this class (:func:`add_cli_options`, read back with
:func:`options_from_cli`) and its defaults are the fields' defaults. Constructing it runs every check that
needs neither the model nor a device, in the order (and with the messages) ``convert`` has always used;
everything that needs the model's ``config.json`` is ``kvgraft.graft.plan.plan_conversion``'s.

Light on purpose (no torch, no numpy): ``kvgraft --help`` builds the parser from it.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgraft.checks import check_int, check_number
from kvgraft.errors import ConfigError

FORMATS = ("kvgraft", "deepseek_v3", "both")
TARGETS = ("mla", "ced")
SERVE_TARGETS = ("vllm",)  # engines convert can shape the stock export for (kvgraft.hf.engines)
STOCK_CONSTRUCTIONS = ("engines", "transformers")  # kvgraft.hf.deepseek.STOCK_TARGETS
# the CLI's choices; kvgraft.graft.mla checks the values (mla imports torch, so they are not imported here)
OBJECTIVE_CHOICES = ("weights", "activations", "attention")  # kvgraft.graft.mla.OBJECTIVES
ROPE_SELECTION_CHOICES = ("auto", "stride", "prefix", "norm", "shared")  # "auto" + kvgraft.graft.mla.ROPE_SELECTIONS
ROPE_ROTATION_CHOICES = ("real", "complex")  # kvgraft.graft.mla_math.ROPE_ROTATIONS
NOT_RECORDED = ("resume",)  # options left out of to_dict (and so out of conversion.json)
# the stock export's measured distance from the kvgraft model allowed by default (kvgraft.graft.stock.export_error_check):
# a relative perplexity difference and a mean KL in nats per token on the calibration tail. Measured by default
# settings: exact exports ~1e-9 / ~1e-15; the engine-safe (approximate) export of models/kvgraft-llama-8m 0.8% /
# 0.0036 (2x), 1.25% / 0.0048 (4x), 3.6% / 0.011 (8x); tiny random Qwen2 with folded biases 2.4% / 0.016;
# the broken export of issue 34 (a real model) 650x / 6.7 nats. docs/export.md ("The tolerance")
EXPORT_TOLERANCE = 0.1
EXPORT_KL_TOLERANCE = 0.1


@dataclass(frozen=True)
class CliOption:
    """How one :class:`ConvertOptions` field appears on ``kvgraft convert``'s command line.

    ``flag``: e.g. ``--rope-dim`` (argparse's dest is the flag's name, ``rope_dim``); ``kind``: "value" (one
    value of ``type``), "list" (one or more values of ``type``, handed to Python as a tuple, None when not
    given), "bool" (``--x/--no-x``) or "switch" (``--x``, store_true)."""

    flag: str
    help: str | None = None
    value_type: type | None = None
    choices: tuple[str, ...] | None = None
    kind: str = "value"

    @property
    def dest(self) -> str:
        """argparse's attribute for the flag (``--rope-dim`` -> ``rope_dim``)."""
        return self.flag.lstrip("-").replace("-", "_")


def _opt(
    default: Any,
    flag: str | None = None,
    help: str | None = None,
    *,
    value_type: type | None = None,
    choices: tuple[str, ...] | None = None,
    kind: str = "value",
) -> Any:
    """A ConvertOptions field: its default and, unless ``flag`` is None (Python only), its CLI form
    (``value_type``: argparse's type, e.g. int)."""
    cli = None if flag is None else CliOption(flag, help, value_type, choices, kind)
    return field(default=default, metadata={"cli": cli})


@dataclass(frozen=True)
class ConvertOptions:
    """What ``convert`` is asked to do (``convert()``'s keyword arguments, as given; the meaning of each is
    in ``convert()``'s docstring and the help texts). Raises ValueError on construction for an option that
    is wrong whatever the model; the rest is checked by ``plan_conversion`` against the model's config."""

    to: str = _opt(
        "mla",
        "--to",
        "mla: per-layer latent KV; ced: causal encoder-decoder with shared compressed KV "
        "written by a few kv_source layers plus a sliding window per layer (the share graft)",
        choices=TARGETS,
    )
    kv_source_layers: tuple[int, ...] | None = _opt(
        None,
        "--kv-source-layers",
        "--to ced: layers that write the shared KV, the last is the pivot (default: "
        "pivot at the middle layer, e.g. 1 3 4 for 8 layers)",
        value_type=int,
        kind="list",
    )
    sliding_window: int = _opt(64, "--sliding-window", "--to ced: window of every layer (tokens)", value_type=int)
    compress_rate: int = _opt(1, "--compress-rate", "--to ced: tokens pooled per shared entry (m)", value_type=int)
    compression: float | None = _opt(
        None,
        "--compression",
        "per-layer KV reduction factor (default 4; 2 with --to ced): the budget d_c + d_rope "
        "= KV width / compression, split by the default rank rule (docs/ranks.md)",
        value_type=float,
    )
    kv_lora_rank: int | None = _opt(
        None, "--kv-lora-rank", "latent width d_c cached per token per layer (instead of --compression)", value_type=int
    )
    qk_rope_head_dim: int | None = _opt(
        None,
        "--rope-dim",
        "width of the shared RoPE key d_rope (default: the largest even width <= min(64, "
        "head_dim, budget / 2); a divisor of head_dim with --format deepseek_v3/both)",
        value_type=int,
    )
    objective: str = _opt(
        "attention",
        "--objective",
        "latent initialisation: joint SVD of the weights, PCA of K/V outputs on "
        "calibration text, or attention-aware (key error weighted by queries, value error by W_O)",
        choices=OBJECTIVE_CHOICES,
    )
    rope_selection: str = _opt(
        "auto",
        "--rope-selection",
        "which RoPE frequencies stay: the fastest d_rope/2 (prefix) or every k-th "
        "(stride), both stock DeepSeek-V3 layouts, or the largest measured contributions per layer (norm, kvgraft "
        "format only), or one layout for all layers by measured contribution (shared); auto: norm, shared with "
        "--to ced, prefix with --format deepseek_v3/both",
        choices=ROPE_SELECTION_CHOICES,
    )
    rope_rotation: str | None = _opt(
        None,
        "--rope-rotation",
        "how the KV heads' RoPE pairs are mixed per frequency before the kept ones are "
        "chosen: orthogonal (real) or unitary (complex: each kept pair the best rank-1 complex fit of the heads' "
        "pairs, a per-head phase folded into the queries); default complex (--to mla), real (--to ced)",
        choices=ROPE_ROTATION_CHOICES,
    )
    layerwise: bool = _opt(True, "--layerwise", "calibrate each layer on the converted layers' activations", kind="bool")
    refine_epochs: int | None = _opt(
        None,
        "--refine-epochs",
        "after each layer's factorisation, train its converted attention alone for this many epochs over the "
        "calibration text against the original stack's residual stream (Adam, no backward through other layers; 0: "
        "off; default: 4 when the graft has its latent norm, i.e. with --format deepseek_v3/both, else 0)",
        value_type=int,
    )
    refine_lr: float = _opt(1e-3, "--refine-lr", "learning rate of --refine-epochs (Adam, cosine decay)", value_type=float)
    latent_norm: bool | None = _opt(
        None,
        "--latent-norm",
        "graft an RMSNorm on the latent, as DeepSeek-V3 always has (kv_a_layernorm), so the stock export computes "
        "exactly what the kvgraft model does (with --refine-epochs it is trained through); default: on with "
        "--format deepseek_v3/both for models without attention biases, off otherwise",
        kind="bool",
    )
    calibration_shrinkage: float = _opt(
        0.5,
        "--calibration-shrinkage",
        "shrink each layer's calibration second moment toward the weights-only "
        "fit's, in [0, 1] (0: the calibrated fit as measured; default 0.5, measured to generalise better out of "
        "domain: bench/RESULTS.md)",
        value_type=float,
    )
    rope_expectation: bool = _opt(
        True,
        "--rope-expectation",
        "pairs that lose RoPE keep their expected rotation under the layer's measured attention distances (instead of none)",
        kind="bool",
    )
    layers: tuple[int, ...] | None = _opt(
        None,
        "--layers",
        "convert only these layers (progressive grafting); the rest stay as they are",
        value_type=int,
        kind="list",
    )
    calibration: str | Path | None = _opt(
        None, "--calibration", "calibration text (.txt) or token ids (.npy); default: the model's eval/calibration.npy"
    )
    calibration_tokens: int = _opt(32768, "--calibration-tokens", value_type=int)
    output_format: str | None = _opt(
        None,
        "--format",
        "kvgraft's own format and/or a stock DeepSeek-V3 checkpoint (all layers converted); "
        "default kvgraft, or deepseek_v3 with --target",
        choices=FORMATS,
    )
    target: str | None = _opt(
        None,
        "--target",
        "shape the stock DeepSeek-V3 export for an engine: vllm = d_c 512 + d_rope 64, the only "
        "shape vLLM's CPU backends and FlashMLA-class kernels take (refused, saying why, when the model's KV width "
        "or head_dim cannot); `kvgraft doctor` lists what each backend accepts",
        choices=SERVE_TARGETS,
    )
    stock_construction: str = _opt(
        "engines",
        "--stock-construction",
        "engines (default): no attention bias tensors and fp16-safe weights, so "
        "vLLM and SGLang compute what transformers does (latent norm fitted, biases folded: approximate, error "
        "printed); transformers: the exact constructions held in attention biases, which vLLM and SGLang drop "
        "(transformers only; docs/export.md)",
        choices=STOCK_CONSTRUCTIONS,
    )
    export_tolerance: float = _opt(
        EXPORT_TOLERANCE,
        "--export-tolerance",
        "the largest relative perplexity difference allowed between the stock DeepSeek-V3 export and the kvgraft "
        f"model it is written from, measured on the calibration tail (default {EXPORT_TOLERANCE:g}, i.e. "
        f"{EXPORT_TOLERANCE * 100:g} percent); above it, or above --export-kl-tolerance, convert fails and writes nothing "
        "(docs/export.md)",
        value_type=float,
    )
    export_kl_tolerance: float = _opt(
        EXPORT_KL_TOLERANCE,
        "--export-kl-tolerance",
        "the largest mean KL(kvgraft || export) allowed on the calibration tail, in nats per token (default "
        f"{EXPORT_KL_TOLERANCE:g})",
        value_type=float,
    )
    accept_export_error: bool = _opt(
        False,
        "--accept-export-error",
        "write the stock export even when it measures above the tolerances, with a warning in the log, its "
        "README.md and conversion.json",
        kind="switch",
    )
    device: str = _opt("cpu", "--device", "where the model and calibration run, e.g. cuda")
    overwrite: bool = _opt(False, "--overwrite", kind="switch")
    resume: bool = _opt(
        False,
        "--resume",
        "continue an interrupted conversion from its last finished layer (kept in the output's staging "
        "directory, .OUT.partial), if it was started from the same source with the same options; refused, "
        "naming the differences, otherwise",
        kind="switch",
    )
    # Python only
    calibration_seq_len: int = _opt(512)
    progress: bool = _opt(True)

    def __post_init__(self) -> None:
        """The checks that need neither the model nor a device, in ``convert``'s order."""
        target, output_format, to = self.target, self.resolved_format, self.to
        if target is not None and target not in SERVE_TARGETS:
            raise ConfigError(f"target {target!r} is not one of {', '.join(SERVE_TARGETS)} (or None)")
        if self.stock_construction not in STOCK_CONSTRUCTIONS:
            raise ConfigError(f"stock_construction {self.stock_construction!r} is not one of {', '.join(STOCK_CONSTRUCTIONS)}")
        if target is not None:
            if output_format not in ("deepseek_v3", "both"):
                raise ConfigError(
                    f"target {target!r} serves the stock DeepSeek-V3 export; format {output_format!r} "
                    "writes none (use --format deepseek_v3 or both)"
                )
            if to != "mla":
                raise ConfigError(
                    f"target {target!r} needs --to mla (vLLM runs the causal encoder-decoder only through kvgraft's own engine)"
                )
            if self.stock_construction != "engines":
                raise ConfigError(
                    f"target {target!r} needs stock_construction 'engines': vLLM loads no attention "
                    "bias, so the 'transformers' construction would silently serve another model"
                )
            # lazy: the CLI parser imports this module, and kvgraft.hf imports transformers
            from kvgraft.hf.engines import VLLM_PREFERRED

            want_c, want_r = VLLM_PREFERRED
            for name, value, want in (
                ("kv_lora_rank", self.kv_lora_rank, want_c),
                ("qk_rope_head_dim", self.qk_rope_head_dim, want_r),
            ):
                if value is not None and value != want:
                    raise ConfigError(
                        f"target {target!r} sets {name} to {want} (vLLM's CPU backends and "
                        f"FlashMLA-class kernels cache d_c + d_rope = 512 + 64); got {value}: drop it "
                        "or drop --target"
                    )
            if self.compression is not None:
                raise ConfigError(
                    f"target {target!r} fixes the ranks at {want_c} + {want_r}; --compression "
                    f"{self.compression} contradicts it: drop one"
                )
        if output_format not in FORMATS:
            raise ConfigError(f"format {output_format!r} is not one of {', '.join(FORMATS)}")
        if to not in TARGETS:
            raise ConfigError(f"target {to!r} is not one of {', '.join(TARGETS)}")
        if to == "ced":
            if output_format != "kvgraft":
                raise ConfigError(f"a causal encoder-decoder is written in kvgraft's format only, not {output_format!r}")
            if self.rope_selection == "norm":
                raise ConfigError(
                    "rope_selection 'norm' picks frequencies per layer; the shared RoPE keys of --to ced "
                    "need one layout ('shared', 'stride' or 'auto')"
                )
            if self.objective == "weights":
                raise ConfigError("--to ced fits the readers on calibration text; objective 'weights' has none")
            if self.latent_norm:
                raise ConfigError(
                    "--latent-norm: the share graft (--to ced) folds the latent into window keys and takes no latent norm"
                )
            for name in ("sliding_window", "compress_rate"):
                check_int(name, getattr(self, name), low=1)
        for name in ("calibration_tokens", "calibration_seq_len"):
            check_int(name, getattr(self, name), low=1)
        check_int("refine_epochs", self.refine_epochs, low=0, optional=True, accepted="a non-negative integer (0: no refinement)")
        check_number("refine_lr", self.refine_lr, positive=True)
        if self.refine_epochs and self.objective == "weights":
            raise ConfigError("--refine-epochs trains on calibration text; objective 'weights' reads none")
        _check_tolerance("export_tolerance", self.export_tolerance, "a relative perplexity difference, e.g. 0.1 for 10%")
        _check_tolerance("export_kl_tolerance", self.export_kl_tolerance, "a mean KL in nats per token, e.g. 0.1")
        if self.accept_export_error and not self.stock:
            raise ConfigError(
                f"accept_export_error applies to the stock DeepSeek-V3 export; format {output_format!r} writes none "
                "(use --format deepseek_v3 or both, or drop --accept-export-error)"
            )

    @property
    def resolved_format(self) -> str:
        """``output_format``, or its default: "deepseek_v3" with a serve ``target``, else "kvgraft"."""
        if self.output_format is not None:
            return self.output_format
        return "deepseek_v3" if self.target is not None else "kvgraft"

    @property
    def stock(self) -> bool:
        """Whether a stock DeepSeek-V3 export is written."""
        return self.resolved_format in ("deepseek_v3", "both")

    def to_dict(self) -> dict[str, Any]:
        """The options as given, JSON-ready (tuples as lists, paths as strings); without ``resume``, which
        says how the conversion is carried out, not what it writes (a resumed conversion records what an
        uninterrupted one does)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in NOT_RECORDED:
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else str(value) if isinstance(value, Path) else value
        return out


def _check_tolerance(name: str, value: object, what: str) -> None:
    check_number(name, value, positive=True, accepted=f"a positive finite number ({what})")


def cli_options() -> list[tuple[dataclasses.Field[Any], CliOption]]:
    """The ConvertOptions fields that are on the command line, in ``kvgraft convert --help``'s order."""
    out = []
    for f in dataclasses.fields(ConvertOptions):
        cli = f.metadata["cli"]
        if cli is not None:
            out.append((f, cli))
    return out


def add_cli_options(parser: argparse.ArgumentParser) -> None:
    """Add every command-line ConvertOptions field to ``parser`` (defaults: the fields' defaults)."""
    for f, cli in cli_options():
        kwargs: dict[str, Any] = {"default": f.default}
        if cli.kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif cli.kind == "switch":
            kwargs["action"] = "store_true"
        else:
            if cli.value_type is not None:
                kwargs["type"] = cli.value_type
            if cli.kind == "list":
                kwargs["nargs"] = "+"
            if cli.choices is not None:
                kwargs["choices"] = list(cli.choices)
        if cli.help is not None:
            kwargs["help"] = cli.help
        parser.add_argument(cli.flag, **kwargs)


def options_from_cli(args: argparse.Namespace) -> dict[str, Any]:
    """``ConvertOptions``' fields from parsed ``kvgraft convert`` arguments (lists as tuples)."""
    out: dict[str, Any] = {}
    for f, cli in cli_options():
        value = getattr(args, cli.dest)
        if cli.kind == "list":
            value = tuple(value) if value else None
        out[f.name] = value
    return out


__all__ = [
    "EXPORT_KL_TOLERANCE",
    "EXPORT_TOLERANCE",
    "FORMATS",
    "OBJECTIVE_CHOICES",
    "ROPE_ROTATION_CHOICES",
    "ROPE_SELECTION_CHOICES",
    "SERVE_TARGETS",
    "STOCK_CONSTRUCTIONS",
    "TARGETS",
    "CliOption",
    "ConvertOptions",
    "add_cli_options",
    "cli_options",
    "options_from_cli",
]
