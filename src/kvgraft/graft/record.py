"""What both executors of ``kvgraft convert`` report and write last: the calibration-tail figures
(``TailFigures``, one sequence at a time), the ``conversion.json`` record (``ConversionReport``), and the
output's final files."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from kvgraft.errors import ConfigError
from kvgraft.graft.plan import ConvertPlan
from kvgraft.model import ModelConfig, Transformer

TAIL_SEQUENCES = 8  # calibration sequences (the last ones) that the reported errors are measured on


@torch.no_grad()
def tail_figures(original: Transformer, converted: Transformer, ids: torch.Tensor) -> dict[str, Any]:
    """Perplexity of the original and the converted model, and their max |logit diff|, on ``ids``: one
    sequence at a time (a tail of 8 x 512 tokens of a 128k vocabulary is 4 GB of fp64 logits per model),
    as the layer-by-layer executor computes them (``TailFigures``)."""
    device = original.embed_tokens.weight.device
    was = original.training, converted.training
    original.eval()
    converted.eval()
    tail = TailFigures(ids)
    try:
        for i in range(ids.shape[0]):
            row = ids[i : i + 1].to(device)
            tail.add(i, original(row), converted(row))
    finally:
        original.train(was[0])
        converted.train(was[1])
    return tail.record()


class TailFigures:
    """The calibration-tail figures, one sequence at a time: both perplexities (the mean next-token loss over
    every sequence) and the max |logit diff|. ``add(i, a, b)``: the original's and the converted model's logits
    (1, T, vocab) on sequence ``i`` of ``ids``, in order."""

    CHUNK = 64  # positions converted to fp64 at a time

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids.cpu()
        self.nll = [0.0, 0.0]
        self.max_diff = 0.0
        self.seen = 0

    def add(self, i: int, a: torch.Tensor, b: torch.Tensor) -> None:
        if i != self.seen:
            raise ConfigError(f"tail sequence {i} added out of order (expected {self.seen})")
        self.seen += 1
        target = self.ids[i, 1:]
        T = a.shape[1]
        for start in range(0, T, self.CHUNK):  # fp64 a chunk of positions at a time (a 128k vocabulary: 1 MB/row)
            end = min(start + self.CHUNK, T)
            a64, b64 = a[0, start:end].double().cpu(), b[0, start:end].double().cpu()
            if start < T - 1:  # the last position predicts nothing
                stop = min(end, T - 1) - start
                for k, logits in enumerate((a64, b64)):
                    self.nll[k] += float(
                        torch.nn.functional.cross_entropy(logits[:stop], target[start : start + stop], reduction="sum")
                    )
            self.max_diff = max(self.max_diff, float((a64 - b64).abs().max()))

    def record(self) -> dict[str, Any]:
        n, T = self.ids.shape
        if self.seen != n:
            raise ConfigError(f"{self.seen} of the tail's {n} sequences were added")
        count = n * (T - 1)
        ppl = [math.exp(nll / count) if count else float("nan") for nll in self.nll]
        return {
            "sequences": n,
            "seq_len": T,
            "original_perplexity": ppl[0],
            "converted_perplexity": ppl[1],
            "converted_max_abs_logit_diff_vs_original": self.max_diff,
        }


@dataclass
class ConversionReport:
    """What a conversion did: the ``conversion.json`` record, one field per key in the file's order
    (``to_dict()``). The nested figures stay as written to the file: ``graft`` (the MLA graft's settings),
    ``share_graft`` (the share graft's report), ``calibration`` and ``calibration_tail`` (the figures on the
    last calibration sequences), ``plan`` (``ConvertPlan.to_dict()``) and ``deepseek_v3`` (the stock export's
    report, only when one was written: the key is absent from the file otherwise)."""

    source: str
    to: str
    graft: dict[str, Any] | None
    ranks_chosen: list[str]
    qk_norm_linearised_for_stock_export: bool
    share_graft: dict[str, Any] | None
    kv_cache_bytes_bf16: dict[str, dict[str, int]]
    kv_bytes_per_token_bf16: dict[str, float]
    compression: float
    calibration: dict[str, Any] | None
    seconds: dict[str, float]
    parameters: dict[str, int]
    convert_seconds_per_million_params: float
    calibration_tail: dict[str, Any] | None
    serve_target: str | None
    stock_construction: str | None
    formats: list[str]
    plan: dict[str, Any]
    deepseek_v3: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record as ``conversion.json`` holds it (the nested values themselves, not copies)."""
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.deepseek_v3 is None:
            del record["deepseek_v3"]
        return record


def conversion_record(
    plan: ConvertPlan,
    converted: ModelConfig,
    *,
    share_report: dict[str, Any] | None,
    tail: dict[str, Any] | None,
    seconds: dict[str, float],
    parameters: dict[str, int],
) -> ConversionReport:
    """The report of ``plan`` executed (``converted``: the result's config; ``seconds``: "load" and
    "convert"); ``write_outputs`` adds to ``formats`` and, for a stock export, sets ``deepseek_v3``."""
    config, cal = plan.source_config, plan.calibration
    return ConversionReport(
        source=str(plan.source),
        to=plan.to,
        graft=None if plan.mla is None else asdict(plan.mla),
        ranks_chosen=list(plan.rank_notes),
        qk_norm_linearised_for_stock_export=plan.qk_norm_linearised_for_stock_export,
        share_graft=share_report,
        kv_cache_bytes_bf16={
            str(n): {"original": config.kv_cache_bytes(n, 2), "converted": converted.kv_cache_bytes(n, 2)} for n in (512, 4096)
        },
        kv_bytes_per_token_bf16={"original": config.kv_bytes_per_token(2), "converted": converted.kv_bytes_per_token(2)},
        compression=config.kv_bytes_per_token(2) / converted.kv_bytes_per_token(2),
        calibration=None if cal is None else {"sequences": cal.sequences, "seq_len": cal.seq_len, "source": cal.source},
        seconds=dict(seconds),
        parameters=dict(parameters),
        convert_seconds_per_million_params=seconds["convert"] / (parameters["original"] / 1e6),
        calibration_tail=tail,
        serve_target=plan.serve_target,
        stock_construction=plan.stock_construction if plan.stock else None,
        formats=[],
        plan=plan.to_dict(),
    )


def finish_output(plan: ConvertPlan, tmp: Path, record: ConversionReport) -> None:
    """The last files of the output directory (``tmp``, renamed into place after): the source's eval
    slices and conversion.json."""
    if (plan.source / "eval").is_dir():
        shutil.copytree(plan.source / "eval", tmp / "eval")
    (tmp / "conversion.json").write_text(json.dumps(record.to_dict(), indent=2, default=str) + "\n")


__all__ = ["TAIL_SEQUENCES", "ConversionReport", "TailFigures", "conversion_record", "finish_output", "tail_figures"]
