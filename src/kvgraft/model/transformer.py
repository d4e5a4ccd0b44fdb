"""kvgraft's decoder-only transformer, readable top to bottom.

It reproduces the Llama family exactly (Llama, Mistral, Qwen2, Qwen3): MHA/GQA/MQA, RoPE with every
scaling kind transformers uses for them, q/k/v biases, per-head q/k RMSNorm, sliding windows, tied
embeddings, SwiGLU MLP. Parameter names mirror transformers' so checkpoint surgery is a key map.

Shapes: B batch, T new tokens, S cached + new tokens, H query heads, K kv heads, d head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kvgraft.model.attention_ops import DECODE_MAX_NEW_TOKENS, grouped_attention
from kvgraft.model.cache import EphemeralKV, KVCache
from kvgraft.model.ced import CEDAttention, Compressor, ced_step, rope_tables, use_absorbed
from kvgraft.model.ced_cache import CEDCache
from kvgraft.model.config import ModelConfig
from kvgraft.model.mla import MLAttention
from kvgraft.model.norm import RMSNorm
from kvgraft.model.rope import RotaryEmbedding, apply_rope


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, f, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, f, bias=b)
        self.up_proj = nn.Linear(h, f, bias=b)
        self.down_proj = nn.Linear(f, h, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GQAttention(nn.Module):
    """Grouped-query attention (MHA when K == H, MQA when K == 1), the Llama-family attention."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.window = config.window(layer)
        self.writes_kv = config.is_kv_writer(layer)
        h, H, K, d = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(h, H * d, bias=config.qkv_bias)
        if self.writes_kv:  # a layer that only reads a shared slot has no K/V projections
            self.k_proj = nn.Linear(h, K * d, bias=config.qkv_bias)
            self.v_proj = nn.Linear(h, K * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(H * d, h, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            if self.writes_kv:
                self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(
        self,
        x: torch.Tensor,  # (B, T, h)
        cos: torch.Tensor,  # (B, T, d)
        sin: torch.Tensor,
        mask: torch.Tensor | None,  # (T, S) bool, True = attend; None = plain causal
        kv: KVCache | EphemeralKV,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, d)
        if self.writes_kv:
            k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
            if self.qk_norm:
                k = self.k_norm(k)
            k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, K, T, d)
            v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
            k, v = kv.write(self.layer, k, v)  # (B, K, S, d)
        else:
            k, v = kv.read(self.layer, T)
        if isinstance(kv, KVCache) and T <= DECODE_MAX_NEW_TOKENS:
            y = grouped_attention(q, k, v, mask, self.head_dim**-0.5)  # decode step
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )  # (B, H, T, d)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


ATTENTION_CLASSES: dict[str, type[nn.Module]] = {"gqa": GQAttention, "mla": MLAttention}


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = ATTENTION_CLASSES[config.attention_kinds[layer]](config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, kv):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class CEDBlock(nn.Module):
    """A causal encoder-decoder layer: carries the shared compressed KV to the next layer."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = CEDAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, shared, cos, sin, step, cache=None):
        a, shared, aux = self.self_attn(self.input_layernorm(x), cos, sin, shared, step, cache)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), shared, aux


def attention_mask(q_start: int, t: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(T, S) bool mask for queries at positions q_start..q_start+T-1 over keys 0..S-1, S = q_start+T.

    A query at i sees key j iff j <= i and, with a window W, i - j < W (transformers' convention).
    """
    q = torch.arange(q_start, q_start + t, device=device)[:, None]
    k = torch.arange(q_start + t, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= (q - k) < window
    return allowed


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        block = CEDBlock if config.is_ced else Block
        self.layers = nn.ModuleList(block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.aux_loss: torch.Tensor | None = None  # set by a forward whose layers have a training loss

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Random init for pretraining: normal(0, initializer_range) weights, zero biases, unit norms."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                w = torch.empty(module.weight.shape).normal_(0.0, std, generator=gen)
                module.weight.copy_(w)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            if isinstance(module, Compressor) and module.m > 1:
                module.gate_bias.zero_()
            if isinstance(module, MLAttention) and module.qk_norm:
                d = module.q_mix.shape[-1]
                module.q_mix.copy_(torch.empty(module.q_mix.shape).normal_(0.0, d**-0.5, generator=gen))

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache | CEDCache:
        """Allocate the preallocated KV cache this model's layers write and read."""
        p = self.embed_tokens.weight
        if self.config.is_ced:
            return CEDCache(self.config, batch_size, max_len, dtype or p.dtype, p.device)
        return KVCache(self.config, batch_size, max_len, dtype or p.dtype, p.device)

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T)
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,  # (B, T); default: cache.length + arange(T)
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits (B, T, vocab), or (B, 1, vocab) with ``last_only``. Advances ``cache`` by T."""
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        if self.config.is_ced:
            x = self._ced_layers(x, cos, sin, cache)
            if last_only:
                x = x[:, -1:]
            return self.lm_head(self.norm(x))
        masks: dict[int | None, torch.Tensor | None] = {}
        for layer in range(self.config.num_layers):
            w = self.config.window(layer)
            if w not in masks:
                # None means "no mask needed": causal over T == S tokens, or one new token seeing
                # every cached key (attention modules use is_causal only when T > 1)
                plain_causal = cache is None and (w is None or w >= T)
                one_token_full = T == 1 and (w is None or w >= start + 1)
                masks[w] = None if plain_causal or one_token_full else attention_mask(start, T, w, x.device)
        kv = cache if cache is not None else EphemeralKV(self.config)
        for layer, block in enumerate(self.layers):
            mask = masks[self.config.window(layer)]
            if self.gradient_checkpointing and self.training and cache is None:
                x = checkpoint(block, x, cos, sin, mask, kv, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask, kv)
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))

    def _ced_layers(self, x, cos, sin, cache: CEDCache | None) -> torch.Tensor:
        """The causal encoder-decoder's layers. Without a cache the shared entries pass from layer to
        layer as an explicit argument, so a checkpointed layer recomputes with the entries it read."""
        T = x.shape[1]
        start = cache.length if cache is not None else 0
        if cache is not None:
            cache.begin(T)
        step = ced_step(self.config, start, T, cache.ring_len if cache is not None else 0, x.device,
                        use_absorbed(cache, T))
        cos, sin = rope_tables(self.config, cos, sin)
        shared, losses = None, []
        for block in self.layers:
            if self.gradient_checkpointing and self.training and cache is None:
                x, shared, aux = checkpoint(block, x, shared, cos, sin, step, use_reentrant=False)
            else:
                x, shared, aux = block(x, shared, cos, sin, step, cache)
            if aux is not None:
                losses.append(aux)
        # the indexers' training loss (None without one); the training loop adds it to the step's loss
        self.aux_loss = torch.stack(losses).sum() if losses else None
        if cache is not None:
            cache.advance(T)
        return x
