"""The stock DeepSeek-V3 export inside ``kvgraft convert`` (``--format deepseek_v3``/``both``), for both executors:
the weights it refuses (``refuse_stock_weights``) and the export with its report: ``write_stock`` from the
converted model in memory (the whole-model executor), ``write_stock_streamed`` from the converted model's
files one layer at a time (the layer-by-layer executor; ``kvgraft.hf.deepseek.stream``). Both write the same
files and report.

The gate: the export's measured distance from the kvgraft model (on the calibration tail: the relative
perplexity difference and the mean KL(kvgraft || export)) is held against the conversion's stated tolerances
(``--export-tolerance``, ``--export-kl-tolerance``; ``export_error_check``). Above either, ``ExportError`` is
raised while the output is still staged, so nothing is written (the executors' atomic directories remove
it); with ``--accept-export-error`` the export is written with a warning on stderr, at the top of its
README.md and in ``conversion.json`` (``deepseek_v3.error_check``)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

from kvgraft.errors import ExportError, UnsupportedModelError
from kvgraft.graft.plan import ConvertPlan
from kvgraft.graft.record import TAIL_SEQUENCES, ConversionReport
from kvgraft.hf.deepseek import ExportOptions, ExportReport, export_deepseek_v3
from kvgraft.hf.deepseek.stream import export_deepseek_v3_streamed
from kvgraft.hf.engines import engine_support
from kvgraft.model import ModelConfig, Transformer
from kvgraft.model.fields import known


def refuse_stock_weights(plan: ConvertPlan, problems: list[str]) -> None:
    """UnsupportedModelError naming ``problems`` (``kvgraft.hf.deepseek.weight_problems``) when there are any."""
    if problems:
        raise UnsupportedModelError(
            f"cannot export to stock DeepSeek-V3 (--format {plan.output_format}): "
            + "; ".join(problems)
            + "; use --format kvgraft"
        )


def write_stock(
    plan: ConvertPlan,
    converted: Transformer,
    calib: torch.Tensor | None,
    record: ConversionReport,
    tmp: Path,
    tok_dir: Path | None,
) -> None:
    """The stock DeepSeek-V3 export into ``tmp/deepseek_v3``, its report into ``record.deepseek_v3``."""

    report = export_deepseek_v3(
        converted,
        tmp / "deepseek_v3",
        ExportOptions(tail_sequences=TAIL_SEQUENCES, verbose=False, target=plan.stock_construction),
        tokenizer_dir=tok_dir,
        calibration=calib,
    )
    _record(plan, converted.config, report, record, tmp)


def write_stock_streamed(
    plan: ConvertPlan,
    model_dir: Path,
    config: ModelConfig,
    calib: torch.Tensor | None,
    record: ConversionReport,
    tmp: Path,
    tok_dir: Path | None,
) -> None:
    """``write_stock`` for the converted model written at ``model_dir`` (its ``config``), read one layer at a
    time: the same files and report, in memory that does not grow with depth."""
    report = export_deepseek_v3_streamed(
        model_dir,
        config,
        tmp / "deepseek_v3",
        ExportOptions(tail_sequences=TAIL_SEQUENCES, verbose=False, target=plan.stock_construction),
        tokenizer_dir=tok_dir,
        calibration=calib,
        device=plan.device,
        progress=plan.progress,
    )
    _record(plan, config, report, record, tmp)


def _record(plan: ConvertPlan, cfg: ModelConfig, report: ExportReport, record: ConversionReport, tmp: Path) -> None:
    """The export's report into ``record.deepseek_v3`` (printed with ``plan.progress``), then the gate
    (``gate_export``; the export is at ``tmp / "deepseek_v3"`` until the output is renamed into place)."""
    report.path = plan.out / "deepseek_v3"  # where it ends up, not the temporary directory
    record.formats.append("deepseek_v3")
    stock = record.deepseek_v3 = report.to_dict()
    d_c, d_rope = known(report.kv_lora_rank, "kv_lora_rank"), known(cfg.qk_rope_head_dim, "qk_rope_head_dim")
    stock_bytes = cfg.num_layers * (d_c + d_rope) * 2
    stock["kv_bytes_per_token_bf16"] = stock_bytes
    stock["compression"] = plan.source_config.kv_bytes_per_token(2) / stock_bytes
    stock["engines"] = [e.to_dict() for e in engine_support(d_c, d_rope, known(cfg.qk_nope_head_dim, "qk_nope_head_dim"))]
    if plan.progress:
        print("\n".join(report.summary()), flush=True)
        tail = record.calibration_tail
        if tail is not None:
            print(
                f"  calibration tail, against the original: perplexity {tail['original_perplexity']:.4g} "
                f"(original) -> {tail['converted_perplexity']:.4g} (converted; the export adds the error "
                f"above), max |logit diff| {tail['converted_max_abs_logit_diff_vs_original']:.3g}"
                + (
                    "; Qwen3's per-head q/k norms are replaced by their least-squares linear fits (stock "
                    "DeepSeek-V3 has no place for them)"
                    if plan.source_config.qk_norm
                    else ""
                ),
                flush=True,
            )
    stock["error_check"] = gate_export(plan, report, tmp / "deepseek_v3")


def export_error_check(report: ExportReport, tolerance: float, kl_tolerance: float) -> dict[str, Any]:
    """The export's measured distance from the kvgraft model against the tolerances (JSON-ready):
    ``relative_perplexity_difference`` (|ppl(export) / ppl(kvgraft) - 1| on ``report.measured_on``; None when
    the tail has no next-token targets), ``mean_kl`` (KL(kvgraft || export), nats per token), ``tolerance``,
    ``above`` (what exceeds its tolerance, as sentences: a figure that is not finite, or was not measured,
    exceeds it) and ``within_tolerance``."""
    above = []
    kl = report.mean_kl
    if kl is None or not math.isfinite(kl) or kl > kl_tolerance:
        shown = "not measured" if kl is None else f"{kl:.3g} nats per token"
        above.append(f"mean KL(kvgraft || export) {shown} > --export-kl-tolerance {kl_tolerance:g}")
    relative = None
    ppl = report.perplexity
    if ppl is None:
        above.append("perplexity not measured")
    elif math.isfinite(ppl["kvgraft"]) and ppl["kvgraft"] > 0:
        exported = ppl["deepseek_v3"]
        relative = abs(exported / ppl["kvgraft"] - 1) if math.isfinite(exported) else math.inf
        if relative > tolerance:
            above.append(
                f"perplexity {ppl['kvgraft']:.4g} (kvgraft) -> {exported:.4g} (export), a relative difference of "
                f"{relative:.3g} > --export-tolerance {tolerance:g}"
            )
    return {
        "relative_perplexity_difference": relative,
        "mean_kl": kl,
        "tolerance": {"relative_perplexity_difference": tolerance, "mean_kl": kl_tolerance},
        "above": above,
        "within_tolerance": not above,
    }


def gate_export(plan: ConvertPlan, report: ExportReport, written: Path) -> dict[str, Any]:
    """``export_error_check`` of ``report`` with ``plan``'s tolerances. Above them: ``ExportError`` naming the
    figures, the tolerances and the flag; with ``--accept-export-error`` the check is returned with
    ``accepted_above_tolerance`` and a ``warning``, printed to stderr and put at the top of the export's
    README.md (at ``written``, still in the output's temporary directory)."""
    o = plan.options
    check = export_error_check(report, o.export_tolerance, o.export_kl_tolerance)
    check["accepted_above_tolerance"] = False
    check["warning"] = None
    if check["within_tolerance"]:
        if plan.progress:
            relative = check["relative_perplexity_difference"]
            print(
                f"  within tolerance: relative perplexity difference "
                f"{'-' if relative is None else format(relative, '.3g')} <= {o.export_tolerance:g} "
                f"(--export-tolerance), mean KL {check['mean_kl']:.3g} <= {o.export_kl_tolerance:g} nats "
                "(--export-kl-tolerance)",
                flush=True,
            )
        return check
    what = f"on {report.measured_on}, " + "; ".join(check["above"])
    if not o.accept_export_error:
        cause = (
            "it was built to be exact, so the difference is a kvgraft defect (please report it)"
            if report.exact
            else "it is approximate (what is not exact is in its report: "
            + "; ".join(_short(a) for a in report.approximations)
            + ")"
        )
        parts = "the kvgraft model nor deepseek_v3/" if plan.output_format == "both" else "deepseek_v3/"
        raise ExportError(
            f"the stock DeepSeek-V3 export is further from the kvgraft model than the tolerance allows: {what}; "
            f"{cause}. Nothing was written to {plan.out} (neither {parts}). Pass --accept-export-error to write "
            "it anyway (marked as such in conversion.json and its README.md), allow more with --export-tolerance / "
            "--export-kl-tolerance, or use --format kvgraft for the graft alone"
            + (
                "; --stock-construction transformers is exact where the default approximates (transformers only)"
                if plan.stock_construction == "engines" and not report.exact
                else ""
            ),
            check,
        )
    warning = (
        f"This stock DeepSeek-V3 export is further from the kvgraft model it was converted from than kvgraft's "
        f"tolerance: {what}. It was written only because --accept-export-error was passed: served as it is, "
        "it is another model"
    )
    check["accepted_above_tolerance"] = True
    check["warning"] = warning
    print(f"kvgraft: WARNING: {warning}", file=sys.stderr, flush=True)
    card = written / "README.md"
    if card.is_file():  # the warning right under the card's title
        title, _, rest = card.read_text(encoding="utf-8").partition("\n")
        card.write_text(
            f"{title}\n\n> **WARNING: above kvgraft's tolerance, written with --accept-export-error.** {warning}.\n{rest}",
            encoding="utf-8",
        )
    return check


def _short(approximation: str) -> str:
    """An approximation's first clause, up to its first ": " or "; " outside parentheses (the report's sentences
    go on with the why and the alternatives)."""
    depth = 0
    for i, ch in enumerate(approximation):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and ch in ":;" and approximation[i + 1 : i + 2] == " ":
            return approximation[:i]
    return approximation


__all__ = ["export_error_check", "gate_export", "refuse_stock_weights", "write_stock", "write_stock_streamed"]
