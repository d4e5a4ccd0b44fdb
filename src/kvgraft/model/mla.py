"""Multi-head latent attention (DeepSeek-V2/V3) with a latent cache and absorbed decode.

Per token a layer caches one vector: the latent ``c = kv_a(x)[:d_c]`` (optionally RMS-normalised)
followed by the shared RoPE key ``k_r = RoPE(kv_a(x)[d_c:])``, d_c + d_rope values in all.
Keys and values are recovered per head by the up-projection ``kv_b``:
``k_i = [W_UK,i c ; k_r]``, ``v_i = W_UV,i c``.

Two equivalent paths (tested to agree):
- expanded: up-project the whole cache, then ordinary attention (cheap for long prefills);
- absorbed: fold W_UK into the query (``q_lat,i = W_UK,i^T q_nope,i``) and apply W_UV after attention,
  so the step attends over the latent cache directly, as multi-query attention with one key/value
  head of width d_c + d_rope (values: the latent part). Cheap for decode: nothing is expanded.

RoPE pairs use the rotate-half layout over d_rope; pair ``j`` rotates at the model's base frequency
``rope_freq_index[j]`` (so a conversion can keep any subset of the original frequencies).
Shapes: B batch, T new tokens, S cached + new tokens, H heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvgraft.model.attention_ops import DECODE_MAX_NEW_TOKENS, grouped_attention
from kvgraft.model.config import ModelConfig
from kvgraft.model.norm import RMSNorm
from kvgraft.model.rope import apply_rope

ABSORB_MODES = ("auto", "always", "never")
# "auto" absorbs when a step adds at most DECODE_MAX_NEW_TOKENS to a KVCache (decode); longer steps
# (prefill) expand, which costs less when the prompt is long.


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.dc, self.dr = config.kv_lora_rank, config.qk_rope_head_dim
        self.dn, self.dv = config.qk_nope_head_dim, config.v_head_dim
        self.writes_kv = config.is_kv_writer(layer)
        self.window = config.window(layer)
        h, H = config.hidden_size, config.num_heads
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            # Qwen3-style: q_proj keeps the original per-head queries (head_dim d), q_norm normalises
            # each head, then a per-head map q_mix (H, d_nope + d_rope, d) forms the MLA query.
            d = config.head_dim
            self.q_proj = nn.Linear(h, H * d, bias=config.qkv_bias)
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.q_mix = nn.Parameter(torch.empty(H, self.dn + self.dr, d))
        else:
            self.q_proj = nn.Linear(h, H * (self.dn + self.dr), bias=config.qkv_bias)
        if self.writes_kv:
            self.kv_a_proj = nn.Linear(h, self.dc + self.dr, bias=config.qkv_bias)
            self.kv_a_norm = RMSNorm(self.dc, config.rms_norm_eps) if config.mla_latent_norm else None
        self.kv_b_proj = nn.Linear(self.dc, H * (self.dn + self.dv), bias=config.qkv_bias)
        self.o_proj = nn.Linear(H * self.dv, h, bias=config.o_bias)
        idx = list(config.rope_freq_index[layer])
        # columns of the model's (B, T, head_dim) cos/sin tables that this layer's RoPE pairs use
        # (a plain list, not a buffer: it is config, and must survive meta-device construction)
        self.rope_cols = idx + [i + config.head_dim // 2 for i in idx]
        self.scale = (self.dn + self.dr) ** -0.5
        self.absorb = "auto"
        # Inference-time folds (decode): W_UK into the query projection and W_UV into the output
        # projection, each only where it does not add FLOPs (true when d_c <= head widths; DeepSeek's
        # d_c = 512 with 128-wide heads keeps them apart).
        q_in = config.head_dim if self.qk_norm else h
        self.fold_q = q_in * self.dc <= q_in * self.dn + self.dn * self.dc
        self.fold_o = self.dc * h <= self.dc * self.dv + self.dv * h
        self._folded: tuple | None = None

    def latent_entry(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> the cache entry (B, 1, T, d_c + d_rope): latent then rotated RoPE key."""
        ckv = self.kv_a_proj(x)
        c, k_rope = ckv.split([self.dc, self.dr], dim=-1)
        if self.kv_a_norm is not None:
            c = self.kv_a_norm(c)
        k_rope = apply_rope(k_rope[:, None], cos, sin)  # (B, 1, T, dr)
        return torch.cat([c[:, None], k_rope], dim=-1)

    def forward(self, x, cos, sin, mask, kv) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.num_heads
        cos, sin = cos[..., self.rope_cols], sin[..., self.rope_cols]  # (B, T, dr)
        if self.writes_kv:
            (entry,) = kv.write(self.layer, self.latent_entry(x, cos, sin))  # (B, 1, S, dc + dr)
        else:
            (entry,) = kv.read(self.layer, T)
        absorbed = self._absorbed(T, kv)
        if absorbed and not torch.is_grad_enabled():
            return self._decode_folded(x, cos, sin, entry, mask)
        q_nope, q_rope = self._query(x, cos, sin)
        if absorbed:
            y = self._attend_absorbed(q_nope, q_rope, entry, mask)
        else:
            y = self._attend_expanded(q_nope, q_rope, entry, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * self.dv))

    def _query(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H, T, dn) no-RoPE and (B, H, T, dr) rotated RoPE parts of the query."""
        B, T, _ = x.shape
        H = self.num_heads
        if self.qk_norm:
            q = self.q_norm(self.q_proj(x).view(B, T, H, -1))  # (B, T, H, d)
            q = torch.einsum("bthd,hed->bhte", q, self.q_mix)  # (B, H, T, dn + dr)
        else:
            q = self.q_proj(x).view(B, T, H, self.dn + self.dr).transpose(1, 2)  # (B, H, T, dn + dr)
        q_nope, q_rope = q.split([self.dn, self.dr], dim=-1)
        return q_nope, apply_rope(q_rope, cos, sin)

    def _absorbed(self, t: int, kv) -> bool:
        from kvgraft.model.cache import KVCache

        if self.absorb == "always":
            return True
        if self.absorb == "never":
            return False
        return isinstance(kv, KVCache) and t <= DECODE_MAX_NEW_TOKENS

    def _split_kv_b(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.dc)
        b = self.kv_b_proj.bias
        b_v = None if b is None else b.view(self.num_heads, self.dn + self.dv)[:, self.dn:]
        return w[:, : self.dn], w[:, self.dn:], b_v  # W_UK (H, dn, dc), W_UV (H, dv, dc), b_v (H, dv)

    def _attend_expanded(self, q_nope, q_rope, entry, mask) -> torch.Tensor:
        B, H, T, _ = q_nope.shape
        S = entry.shape[-2]
        c, k_rope = entry[:, 0].split([self.dc, self.dr], dim=-1)  # (B, S, dc), (B, S, dr)
        kv = self.kv_b_proj(c).view(B, S, H, self.dn + self.dv).transpose(1, 2)  # (B, H, S, dn + dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(B, H, S, self.dr)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                              scale=self.scale)

    def _folded_weights(self) -> tuple:
        """(q weight, q bias, o weight, o bias) with W_UK / W_UV folded in, rebuilt when weights change."""
        params = [self.q_proj.weight, self.kv_b_proj.weight, self.o_proj.weight]
        params += [self.q_mix] if self.qk_norm else []
        params += [b for b in (self.q_proj.bias, self.kv_b_proj.bias, self.o_proj.bias) if b is not None]
        key = tuple((p.data_ptr(), p._version, p.dtype) for p in params)
        if self._folded is not None and self._folded[0] == key:
            return self._folded[1]
        H, dc, dn, dr = self.num_heads, self.dc, self.dn, self.dr
        w_uk, w_uv, b_v = self._split_kv_b()
        q_w = q_b = o_w = o_b = None
        if self.fold_q:
            if self.qk_norm:  # fold into the per-head map after the query norm
                mix = self.q_mix
                q_w = torch.cat([torch.einsum("hnc,hnd->hcd", w_uk, mix[:, :dn]), mix[:, dn:]], dim=1)
            else:
                wq = self.q_proj.weight.view(H, dn + dr, -1)
                q_w = torch.cat([torch.einsum("hnc,hni->hci", w_uk, wq[:, :dn]), wq[:, dn:]], dim=1)
                q_w = q_w.reshape(H * (dc + dr), -1)
                if self.q_proj.bias is not None:
                    bq = self.q_proj.bias.view(H, dn + dr)
                    q_b = torch.cat([torch.einsum("hnc,hn->hc", w_uk, bq[:, :dn]), bq[:, dn:]], dim=1).reshape(-1)
        if self.fold_o:
            wo = self.o_proj.weight.view(-1, H, self.dv)  # (h, H, dv)
            o_w = torch.einsum("ohv,hvc->ohc", wo, w_uv).reshape(wo.shape[0], H * dc)
            o_b = self.o_proj.bias
            if b_v is not None:
                extra = torch.einsum("ohv,hv->o", wo, b_v)
                o_b = extra if o_b is None else o_b + extra
        self._folded = (key, (q_w, q_b, o_w, o_b))
        return self._folded[1]

    def _decode_folded(self, x, cos, sin, entry, mask) -> torch.Tensor:
        """Absorbed decode with the up-projections folded into the query and output projections."""
        B, T, _ = x.shape
        H, dc = self.num_heads, self.dc
        q_w, q_b, o_w, o_b = self._folded_weights()
        if q_w is None:
            q_nope, q_rope = self._query(x, cos, sin)
            q_lat = torch.einsum("bhtn,hnc->bhtc", q_nope, self._split_kv_b()[0])
        else:
            if self.qk_norm:
                q = torch.einsum("bthd,hed->bhte", self.q_norm(self.q_proj(x).view(B, T, H, -1)), q_w)
            else:
                q = F.linear(x, q_w, q_b).view(B, T, H, dc + self.dr).transpose(1, 2)
            q_lat, q_rope = q.split([dc, self.dr], dim=-1)
            q_rope = apply_rope(q_rope, cos, sin)
        q = torch.cat([q_lat, q_rope], dim=-1)  # (B, H, T, dc + dr)
        if mask is None and T > 1:
            mask = torch.ones(T, entry.shape[-2], dtype=torch.bool, device=q.device).tril(entry.shape[-2] - T)
        y_lat = grouped_attention(q, entry, entry[..., :dc], mask, self.scale)  # (B, H, T, dc)
        if o_w is not None:
            return F.linear(y_lat.transpose(1, 2).reshape(B, T, H * dc), o_w, o_b)
        w_uv, b_v = self._split_kv_b()[1:]
        y = torch.einsum("bhtc,hvc->bhtv", y_lat, w_uv)
        if b_v is not None:
            y = y + b_v[None, :, None, :]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * self.dv))

    def _attend_absorbed(self, q_nope, q_rope, entry, mask) -> torch.Tensor:
        w_uk, w_uv, b_v = self._split_kv_b()
        # The key bias of kv_b adds q_nope . b_k to every key's logit alike: softmax ignores it.
        q_lat = torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk)  # (B, H, T, dc)
        q = torch.cat([q_lat, q_rope], dim=-1)  # (B, H, T, dc + dr)
        # One key/value head shared by all query heads (MQA over the latent cache): the values are the
        # latent part of each entry, read in place.
        if mask is None and q.shape[2] > 1:
            T, S = q.shape[2], entry.shape[-2]
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        y_lat = grouped_attention(q, entry, entry[..., : self.dc], mask, self.scale)  # (B, H, T, dc)
        y = torch.einsum("bhtc,hvc->bhtv", y_lat, w_uv)  # (B, H, T, dv)
        if b_v is not None:  # softmax weights sum to one, so the value bias passes straight through
            y = y + b_v[None, :, None, :]
        return y
