"""The stock checkpoint's tensors under DeepSeek-V3's names, and its config.json.

In the "transformers" construction, q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, norms, MLP, embeddings
are exact. The RoPE rows are permuted from kvgraft's rotate-half layout to DeepSeek's interleaved one (q per
head, and the shared RoPE key); a yarn ``mscale_all_dim`` softmax factor that stock applies and kvgraft does
not is folded into q_proj; a kv_b_proj bias is folded exactly (its key half adds the same amount to every
logit of a query, so softmax ignores it; its value half passes through attention, whose weights sum to one,
into the o_proj bias); a kv_a_proj bias goes to kv_a_proj_with_mqa's (``attention_bias``).
"""

from __future__ import annotations

from typing import cast

import torch

from kvgraft.hf.deepseek.checks import has_nonzero, mla_layers
from kvgraft.hf.deepseek.folds import EngineFold
from kvgraft.hf.deepseek.latent import Latent, low_rank_query
from kvgraft.model.config import ModelConfig
from kvgraft.model.mla import MLAttention
from kvgraft.model.transformer import Block, Transformer


def interleave_perm(dr: int) -> torch.Tensor:
    """Rows of a rotate-half RoPE block (pair j = rows j, j + dr/2) in DeepSeek's interleaved order (2j, 2j+1)."""
    n = dr // 2
    return torch.stack([torch.arange(n), torch.arange(n) + n], dim=1).reshape(-1)


def stock_tensors(
    model: Transformer,
    latents: list[Latent],
    q_fold: float,
    attention_bias: bool,
    low_rank_q: bool,
    folds: list[EngineFold | None] | None = None,
) -> dict[str, torch.Tensor]:
    """fp64 CPU tensors under DeepSeek-V3's names (``low_rank_q``: queries through q_a/q_a_layernorm/q_b;
    ``folds``: the engine-safe bias folds, in which case no bias tensor is written): the ends, then each
    layer's ``layer_tensors``."""

    def t(x: torch.Tensor) -> torch.Tensor:
        return x.detach().to("cpu", torch.float64)

    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": t(model.embed_tokens.weight),
        "model.norm.weight": t(model.norm.weight),
        "lm_head.weight": t(model.lm_head.weight).clone(),
    }  # untied even if tied
    for i, (block, _, _) in enumerate(mla_layers(model)):
        fold = folds[i] if folds is not None else None
        out |= layer_tensors(model.config, i, block, latents[i], q_fold, attention_bias, low_rank_q, fold)
    return out


def layer_tensors(
    cfg: ModelConfig,
    i: int,
    block: Block,
    lat: Latent,
    q_fold: float,
    attention_bias: bool,
    low_rank_q: bool,
    fold: EngineFold | None = None,
) -> dict[str, torch.Tensor]:
    """Decoder layer ``i``'s fp64 CPU tensors under DeepSeek-V3's names (``block``: its MLA block; see
    ``stock_tensors``). The whole-model export and the streamed one (``kvgraft.hf.deepseek.stream``) both
    write what this returns."""
    H, h = cfg.num_heads, cfg.hidden_size
    dc, dr, dn, dv = cfg.latent_dims()
    perm = interleave_perm(dr)
    attn, mlp = cast(MLAttention, block.self_attn), block.mlp

    def t(x: torch.Tensor) -> torch.Tensor:
        return x.detach().to("cpu", torch.float64)

    def q_rows(x: torch.Tensor) -> torch.Tensor:  # (H (dn + dr), ...) rows in stock's order, yarn fold applied
        x = x.reshape(H, dn + dr, -1) * q_fold
        return torch.cat([x[:, :dn], x[:, dn:][:, perm]], dim=1).reshape(H * (dn + dr), -1)

    out: dict[str, torch.Tensor] = {}
    p = f"model.layers.{i}."
    wq = t(attn.q_proj.weight)
    if fold is not None and fold.q_delta is not None:
        wq = wq + fold.q_delta
    q = q_rows(wq)
    if low_rank_q:
        bq = t(attn.q_proj.bias) if attn.q_proj.bias is not None else torch.zeros(q.shape[0], dtype=torch.float64)
        lr = low_rank_query(q, q_rows(bq)[:, 0], t(block.input_layernorm.weight))
        out[p + "self_attn.q_a_proj.weight"] = lr.a_weight
        out[p + "self_attn.q_a_proj.bias"] = lr.a_bias
        out[p + "self_attn.q_a_layernorm.weight"] = lr.norm
        out[p + "self_attn.q_b_proj.weight"] = lr.b_weight
    else:
        out[p + "self_attn.q_proj.weight"] = q
    a = t(attn.kv_a_proj.weight)
    if fold is not None and fold.a_delta is not None:
        a = a + fold.a_delta
    kv_a = torch.cat([lat.M @ a[:dc], a[dc:][perm]])
    kv_b = t(attn.kv_b_proj.weight) @ lat.B
    if fold is not None and fold.value is not None:  # a constant value: v unit^T, unit . n_t ~ 1
        unit = lat.unit if lat.unit is not None else lat.M.new_zeros(lat.M.shape[0])
        kv_b = kv_b.view(H, dn + dv, -1).clone()
        kv_b[:, dn:] += fold.value.view(H, dv)[:, :, None] * unit[None, None, :]
        kv_b = kv_b.reshape(H * (dn + dv), -1)
    o = t(attn.o_proj.weight)
    o_bias = t(attn.o_proj.bias) if attn.o_proj.bias is not None else torch.zeros(h, dtype=torch.float64)
    if attn.kv_b_proj.bias is not None:  # key half: softmax-invariant; value half: through to o_proj
        b_v = t(attn.kv_b_proj.bias).view(H, dn + dv)[:, dn:].reshape(-1)
        o_bias = o_bias + o @ b_v
    out[p + "self_attn.kv_a_proj_with_mqa.weight"] = kv_a
    out[p + "self_attn.kv_a_layernorm.weight"] = lat.g.clone()
    out[p + "self_attn.kv_b_proj.weight"] = kv_b
    out[p + "self_attn.o_proj.weight"] = o
    if attention_bias:
        b = t(attn.kv_a_proj.bias) if attn.kv_a_proj.bias is not None else torch.zeros(dc + dr, dtype=torch.float64)
        b_lat = lat.M @ b[:dc] + (lat.offset if lat.offset is not None else 0.0)
        out[p + "self_attn.kv_a_proj_with_mqa.bias"] = torch.cat([b_lat, b[dc:][perm]])
        out[p + "self_attn.o_proj.bias"] = o_bias
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[f"{p}mlp.{name}.weight"] = t(getattr(mlp, name).weight)
    out[p + "input_layernorm.weight"] = t(block.input_layernorm.weight)
    out[p + "post_attention_layernorm.weight"] = t(block.post_attention_layernorm.weight)
    return out


