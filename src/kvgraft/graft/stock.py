"""The stock DeepSeek-V3 export inside ``kvgraft convert`` (``--format deepseek_v3``/``both``), for both executors:
the weights it refuses (``refuse_stock_weights``) and the export with its report: ``write_stock`` from the
converted model in memory (the whole-model executor), ``write_stock_streamed`` from the converted model's
files one layer at a time (the layer-by-layer executor; ``kvgraft.hf.deepseek.stream``). Both write the same
files and report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvgraft.errors import UnsupportedModelError
from kvgraft.graft.plan import ConvertPlan
from kvgraft.graft.record import TAIL_SEQUENCES
from kvgraft.hf.deepseek import ExportReport, export_deepseek_v3
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
    plan: ConvertPlan, converted: Transformer, calib: torch.Tensor | None, record: dict[str, Any], tmp: Path, tok_dir: Path | None
) -> None:
    """The stock DeepSeek-V3 export into ``tmp/deepseek_v3``, its report into ``record["deepseek_v3"]``."""

    report = export_deepseek_v3(
        converted,
        tmp / "deepseek_v3",
        tokenizer_dir=tok_dir,
        calibration=calib,
        tail_sequences=TAIL_SEQUENCES,
        verbose=False,
        target=plan.stock_construction,
    )
    _record(plan, converted.config, report, record)


def write_stock_streamed(
    plan: ConvertPlan,
    model_dir: Path,
    config: ModelConfig,
    calib: torch.Tensor | None,
    record: dict[str, Any],
    tmp: Path,
    tok_dir: Path | None,
) -> None:
    """``write_stock`` for the converted model written at ``model_dir`` (its ``config``), read one layer at a
    time: the same files and report, in memory that does not grow with depth."""
    report = export_deepseek_v3_streamed(
        model_dir,
        config,
        tmp / "deepseek_v3",
        tokenizer_dir=tok_dir,
        calibration=calib,
        tail_sequences=TAIL_SEQUENCES,
        verbose=False,
        target=plan.stock_construction,
        device=plan.device,
        progress=plan.progress,
    )
    _record(plan, config, report, record)


def _record(plan: ConvertPlan, cfg: ModelConfig, report: ExportReport, record: dict[str, Any]) -> None:
    """The export's report into ``record["deepseek_v3"]`` (printed with ``plan.progress``)."""
    report.path = plan.out / "deepseek_v3"  # where it ends up, not the temporary directory
    record["formats"].append("deepseek_v3")
    stock = record["deepseek_v3"] = report.to_dict()
    d_c, d_rope = known(report.kv_lora_rank, "kv_lora_rank"), known(cfg.qk_rope_head_dim, "qk_rope_head_dim")
    stock_bytes = cfg.num_layers * (d_c + d_rope) * 2
    stock["kv_bytes_per_token_bf16"] = stock_bytes
    stock["compression"] = plan.source_config.kv_bytes_per_token(2) / stock_bytes
    stock["engines"] = [e.to_dict() for e in engine_support(d_c, d_rope, known(cfg.qk_nope_head_dim, "qk_nope_head_dim"))]
    if plan.progress:
        print("\n".join(report.summary()), flush=True)
        tail = record["calibration_tail"]
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


__all__ = ["refuse_stock_weights", "write_stock", "write_stock_streamed"]
