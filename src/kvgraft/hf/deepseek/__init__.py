"""Export an all-MLA kvgraft model as a stock DeepSeek-V3 checkpoint (``model_type: deepseek_v3``).

The directory loads with unmodified ``transformers.AutoModelForCausalLM.from_pretrained`` (no remote code) and
uses DeepSeek's own tensor names, so vLLM and SGLang read it as DeepSeek's checkpoints: dense SwiGLU MLPs only
(``first_k_dense_replace = num_hidden_layers``, no MoE, no MTP), ``q_lora_rank: null``, ``num_key_value_heads =
num_attention_heads``, ``rope_interleave: true``.

Two constructions (``target``): "engines" (the default) writes nothing vLLM or SGLang drop or overflow (no
attention bias, weights within fp16, the latent norm fitted, biases folded: ``EngineFold``), its error measured;
"transformers" writes the exact constructions, which only transformers computes as written (a warning says so).

``docs/export.md`` has what is exact per family and what each engine loads. One concept per module;
imports run one way (rope <- checks <- folds <- tensors <- export; latent <- tensors, export; measure <- export):

- ``rope``: the RoPE layouts stock can hold ('prefix', 'stride') and their scaling (yarn) re-expressed;
  ``checks``: what stock cannot express (refused, naming the fix) and the serving kernels' fast path.
- ``latent``: the latent RMSNorm constructions (exact, "pad", "fit" with ``fit_latent_metric``, "scale")
  and the low-rank query path that carries a query bias.
- ``folds``: the engine-safe bias folds; ``tensors``: the tensors under DeepSeek-V3's names and config.json.
- ``export``: ``export_deepseek_v3``, its ``ExportReport`` and card; ``measure``: the export loaded with stock
  transformers and measured against the kvgraft model.
- by their own paths, not from this package: ``stream`` (``export_deepseek_v3_streamed``, the same export one
  layer at a time, what ``kvgraft convert`` uses) and ``adapters`` (a LoRA adapter carried to the export).
"""

from __future__ import annotations

from kvgraft.hf.deepseek.checks import (
    FLASH_MLA_KV_LORA_RANK,
    FLASH_MLA_ROPE_HEAD_DIM,
    config_problems,
    deepseek_v3_fast_path,
    has_nonzero,
    weight_problems,
)
from kvgraft.hf.deepseek.export import FP16_MAX, STOCK_TARGETS, ExportOptions, ExportReport, export_card, export_deepseek_v3
from kvgraft.hf.deepseek.folds import EngineFold, collect_input_moments, engine_folds
from kvgraft.hf.deepseek.latent import (
    ENGINE_LATENT_RMS,
    LATENT_NORM_STRATEGIES,
    PIN_DELTA,
    STOCK_LATENT_NORM_EPS,
    Latent,
    LowRankQuery,
    approx_latent,
    collect_latents,
    exact_latent,
    fit_latent_metric,
    latent_unit,
    low_rank_query,
    pad_latent,
)
from kvgraft.hf.deepseek.measure import load_stock, measure_export, measure_export_error, perplexity
from kvgraft.hf.deepseek.rope import (
    STOCK_ROPE_LAYOUTS,
    prefix_rope_index,
    stock_rope_layout,
    stock_rope_parameters,
    stride_rope_index,
)
from kvgraft.hf.deepseek.tensors import (
    attention_bias_needed,
    deepseek_v3_config,
    interleave_perm,
    query_bias_layers,
    stock_tensors,
)

__all__ = [
    "ENGINE_LATENT_RMS",
    "FLASH_MLA_KV_LORA_RANK",
    "FLASH_MLA_ROPE_HEAD_DIM",
    "FP16_MAX",
    "LATENT_NORM_STRATEGIES",
    "PIN_DELTA",
    "STOCK_LATENT_NORM_EPS",
    "STOCK_ROPE_LAYOUTS",
    "STOCK_TARGETS",
    "EngineFold",
    "ExportOptions",
    "ExportReport",
    "Latent",
    "LowRankQuery",
    "approx_latent",
    "attention_bias_needed",
    "collect_input_moments",
    "collect_latents",
    "config_problems",
    "deepseek_v3_config",
    "deepseek_v3_fast_path",
    "engine_folds",
    "exact_latent",
    "export_card",
    "export_deepseek_v3",
    "fit_latent_metric",
    "has_nonzero",
    "interleave_perm",
    "latent_unit",
    "load_stock",
    "low_rank_query",
    "measure_export",
    "measure_export_error",
    "pad_latent",
    "perplexity",
    "prefix_rope_index",
    "query_bias_layers",
    "stock_rope_layout",
    "stock_rope_parameters",
    "stock_tensors",
    "stride_rope_index",
    "weight_problems",
]
