"""``kvgraft convert``: a checkpoint directory in, an MLA-grafted (``--to mla``) or causal encoder-decoder
(``--to ced``: MLA graft with one RoPE layout, then the share graft of ``kvgraft.graft.ced``) directory out.

``convert(model, out, options)`` is ``execute(plan_conversion(model, out, options))``: the plan
(``kvgraft.graft.plan``) checks and decides everything before the weights load; ``execute`` does the work.
Both targets run layer by layer (``kvgraft.graft.layerwise``: one decoder layer in memory at a time, the
output written as layers finish; ``--to ced`` with the share graft's walk of ``kvgraft.graft.ced_layerwise``);
the stock DeepSeek-V3 export (``--format deepseek_v3``/``both``) then reads the converted model's shards one
layer at a time too (``kvgraft.hf.deepseek.stream``). The whole-model executor (``execute_whole``) loads the
whole source model; it is the reference the layer-by-layer one is tested against.

The output directory is written atomically: it appears complete or not at all. The layer-by-layer executor
stages it in ``.<out>.partial`` with a checkpoint after each layer, which a conversion interrupted after its
first layer leaves behind for ``--resume`` (``kvgraft.graft.resume``); the whole-model executor leaves nothing.
A stock export measured above its tolerance (``--export-tolerance``, ``--export-kl-tolerance``) fails the
conversion before the rename, in both executors: nothing is left, not even the kvgraft part of ``--format
both`` or the staging directory (the checkpoint is dropped once the walk is done, before the export).
The output is itself the converted model in kvgraft's own format (``model_type: kvgraft``; ``kvgraft eval
OUT`` works), plus ``conversion.json`` (``kvgraft.graft.record.ConversionReport``: what was done, with
timings, and the plan), the tokenizer and the eval slices of the input when it has them, and, with
``--format deepseek_v3`` or ``both``, a stock DeepSeek-V3 export in ``deepseek_v3/`` (``kvgraft.hf.deepseek``;
what is exact for each family: ``docs/export.md``). For that format the graft keeps one latent value for the
export's constant coordinate (its exact latent norm), linearises Qwen3's q/k norms, and the export's report
(exactness, measured error and calibration-tail perplexities) is printed and recorded in ``conversion.json``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from kvgraft.atomic import atomic_dir
from kvgraft.errors import ConfigError
from kvgraft.graft.calibration import calibration_ids
from kvgraft.graft.ced import graft_ced
from kvgraft.graft.ced_layerwise import execute_layerwise_ced
from kvgraft.graft.layerwise import execute_layerwise
from kvgraft.graft.mla import graft_mla
from kvgraft.graft.options import ConvertOptions
from kvgraft.graft.plan import ConvertPlan, plan_conversion
from kvgraft.graft.ranks import default_ranks
from kvgraft.graft.record import TAIL_SEQUENCES, ConversionReport, conversion_record, finish_output, tail_figures
from kvgraft.graft.stock import refuse_stock_weights, write_stock
from kvgraft.hf import load_pretrained, save_pretrained
from kvgraft.hf.deepseek import weight_problems
from kvgraft.model import ModelConfig, Transformer


def ranks_for_compression(config: ModelConfig, compression: float, qk_rope_head_dim: int) -> int:
    """d_c such that each layer caches KV width / compression values (d_c + d_rope), rounded down
    (``kvgraft.graft.ranks.default_ranks`` with d_rope given)."""
    return default_ranks(config, compression=compression, qk_rope_head_dim=qk_rope_head_dim).kv_lora_rank


def convert(model: str | Path | None, out: str | Path, options: ConvertOptions | None = None) -> ConversionReport:
    """Convert ``model`` (a local checkpoint directory) to MLA and write it to ``out``.

    Ranks not given come from the one rule of ``kvgraft.graft.ranks.default_ranks`` (shared with ``doctor``):
    the budget is KV width / ``compression`` values per layer (default 4x; or an explicit ``kv_lora_rank``),
    d_rope the largest even width <= min(64, head_dim, budget/2) (for the stock format's default prefix
    layout also <= 3/4 head_dim; a divisor of head_dim with --rope-selection stride), d_c the rest. Every
    argument (and the output path, device and calibration file) is checked before the weights are loaded;
    weights with NaN/Inf are refused, naming the tensor.
    Defaults (objective "attention", layer-wise, RoPE expectation, rope_selection "auto" = "norm", or
    "prefix" when a stock DeepSeek-V3 export is asked for) are the best of ``bench/mla_oneshot.py`` and
    ``bench/mla_ood.py``. ``rope_rotation`` (None: "complex" for ``to="mla"``, "real" for ``to="ced"``): how the
    KV heads' RoPE pairs are mixed per frequency before the kept ones are chosen (``GraftConfig``); the complex
    mix (each kept pair the best rank-1 complex fit of the heads' pairs) measured far better in both formats.
    ``device`` holds the model and the calibration activations (e.g. "cuda" for a 7B model); the
    per-layer factorisations run on the CPU in fp64. Returns the ``ConversionReport`` written to ``conversion.json``.
    ``options``: a :class:`kvgraft.graft.options.ConvertOptions` (None: its defaults), whose fields are:

    ``output_format`` (None: "deepseek_v3" with ``target``, else "kvgraft"). ``stock_construction``: how the
    stock DeepSeek-V3 export is written (``export_deepseek_v3``'s ``target``): "engines" (default: no attention
    bias tensors, fp16-safe weights, the latent norm fitted; what vLLM and SGLang compute as transformers
    does) or "transformers" (the exact bias constructions, which only transformers computes; the graft then
    keeps d_c - 1 so the constant latent coordinate stays within the budget). ``target="vllm"``: the stock
    export shaped for vLLM's CPU backends and FlashMLA-class kernels, d_c = 512 and d_rope = 64; refused,
    saying why, when the model's KV width or head_dim cannot take it (``kvgraft.hf.engines.vllm_shape_problem``).
    ``export_tolerance`` / ``export_kl_tolerance``: how far the stock export may measure from the kvgraft model
    on the calibration tail (relative perplexity difference; mean KL(kvgraft || export) in nats per token);
    above either, ``kvgraft.errors.ExportError`` and nothing is written, unless ``accept_export_error`` (then
    written with a warning in the log, the export's README.md and ``conversion.json``; ``kvgraft.graft.stock``).

    ``to="ced"`` makes a causal encoder-decoder: ``kv_source_layers`` (default: pivot at the middle layer,
    see ``default_kv_sources``), ``sliding_window`` and ``compress_rate`` as in ModelConfig. A Llama-family
    input is first grafted to MLA with one RoPE layout for all layers (rope_selection "shared": the
    frequencies with the largest measured contribution over all layers, or "stride"; d_c from
    ``compression``, default 2 since several layers read each shared latent); an all-MLA input with one
    layout is used as it is. Readers are fitted by least squares on the calibration tokens.
    ``compression`` defaults to 4 for MLA.
    """
    return execute(plan_conversion(model, out, options))


EXECUTORS = ("auto", "layerwise", "whole")


def execute(plan: ConvertPlan, executor: str = "auto") -> ConversionReport:
    """Do the conversion ``plan`` describes and write ``plan.out`` atomically; return the ``conversion.json``
    record (``kvgraft.graft.record.ConversionReport``). Raises ``kvgraft.errors`` errors for weights the plan could not check (NaN/Inf, naming the
    tensor; what a stock export cannot hold), before any work.

    ``executor``: "layerwise" (``kvgraft.graft.layerwise.execute_layerwise``: the source read one decoder
    layer at a time, memory that does not grow with depth) or "whole" (``execute_whole``: the whole source
    model loaded in fp32 and grafted in memory, the converted model built beside it). "auto" (default) is
    "layerwise" for every plan: ``--to mla`` in every format (a stock DeepSeek-V3 export, ``--format
    deepseek_v3`` or ``both``, then streamed from the converted model's shards one layer at a time) and ``--to ced`` (``kvgraft.graft.ced_layerwise``: the MLA graft and the share graft in
    one walk, one kv_source layer's calibration latents held at a time). Both executors write the same
    files (tensors bit for bit) and the same record apart from timings."""
    if executor not in EXECUTORS:
        raise ConfigError(f"executor {executor!r} is not one of {', '.join(EXECUTORS)}")
    calib = None if plan.calibration is None else calibration_ids(plan.source, plan.calibration, plan.source_config.vocab_size)
    if executor == "whole":
        return execute_whole(plan, calib)
    if plan.to == "ced":
        return execute_layerwise_ced(plan, calib)
    return execute_layerwise(plan, calib)


def layerwise_applies(plan: ConvertPlan) -> bool:
    """Whether the layer-by-layer executor can do ``plan``: every plan (``--to mla`` in any format, ``--to ced``)."""
    return plan.to in ("mla", "ced")


def execute_whole(plan: ConvertPlan, calib: torch.Tensor | None) -> ConversionReport:
    """The whole-model executor: the source is loaded once (fp32) and grafted in memory, the converted model
    built beside it. Each step is a function of the plan (and of what the steps before it made)."""
    t0 = time.perf_counter()
    original = load_source(plan)
    t_load = time.perf_counter() - t0
    t1 = time.perf_counter()
    converted, share_report, refinement = graft(plan, original, calib)
    t_convert = time.perf_counter() - t1
    parameters = {"original": _parameters(original), "converted": _parameters(converted)}
    tail = None  # the calibration tail: what the stock export's error is measured on too
    if calib is not None:
        tail = tail_figures(original, converted, calib[-TAIL_SEQUENCES:])
        if refinement is not None:
            tail["refinement"] = refinement
    del original  # a 7B model should not be held twice while writing
    record = conversion_record(
        plan,
        converted.config,
        share_report=share_report,
        tail=tail,
        seconds={"load": t_load, "convert": t_convert},
        parameters=parameters,
    )
    write_outputs(plan, converted, calib, record)
    return record


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def load_source(plan: ConvertPlan) -> Transformer:
    """The source model in fp32 on ``plan.device``; refuses NaN/Inf weights (naming the tensor) and, for a
    stock export, weights stock DeepSeek-V3 cannot hold."""

    original = load_pretrained(plan.source, dtype=torch.float32, device=plan.device)
    if plan.stock:
        refuse_stock_weights(plan, weight_problems(original))
    return original


def graft(
    plan: ConvertPlan, original: Transformer, calib: torch.Tensor | None
) -> tuple[Transformer, dict[str, Any] | None, dict[str, Any] | None]:
    """(converted model, share-graft report or None, local refinement's record or None): the MLA graft (unless
    the source is all-MLA already), then for ``to == "ced"`` the share graft. ``original`` is left untouched."""
    refinement: dict[str, Any] = {}
    converted = (
        original if plan.mla is None else graft_mla(original, plan.mla, calib, progress=plan.progress, refinement=refinement)
    )
    if plan.ced is None:
        return converted, None, refinement or None

    if calib is None:  # ConvertPlan refuses this; said again for the type checker
        raise ConfigError("the share graft needs calibration tokens")
    if plan.mla is not None:
        plan.ced.check_against(converted.config)
    ced, report = graft_ced(converted, plan.ced, calib, progress=plan.progress)
    return ced, report, refinement or None


def write_outputs(plan: ConvertPlan, converted: Transformer, calib: torch.Tensor | None, record: ConversionReport) -> None:
    """Write ``plan.out`` atomically: the kvgraft-format model and/or the stock DeepSeek-V3 export (whose
    report is added to ``record`` and printed with ``plan.progress``), the eval slices, conversion.json."""

    with atomic_dir(plan.out, overwrite=plan.overwrite) as tmp:
        tok_dir = plan.source if plan.has_tokenizer else None
        if plan.output_format in ("kvgraft", "both"):  # the output directory itself is the kvgraft model
            save_pretrained(converted, tmp, tokenizer_dir=tok_dir, model_type="kvgraft", overwrite=True)
            record.formats.append("kvgraft")
        if plan.stock:
            write_stock(plan, converted, calib, record, tmp, tok_dir)
        finish_output(plan, tmp, record)


__all__ = [
    "EXECUTORS",
    "convert",
    "execute",
    "execute_whole",
    "graft",
    "layerwise_applies",
    "load_source",
    "ranks_for_compression",
    "write_outputs",
]
