"""kvgraft's decoder-only transformer, readable top to bottom.

It reproduces the Llama family exactly (Llama, Mistral, Qwen2, Qwen3): MHA/GQA/MQA, RoPE with every
scaling kind transformers uses for them, q/k/v biases, per-head q/k RMSNorm, sliding windows, tied
embeddings, SwiGLU MLP; and kvgraft's own attention kinds, MLA (``kvgraft.model.mla``) and the causal
encoder-decoder (``kvgraft.model.ced``), in the same block. Parameter names mirror transformers' so
checkpoint surgery is a key map.

One forward, two kinds of step context (``kvgraft.model.batch``): without a cache the (B, T) batch is
attended causally (training, scoring); with the paged cache (``kvgraft.model.cache``) a
``BatchContext`` packs rows at different lengths and phases on one token axis.
Shapes: B batch, T new tokens, N packed tokens, S keys, H query heads, K kv heads, d head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kvgraft.errors import ConfigError
from kvgraft.model import cpu_kernels
from kvgraft.model.attention_ops import DECODE_MAX_NEW_TOKENS
from kvgraft.model.batch import BatchContext, DenseContext, StepContext, active_context
from kvgraft.model.cache import PagedKVCache, static_cache
from kvgraft.model.ced import CEDAttention, Compressor, rope_tables
from kvgraft.model.config import ModelConfig
from kvgraft.model.mla import MLAttention
from kvgraft.model.norm import RMSNorm
from kvgraft.model.packed import adjacent, linears, packed_weight
from kvgraft.model.rope import RotaryEmbedding, apply_rope, apply_rope_


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, f, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, f, bias=b)
        self.up_proj = nn.Linear(h, f, bias=b)
        self.down_proj = nn.Linear(f, h, bias=b)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``fused``: SwiGLU's silu and product in one pass of kvgraft's CPU kernel where it applies."""
        gate, up = linears(x, self.gate_proj, self.up_proj)  # one matmul on packed weights (kvgraft.model.packed)
        h = None
        if fused and (gate_up := adjacent(gate, up)) is not None:
            h = cpu_kernels.silu_mul(gate_up)  # contiguous, as the next matmul reads it
        if h is None:
            if gate.requires_grad or up.requires_grad:
                h = F.silu(gate) * up
            else:  # inference: in place, no temporaries
                h = F.silu(gate, inplace=True).mul_(up)
        y: torch.Tensor = self.down_proj(h)
        return y


class GQAttention(nn.Module):
    """Grouped-query attention (MHA when K == H, MQA when K == 1), the Llama-family attention."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.window = config.window(layer)
        self.writes_kv = config.is_kv_writer(layer)
        source = config.kv_source_of(layer)
        if source is None:
            raise ConfigError(f"layer {layer}: a GQA layer reads the KV of a layer at or before it")
        self.source = source  # the layer that stores what this one reads
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x (B, N, h), cos/sin (B, N, d) -> (B, N, h)."""
        B, N, _ = x.shape
        H, K, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.writes_kv:  # one matmul on packed weights (kvgraft.model.packed)
            q, k, v = linears(x, self.q_proj, self.k_proj, self.v_proj)
        else:
            q = self.q_proj(x)
        fused = ctx.cache is not None  # a cached (engine) step: one-pass CPU kernels where they apply
        entry = None
        joined = adjacent(q, k, v) if fused and self.writes_kv and not self.qk_norm and not q.requires_grad else None
        if joined is not None:  # q and k rotated where the projection wrote them; the new entries are a view
            qk = joined[..., : (H + K) * d].view(B, N, H + K, d).transpose(1, 2)  # (B, H + K, N, d)
            q = apply_rope_(qk, cos, sin, fused)[:, :H]  # (B, H, N, d)
            entry = joined[..., H * d :]  # (B, N, 2 K d): k then v of each token
        else:
            q = q.view(B, N, H, d)
            if self.qk_norm:
                q = self.q_norm(q)
            q = apply_rope(q.transpose(1, 2), cos, sin, fused)  # (B, H, N, d)
        if self.writes_kv and entry is None:
            k = k.view(B, N, K, d)
            if self.qk_norm:
                k = self.k_norm(k)
            k = apply_rope(k.transpose(1, 2), cos, sin, fused).transpose(1, 2)  # (B, N, K, d)
            entry = torch.cat([k.reshape(B, N, K * d), v], dim=-1)  # (B, N, 2 K d)
        # a cached step on the CPU: every row at once through the rows' block tables, where the kernel applies
        heads = ctx.attend_rows(self.source, q[0].transpose(0, 1), entry, self.window, d**-0.5) if fused else None
        if heads is not None:
            out: torch.Tensor = self.o_proj(heads)
            return out
        for gi, g in ctx.each_group():  # every group's attention output (B, N, H d): one o_proj over the step's tokens
            qg = q if g.tok is None else g.take(q.transpose(1, 2)).transpose(1, 2)  # (G, H, T, d)
            view = ctx.kv(self.source, gi, None if entry is None else g.take(entry))

            def mask(kpos: torch.Tensor, gi: int = gi) -> torch.Tensor:
                return ctx.window_mask(gi, kpos, self.window, "kv")

            causal = ctx.cache is None and ctx.default_positions and (self.window is None or self.window >= g.T)
            decode = ctx.cache is not None and g.T <= DECODE_MAX_NEW_TOKENS
            y = view.attend_heads(qg, K, self.window, mask, causal, decode)  # (G, H, T, d)
            y = y.transpose(1, 2).reshape(y.shape[0], g.T, H * d)  # a view when the heads are token-major
            if heads is None and (g.tok is None or g.span == (0, N)):  # one group over every token: the step's output
                heads = y.view(B, N, H * d)
            else:
                heads = g.put(heads if heads is not None else x.new_empty(B, N, H * d), y)
        if heads is None:
            raise ConfigError("a step context has at least one group")
        out = self.o_proj(heads)
        return out