def attention_bias_needed(model: Transformer, latents: list[Latent], low_rank_q: bool) -> bool:
    layers = mla_layers(model)
    return attention_bias_needed_from(
        model.config,
        low_rank_q,
        any(lat.offset is not None for lat in latents),
        any(has_nonzero(attn.kv_a_proj.bias) for _, attn, _ in layers),
        any(has_nonzero(attn.kv_b_proj.bias) for _, attn, _ in layers),
    )


def attention_bias_needed_from(cfg: ModelConfig, low_rank_q: bool, offset: bool, kv_a_bias: bool, kv_b_bias: bool) -> bool:
    """Whether the "transformers" construction writes attention bias tensors: an o_proj bias in the config, the
    low-rank query path, a latent offset ("pad"), or a non-zero kv_a / kv_b bias in some layer."""
    return bool(cfg.o_bias or low_rank_q or offset or kv_a_bias or kv_b_bias)


def query_bias_layers(model: Transformer) -> list[int]:
    return [i for i, layer in enumerate(mla_layers(model)) if has_nonzero(layer.attn.q_proj.bias)]


def deepseek_v3_config(
    config: ModelConfig,
    rope_parameters: dict,
    attention_bias: bool,
    dtype: str,
    *,
    kv_lora_rank: int | None = None,
    q_lora_rank: int | None = None,
    export_info: dict | None = None,
) -> dict:
    """config.json of the stock checkpoint (DeepSeek's field names; MoE fields present but unused).

    ``kv_lora_rank``/``q_lora_rank``: the exported ranks when they differ from the model's ("pad" latent, a
    query bias through the low-rank query path). ``export_info`` is written as ``kvgraft_export`` (what is
    exact and up to which context; transformers keeps unknown fields as attributes, vLLM ignores them).
    """
    L = config.num_layers
    rope_scaling = None
    if rope_parameters["rope_type"] != "default":  # older readers (transformers 4, vLLM) read rope_scaling
        rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
        rope_scaling["type"] = rope_parameters["rope_type"]
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": L,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_heads,  # MLA expands keys/values per query head
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank if kv_lora_rank is None else kv_lora_rank,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": True,
        # no MoE layer: every layer < first_k_dense_replace is dense; the expert fields only need to be valid
        "first_k_dense_replace": L,
        "moe_layer_freq": 1,
        "n_routed_experts": 1,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": config.intermediate_size,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 0,  # no multi-token-prediction layer is shipped
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": rope_parameters["rope_theta"],
        "rope_parameters": rope_parameters,
        "rope_scaling": rope_scaling,
        "attention_bias": attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": config.initializer_range,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    } | ({"kvgraft_export": export_info} if export_info else {})


__all__ = [
    "attention_bias_needed",
    "attention_bias_needed_from",
    "deepseek_v3_config",
    "interleave_perm",
    "layer_tensors",
    "query_bias_layers",
    "stock_tensors",
]
