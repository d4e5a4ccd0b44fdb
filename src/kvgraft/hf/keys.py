"""State-dict key map between transformers' Llama-family checkpoints and kvgraft's Transformer.

kvgraft's names are transformers' without the ``model.`` prefix (``lm_head.weight`` keeps its name).
Both directions check the state against the shapes the config implies: every expected key present,
every shape right, nothing left over. With tied embeddings the file carries no ``lm_head.weight``.
"""

from __future__ import annotations

import torch

from kvgraft.errors import CheckpointError
from kvgraft.model.config import ModelConfig

HF_PREFIX = "model."
LM_HEAD = "lm_head.weight"
EMBED = "embed_tokens.weight"
# Buffers old transformers versions saved; they hold no learned state and kvgraft recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """kvgraft key -> shape, computed from the config (lm_head only when not tied)."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {EMBED: (cfg.vocab_size, h), "norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes[LM_HEAD] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        writer = cfg.is_kv_writer(i)
        if cfg.attention_kinds[i] == "ced":  # causal encoder-decoder (kvgraft's own format)
            dc, dr, dn, dv, H, K = (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim,
                                    cfg.num_heads, cfg.num_kv_heads)
            attn = {"q_proj": (H * (dn + dr), h, cfg.qkv_bias), "k_proj": (K * (dn + dr), h, cfg.qkv_bias),
                    "v_proj": (K * dv, h, cfg.qkv_bias), "o_proj": (h, H * dv, cfg.o_bias)}
            if cfg.kv_source_of(i) is not None:
                attn["kv_b_proj"] = (H * (dn + dv), dc, cfg.qkv_bias)
                if cfg.index_topk:
                    attn["index_q_proj"] = (cfg.index_heads * cfg.index_head_dim, h, False)
                    attn["index_w_proj"] = (cfg.index_heads, h, False)
            if i in cfg.kv_source_layers:
                attn["compressor.kv_a_proj"] = (dc + dr, h, cfg.qkv_bias)
                if cfg.mla_latent_norm:
                    shapes[f"{p}self_attn.compressor.kv_a_norm.weight"] = (dc,)
                if cfg.index_topk:
                    attn["compressor.index_k_proj"] = (cfg.index_head_dim, h, False)
                if cfg.compress_rate > 1:
                    attn["compressor.gate_proj"] = (dc + dr, h, False)
                    shapes[f"{p}self_attn.compressor.gate_bias"] = (cfg.compress_rate, dc + dr)
        elif cfg.attention_kinds[i] == "mla":  # kvgraft's own MLA layout (see kvgraft.hf.kvgraft_format)
            dc, dr, dn, dv, H = (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim,
                                 cfg.num_heads)
            attn = {"q_proj": (H * (dn + dr), h, cfg.qkv_bias), "kv_b_proj": (H * (dn + dv), dc, cfg.qkv_bias),
                    "o_proj": (h, H * dv, cfg.o_bias)}
            if cfg.qk_norm:  # original-basis queries, per-head norm, then the per-head MLA query map
                attn["q_proj"] = (H * d, h, cfg.qkv_bias)
                shapes[f"{p}self_attn.q_norm.weight"] = (d,)
                shapes[f"{p}self_attn.q_mix"] = (H, dn + dr, d)
            if writer:
                attn["kv_a_proj"] = (dc + dr, h, cfg.qkv_bias)
                if cfg.mla_latent_norm:
                    shapes[f"{p}self_attn.kv_a_norm.weight"] = (dc,)
        else:
            attn = {"q_proj": (q, h, cfg.qkv_bias), "o_proj": (h, q, cfg.o_bias)}
            if writer:
                attn |= {"k_proj": (kv, h, cfg.qkv_bias), "v_proj": (kv, h, cfg.qkv_bias)}
        mlp = {"gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
        for name, (out_dim, in_dim, bias) in attn.items():
            shapes[f"{p}self_attn.{name}.weight"] = (out_dim, in_dim)
            if bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out_dim,)
        for name, (out_dim, in_dim) in mlp.items():
            shapes[f"{p}mlp.{name}.weight"] = (out_dim, in_dim)
            if cfg.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = (out_dim,)
        if cfg.qk_norm and cfg.attention_kinds[i] == "gqa":
            shapes[f"{p}self_attn.q_norm.weight"] = (d,)
            if writer:
                shapes[f"{p}self_attn.k_norm.weight"] = (d,)
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
    return shapes


def check_state(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], source: str) -> None:
    """Raise CheckpointError listing missing, unexpected and mis-shaped keys (names as in ``state``)."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [
        f"{k}: expected {tuple(expected[k])}, found {tuple(state[k].shape)}"
        for k in sorted(set(expected) & set(state))
        if tuple(state[k].shape) != tuple(expected[k])
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong))
    if problems:
        raise CheckpointError(f"{source} does not match its config: " + "; ".join(problems))


def _drop_tied_head(state: dict[str, torch.Tensor], embed_key: str, source: str) -> dict[str, torch.Tensor]:
    """With tied embeddings an lm_head.weight is accepted only if it equals the embedding; it is dropped."""
    head, embed = state.get(LM_HEAD), state.get(embed_key)
    if head is None:
        return state
    same = embed is not None and head.shape == embed.shape and (head is embed or torch.equal(head, embed))
    if not same:
        raise CheckpointError(
            f"{source}: tie_word_embeddings is true but {LM_HEAD} differs from {embed_key}; "
            f"expected no {LM_HEAD} or one equal to {embed_key}"
        )
    return {k: v for k, v in state.items() if k != LM_HEAD}


def _to_hf_name(key: str) -> str:
    return key if key == LM_HEAD else HF_PREFIX + key


def hf_to_kvgraft(
    state: dict[str, torch.Tensor], cfg: ModelConfig, source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """transformers names -> kvgraft names, checked against ``cfg``. Errors use the file's names."""
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        state = _drop_tied_head(state, HF_PREFIX + EMBED, source)
    expected = {_to_hf_name(k): shape for k, shape in expected_shapes(cfg).items()}
    check_state(state, expected, source)
    return {(k if k == LM_HEAD else k[len(HF_PREFIX):]): v for k, v in state.items()}


def kvgraft_to_hf(
    state: dict[str, torch.Tensor], cfg: ModelConfig, source: str = "model"
) -> dict[str, torch.Tensor]:
    """kvgraft names -> transformers names; with tied embeddings lm_head is dropped (it is the embedding)."""
    if cfg.tie_word_embeddings:
        state = _drop_tied_head(state, EMBED, source)
    check_state(state, expected_shapes(cfg), source)
    return {_to_hf_name(k): v for k, v in state.items()}