ATTENTION_CLASSES: dict[str, type[nn.Module]] = {"gqa": GQAttention, "mla": MLAttention, "ced": CEDAttention}


class Block(nn.Module):
    """One layer of any attention kind: pre-norm attention then pre-norm SwiGLU MLP."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = ATTENTION_CLASSES[config.attention_kinds[layer]](config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        fused = ctx.cache is not None  # a cached (engine) step: one-pass CPU kernels where they apply
        if fused and isinstance(ctx, BatchContext) and (whole := self._one_call(x, cos, sin, ctx)) is not None:
            return whole
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(self.input_layernorm(x, fused), cos, sin, ctx), fused)
        y: torch.Tensor = x + self.mlp(h, fused)
        return y

    def _one_call(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: BatchContext) -> torch.Tensor | None:
        """This layer of an engine step in one call of kvgraft's CPU kernels (``cpu_kernels.gqa_layer``: the kernels
        and matmuls of the code above, in its order, bit-identical), where it applies: a GQA layer writing its own
        pool, no q/k norms, every linear layer packed as is (no adapter wrapping it), a step planned for one call
        over its rows, float32 on the CPU. None otherwise (the code above runs)."""
        attn, mlp = self.self_attn, self.mlp
        if type(attn) is not GQAttention or not attn.writes_kv or attn.qk_norm or type(mlp) is not MLP:
            return None
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if norms[0].eps != norms[1].eps:
            return None
        step = ctx.layer_step(attn.source, cos, sin)  # a writer's own slot
        if step is None:
            return None
        packed = (
            packed_weight(attn.q_proj, attn.k_proj, attn.v_proj),
            packed_weight(attn.o_proj),
            packed_weight(mlp.gate_proj, mlp.up_proj),
            packed_weight(mlp.down_proj),
        )
        weights = []
        for pw in packed:
            if pw is None:
                return None
            weights += [pw[0], _NO_BIAS if pw[1] is None else pw[1]]
        return cpu_kernels.gqa_layer(
            x,
            weights,
            [norms[0].weight, norms[1].weight],
            norms[0].eps,
            step[0],
            (attn.num_heads, attn.num_kv_heads),
            attn.window,
            step[1],
        )


_NO_BIAS = torch.empty(0)  # cpu_kernels.gqa_layer's "no bias"


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
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

    def first_trainable_layer(self) -> int:
        """Index of the first layer with a parameter that requires grad (0 when the embedding trains;
        ``num_layers`` when no layer does)."""
        if self.embed_tokens.weight.requires_grad:
            return 0
        for i, block in enumerate(self.layers):
            if any(p.requires_grad for p in block.parameters()):
                return i
        return len(self.layers)

    def new_cache(
        self, batch_size: int, max_len: int, dtype: torch.dtype | None = None, block_size: int | None = None
    ) -> PagedKVCache:
        """A paged cache holding ``batch_size`` sequences of up to ``max_len`` tokens, already added:
        ``model(ids (batch_size, T), cache=cache)`` extends every one of them by T tokens."""
        p = self.embed_tokens.weight
        return static_cache(self.config, batch_size, max_len, dtype or p.dtype, p.device, block_size)[0]

    @torch.no_grad()
    def replay(self, hidden: torch.Tensor, ctx: BatchContext, from_layer: int) -> None:
        """Run layers ``from_layer``.. again over the last tokens of ``ctx``'s rows (a ``replay=True``
        context), starting from the hidden states entering ``from_layer`` at those positions ((1, N, h) or
        (N, h), packed like the rows): rebuilds those layers' window rings, writes nothing else.

        Which positions a replay needs (``kvgraft.runtime.prefix.replay_span``): to rebuild the rings of
        layers ``from_layer``..L-1 at a prefix of T tokens, the last ``W + (L - 1 - from_layer) (W - 1)``."""
        if not getattr(ctx, "replay", False):
            raise ConfigError("replay needs a BatchContext(..., replay=True)")
        if not 0 <= from_layer < len(self.layers):
            raise ConfigError(f"from_layer ({from_layer}) must be in [0, {len(self.layers)})")
        split = ctx.cache.ring_split
        if split is not None and from_layer < split:
            raise ConfigError(
                f"from_layer ({from_layer}) is below the cache's ring split ({split}): a replay rebuilds "
                "the decoder's rings only; the encoder's are shared between sequences"
            )
        x = hidden.reshape(1, ctx.num_tokens, -1)
        cos, sin = self.rotary(ctx.positions, x.dtype)
        if self.config.is_ced:
            cos, sin = rope_tables(self.config, cos, sin)
        with active_context(ctx):
            for block in self.layers[from_layer:]:
                x = block(x, cos, sin, ctx)

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T); with ctx: (1, N) or (N,) packed rows
        cache: PagedKVCache | None = None,
        positions: torch.Tensor | None = None,  # (B, T) cache-free only; default 0..T-1
        last_only: bool = False,
        ctx: BatchContext | None = None,
    ) -> torch.Tensor:
        """Logits. Cache-free: (B, T, vocab). With ``cache`` (every live sequence adds T tokens): (B, T,
        vocab). With ``ctx``: (1, N, vocab). ``last_only``: only each row's last token ((B, 1, vocab),
        or (1, rows, vocab) with ``ctx``). A cached forward commits its tokens to the cache."""
        rows = None
        step: StepContext  # ctx, or the cache-free batch's
        if cache is not None:
            if ctx is not None or positions is not None:
                raise ConfigError("give either cache (every sequence adds T tokens) or ctx, and no positions with a cache")
            rows, T = input_ids.shape
            seqs = cache.sequences
            if len(seqs) != rows:
                raise ConfigError(f"input_ids has {rows} rows but the cache holds {len(seqs)} sequences")
            ctx = BatchContext(cache, seqs, [T] * rows)
            input_ids = input_ids.reshape(1, rows * T)
        if ctx is not None:
            if positions is not None:
                raise ConfigError("positions come from the batch context; do not pass them with ctx")
            input_ids = input_ids.reshape(1, -1)
            if input_ids.shape[1] != ctx.num_tokens:
                raise ConfigError(f"{input_ids.shape[1]} tokens given for a step of {ctx.num_tokens}")
            step_positions = ctx.positions
            step = ctx
        else:
            B, T = input_ids.shape
            default = positions is None
            step_positions = torch.arange(T, device=input_ids.device).expand(B, T) if positions is None else positions
            m = self.config.compress_rate if self.config.is_ced else 1
            step = DenseContext(step_positions, default, m)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(step_positions, x.dtype)
        if self.config.is_ced:
            cos, sin = rope_tables(self.config, cos, sin)
        # Backward stops at the first trainable layer: the layers below it run without autograd and keep
        # no activations (a decoder-side adapter trains through the decoder only), checkpointing or not.
        first = self.first_trainable_layer() if torch.is_grad_enabled() else 0
        with active_context(step):  # adapter layers read the step's rows from it (kvgraft.model.batch)
            capture = ctx.capture_layer if ctx is not None else None
            for i, block in enumerate(self.layers):
                if ctx is not None and i == capture:
                    ctx.captured = x
                if i < first:
                    with torch.no_grad():
                        x = block(x, cos, sin, step)
                elif self.gradient_checkpointing and self.training and step.cache is None:
                    x = checkpoint(block, x, cos, sin, step, use_reentrant=False)
                else:
                    x = block(x, cos, sin, step)
        aux = step.scratch.get("aux")
        # the indexers' training loss (None without one); the training loop adds it to the step's loss
        self.aux_loss = torch.stack(aux).sum() if aux else None
        if ctx is not None:
            ctx.commit()
        if last_only:
            x = x[:, -1:] if ctx is None else x[:, ctx.last_index]
        logits: torch.Tensor = self.lm_head(self.norm(x, ctx is not None and ctx.cache is not None))
        if rows is not None:  # the (B, T) convenience call
            logits = logits.view(rows, -1, logits.shape[-1])
        return logits
