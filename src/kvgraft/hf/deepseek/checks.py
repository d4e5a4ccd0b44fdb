"""What stock DeepSeek-V3 cannot express, and how the export will run on MLA serving kernels.

Refused, naming what would make it possible: GQA layers left (convert all layers), per-head q/k norms
(graft with qk_norm='linearise', which convert does for this format), shared caches (--to ced), a RoPE
layout other than prefix/stride (the 'norm' and 'shared' selections repeat or scatter frequencies per
layer), non-zero MLP biases (nothing can carry them).
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch

from kvgraft.errors import UnsupportedModelError
from kvgraft.hf.deepseek.rope import prefix_rope_index, stock_rope_layout, stride_rope_index
from kvgraft.model.config import ModelConfig
from kvgraft.model.fields import known
from kvgraft.model.mla import MLAttention
from kvgraft.model.transformer import MLP, Block, Transformer

FLASH_MLA_KV_LORA_RANK = 512
FLASH_MLA_ROPE_HEAD_DIM = 64


class MLALayer(NamedTuple):
    """One decoder block of an all-MLA model, its parts typed."""

    block: Block
    attn: MLAttention
    mlp: MLP


def mla_layers(model: Transformer) -> list[MLALayer]:
    """Every decoder block with its MLA attention; ``UnsupportedModelError`` names a layer that is not MLA."""
    out = []
    for i, module in enumerate(model.layers):
        block = cast(Block, module)
        if not isinstance(block.self_attn, MLAttention):
            raise UnsupportedModelError(
                f"layer {i} runs {type(block.self_attn).__name__}, not MLA; stock DeepSeek-V3 needs MLA in every layer"
            )
        out.append(MLALayer(block, block.self_attn, block.mlp))
    return out


def config_problems(config: ModelConfig) -> list[str]:
    """What stock DeepSeek-V3 cannot express in ``config``, each naming what would make the export possible."""
    problems = []
    gqa = [i for i, k in enumerate(config.attention_kinds) if k != "mla"]
    if gqa:
        problems.append(
            f"layers {gqa} use GQA attention ({len(gqa)} of {config.num_layers}); stock DeepSeek-V3 runs MLA in "
            "every layer, so convert all layers (drop --layers; GraftConfig(layers=None)) before exporting"
        )
    if config.qk_norm:
        problems.append(
            "qk_norm (per-head q/k RMSNorm, Qwen3) has no place in stock DeepSeek-V3's attention (its only query "
            "norm, q_a_layernorm, normalises all heads together); graft with GraftConfig(qk_norm='linearise'), "
            "which kvgraft convert --format deepseek_v3 does, to export the closest model (error measured)"
        )
    if config.kv_slots != tuple(range(config.num_layers)):
        problems.append(
            f"kv_slots {config.kv_slots} share caches across layers; stock DeepSeek-V3 has one cache per layer "
            "(convert with --to mla, not --to ced)"
        )
    if not gqa and stock_rope_layout(config) is None:
        stride, prefix = stride_rope_index(config), prefix_rope_index(config)
        freq_index = known(config.rope_freq_index, "rope_freq_index")  # every layer is MLA here
        layouts = {tuple(freq_index[i]) for i in range(config.num_layers)}
        bad = [i for i in range(config.num_layers) if freq_index[i] not in (stride, prefix)] or list(
            range(1, config.num_layers)
        )  # each layer is one of the two, but not all the same one
        fix = (
            "graft with --rope-selection stride or prefix (rope_selection='stride' / 'prefix')"
            if stride is not None
            else "graft with --rope-selection prefix, or --rope-selection stride with --rope-dim set to an even divisor "
            f"of head_dim {config.head_dim}"
        )
        problems.append(
            f"the RoPE frequency layout of layers {bad} (rope_freq_index {freq_index[bad[0]]}"
            f"{'; not the same in every layer' if len(layouts) > 1 else ''}) is not one stock DeepSeek-V3 can "
            f"hold: it rotates RoPE pair j at theta'^(-2j/d_rope) in every layer, each frequency once, which is "
            f"the stride layout {stride if stride is not None else '(0, s, 2s, ...)'} at theta' = rope_theta or "
            f"the prefix layout {prefix} at theta' = rope_theta^(d_rope/head_dim) (frequency indices of "
            f"head_dim/2, d_rope = {config.qk_rope_head_dim}); {fix}"
        )
    return problems


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def weight_problems(model: Transformer) -> list[str]:
    """What stock DeepSeek-V3 cannot hold in ``model``'s weights (``mlp_bias_problems`` of its MLPs)."""
    if not model.config.mlp_bias:
        return []
    nonzero = [
        i for i, b in enumerate(model.layers) if any(has_nonzero(getattr(cast(Block, b).mlp, n).bias) for n in MLP_PROJECTIONS)
    ]
    return mlp_bias_problems(nonzero)


def mlp_bias_problems(nonzero_layers: list[int]) -> list[str]:
    """The problem of MLPs with non-zero biases (layers ``nonzero_layers``; none: no problem). The layer-by-layer
    converter checks the biases read from the checkpoint with it, ``weight_problems`` a model's."""
    if not nonzero_layers:
        return []
    return [
        f"the MLP of layers {nonzero_layers} has non-zero biases; stock DeepSeek-V3's MLP has none, and no flag "
        "can fold them (the MLP's input is RMS-normalised, with no constant component to carry a bias)"
    ]


def has_nonzero(t: torch.Tensor | None) -> bool:
    return t is not None and bool(t.detach().abs().max() > 0)


def deepseek_v3_fast_path(config: ModelConfig, original_kv_width: int | None = None) -> list[str]:
    """Warnings about how the exported model will run on MLA serving kernels (empty: nothing to say).

    FlashMLA (vLLM's and SGLang's fast DeepSeek decode kernels) is built for d_c = 512 and d_rope = 64; other
    shapes fall back to slower generic MLA paths. ``original_kv_width`` is the per-layer cache width of the
    model before grafting, 2 * num_kv_heads * head_dim (default: from ``config``, which the graft keeps).
    """
    out = []
    dc, dr = config.kv_lora_rank, config.qk_rope_head_dim
    if dc != FLASH_MLA_KV_LORA_RANK:
        out.append(
            f"kv_lora_rank (d_c) is {dc}: FlashMLA kernels need d_c = {FLASH_MLA_KV_LORA_RANK} (with d_rope = "
            f"{FLASH_MLA_ROPE_HEAD_DIM}); serving stacks will use a slower generic MLA path"
        )
    if dr != FLASH_MLA_ROPE_HEAD_DIM:
        out.append(
            f"qk_rope_head_dim (d_rope) is {dr}: FlashMLA kernels need d_rope = {FLASH_MLA_ROPE_HEAD_DIM} (with "
            f"d_c = {FLASH_MLA_KV_LORA_RANK}); serving stacks will use a slower generic MLA path"
        )
    width = original_kv_width if original_kv_width is not None else config.kv_width
    if dc is not None and dr is not None and dc + dr > width:
        out.append(
            f"the latent cache entry d_c + d_rope = {dc + dr} values per token and layer is larger than the original "
            f"GQA cache (2 x num_kv_heads x head_dim = {width}): the export uses more KV-cache memory, not less"
        )
    return out


__all__ = [
    "FLASH_MLA_KV_LORA_RANK",
    "FLASH_MLA_ROPE_HEAD_DIM",
    "MLALayer",
    "config_problems",
    "deepseek_v3_fast_path",
    "has_nonzero",
    "MLP_PROJECTIONS",
    "mla_layers",
    "mlp_bias_problems",
    "weight_problems",
]
