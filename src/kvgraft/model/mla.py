"""Multi-head latent attention (DeepSeek-V2/V3) with a latent cache and absorbed decode.

Per token a layer caches one vector: the latent ``c = kv_a(x)[:d_c]`` (optionally RMS-normalised)
followed by the shared RoPE key ``k_r = RoPE(kv_a(x)[d_c:])``, d_c + d_rope values in all.
Keys and values are recovered per head by the up-projection ``kv_b``:
``k_i = [W_UK,i c ; k_r]``, ``v_i = W_UV,i c``.

The attention math over latents (expanded and absorbed paths, weights read through one door) is
``kvgraft.model.latent.LatentAttention``, shared with the causal encoder-decoder. This module adds MLA's
own projections and, for inference decode, folds of W_UK into the query projection and W_UV into the
output projection where they save FLOPs (rebuilt whenever a weight, or an adapter's delta, changes; a few
folds are kept, one per adapter of a mixed-adapter batch).

RoPE pairs use the rotate-half layout over d_rope; pair ``j`` rotates at the model's base frequency
``rope_freq_index[j]`` (so a conversion can keep any subset of the original frequencies).
Shapes: B batch, T new tokens, S cached + new tokens, H heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvgraft.errors import ConfigError
from kvgraft.model.attention_ops import DECODE_MAX_NEW_TOKENS, sdpa
from kvgraft.model.config import ModelConfig
from kvgraft.model.latent import LatentAttention
from kvgraft.model.norm import RMSNorm
from kvgraft.model.rope import apply_rope
from kvgraft.model.views import KVView, MaskOf

if TYPE_CHECKING:
    from kvgraft.model.batch import StepContext  # typing only: batch imports the attention modules

ABSORB_MODES = ("auto", "always", "never")
# "auto" absorbs when a cached step adds at most DECODE_MAX_NEW_TOKENS tokens per row (decode); longer
# steps (prefill) and cache-free forwards expand, which costs less when the prompt is long.


# (q weight, q bias, o weight, o bias) with W_UK / W_UV folded in; None where that fold does not pay
Folds = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


class MLAttention(LatentAttention):
    kv_a_norm: RMSNorm | None

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.dc, self.dr, self.dn, self.dv = config.latent_dims()
        self.writes_kv = config.is_kv_writer(layer)
        source = config.kv_source_of(layer)
        if source is None:
            raise ConfigError(f"layer {layer}: an MLA layer reads the KV of a layer at or before it")
        self.source = source  # the layer that stores what this one reads
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
        if config.rope_freq_index is None:
            raise ConfigError(f"layer {layer} is an MLA layer but the config has no rope_freq_index")
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
        # folds by the weights they came from: one entry per adapter a mixed-adapter batch decodes with
        # (the adapter registry raises fold_cache_size to the number of loaded adapters + 1)
        self._folded: dict[tuple[object, ...], tuple[list[torch.Tensor], Folds]] = {}
        self.fold_cache_size = 2

    def latent_entry(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> the cache entry (B, T, d_c + d_rope): latent then rotated RoPE key."""
        ckv = self.kv_a_proj(x)
        c, k_rope = torch.split(ckv, [self.dc, self.dr], dim=-1)
        if self.kv_a_norm is not None:
            c = self.kv_a_norm(c)
        k_rope = apply_rope(k_rope[:, None], cos, sin)[:, 0]  # (B, T, dr)
        return torch.cat([c, k_rope], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x (B, N, h) -> (B, N, h); cos/sin (B, N, head_dim) tables; ``ctx`` a step context."""
        cos, sin = cos[..., self.rope_cols], sin[..., self.rope_cols]  # (B, N, dr)
        entry = self.latent_entry(x, cos, sin) if self.writes_kv else None
        out = None
        for gi, g in ctx.each_group():
            xg, cg, sg = g.take(x), g.take(cos), g.take(sin)
            view = ctx.kv(self.source, gi, None if entry is None else g.take(entry))  # (G, S, dc + dr) entries

            def mask(kpos: torch.Tensor, gi: int = gi) -> torch.Tensor:
                return ctx.window_mask(gi, kpos, self.window, "kv")

            absorbed = self._absorbed(g.T, ctx)
            if absorbed and not torch.is_grad_enabled():
                y = self._decode_folded(xg, cg, sg, view, mask)
            else:
                entries, kpos = view.entries()
                plain = ctx.cache is None and ctx.default_positions and (self.window is None or self.window >= g.T)
                q_nope, q_rope = self._query(xg, cg, sg)
                q = torch.cat([q_nope, q_rope], dim=-1)
                if plain and not absorbed:  # cache-free causal prefill: SDPA's causal kernel
                    yh = self._attend_causal(q, entries)
                else:
                    yh = self.attend(q, None, None, entries, mask(kpos), absorbed)
                G, H, T, _ = yh.shape
                y = self.o_proj(yh.transpose(1, 2).reshape(G, T, H * self.dv))
            out = g.put(out if out is not None else x.new_empty(*x.shape[:2], y.shape[-1]), y)
        if out is None:
            raise ConfigError("a step context has at least one group")
        return out

    def _attend_causal(self, q: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        G, H, T, _ = q.shape
        c, k_rope = torch.split(entries, [self.dc, self.dr], dim=-1)
        w, b = self.weights("kv_b_proj")
        kv = F.linear(c, w, b).view(G, T, H, self.dn + self.dv).transpose(1, 2)
        k = torch.cat([kv[..., : self.dn], k_rope[:, None].expand(G, H, T, self.dr)], dim=-1)
        return sdpa(q, k, kv[..., self.dn :], is_causal=T > 1, scale=self.scale)  # (the CPU's fused kernel)

    def _query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H, T, dn) no-RoPE and (B, H, T, dr) rotated RoPE parts of the query."""
        B, T, _ = x.shape
        H = self.num_heads
        wq, bq = self.weights("q_proj")
        if self.qk_norm:
            q = self.q_norm(F.linear(x, wq, bq).view(B, T, H, -1))  # (B, T, H, d)
            q = torch.einsum("bthd,hed->bhte", q, self.q_mix)  # (B, H, T, dn + dr)
        else:
            q = self.q_proj(x).view(B, T, H, self.dn + self.dr).transpose(1, 2)  # (B, H, T, dn + dr)
        q_nope, q_rope = torch.split(q, [self.dn, self.dr], dim=-1)
        return q_nope, apply_rope(q_rope, cos, sin)

    def _absorbed(self, t: int, ctx: StepContext) -> bool:
        if self.absorb == "always":
            return True
        if self.absorb == "never":
            return False
        return ctx.cache is not None and t <= DECODE_MAX_NEW_TOKENS

    def _folded_weights(self) -> Folds:
        """(q weight, q bias, o weight, o bias) with W_UK / W_UV folded in, rebuilt when weights change."""
        wq, bq = self.weights("q_proj")
        wkv, bkv = self.weights("kv_b_proj")
        wo, bo = self.weights("o_proj")
        params = [wq, wkv, wo] + ([self.q_mix] if self.qk_norm else []) + [b for b in (bq, bkv, bo) if b is not None]
        # keyed by identity and version; an entry keeps its tensors alive, so an id is never reused under it
        key = tuple((id(p), -1 if p.is_inference() else p._version, p.dtype) for p in params)
        hit = self._folded.pop(key, None)
        if hit is not None and all(a is b for a, b in zip(hit[0], params)):
            self._folded[key] = hit  # most recently used last
            return hit[1]
        H, dc, dn, dr = self.num_heads, self.dc, self.dn, self.dr
        w_uk, w_uv, _, b_v = self.split_kv_b()
        q_w: torch.Tensor | None = None
        q_b: torch.Tensor | None = None
        o_w: torch.Tensor | None = None
        o_b: torch.Tensor | None = None
        if self.fold_q:
            if self.qk_norm:  # fold into the per-head map after the query norm
                mix = self.q_mix
                q_w = torch.cat([torch.einsum("hnc,hnd->hcd", w_uk, mix[:, :dn]), mix[:, dn:]], dim=1)
            else:
                wq3 = wq.view(H, dn + dr, -1)
                q_w = torch.cat([torch.einsum("hnc,hni->hci", w_uk, wq3[:, :dn]), wq3[:, dn:]], dim=1)
                q_w = q_w.reshape(H * (dc + dr), -1)
                if bq is not None:
                    bq2 = bq.view(H, dn + dr)
                    q_b = torch.cat([torch.einsum("hnc,hn->hc", w_uk, bq2[:, :dn]), bq2[:, dn:]], dim=1).reshape(-1)
        if self.fold_o:
            wo3 = wo.view(-1, H, self.dv)  # (h, H, dv)
            o_w = torch.einsum("ohv,hvc->ohc", wo3, w_uv).reshape(wo3.shape[0], H * dc)
            o_b = bo
            if b_v is not None:
                extra = torch.einsum("ohv,hv->o", wo3, b_v)
                o_b = extra if o_b is None else o_b + extra
        while len(self._folded) >= max(1, self.fold_cache_size):
            self._folded.pop(next(iter(self._folded)))  # least recently used
        self._folded[key] = (params, (q_w, q_b, o_w, o_b))
        return q_w, q_b, o_w, o_b

    def _decode_folded(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, view: KVView, mask: MaskOf) -> torch.Tensor:
        """Absorbed decode with the up-projections folded into the query and output projections:
        x (G, T, h) over the latent entries ``view`` holds (mask: their visibility) -> (G, T, h)."""
        B, T, _ = x.shape
        H, dc = self.num_heads, self.dc
        q_w, q_b, o_w, o_b = self._folded_weights()
        if q_w is None:
            q_nope, q_rope = self._query(x, cos, sin)
            q_lat = torch.einsum("bhtn,hnc->bhtc", q_nope, self.split_kv_b()[0])
        else:
            if self.qk_norm:
                wq, bq = self.weights("q_proj")
                q = torch.einsum("bthd,hed->bhte", self.q_norm(F.linear(x, wq, bq).view(B, T, H, -1)), q_w)
            else:
                q = F.linear(x, q_w, q_b).view(B, T, H, dc + self.dr).transpose(1, 2)
            q_lat, q_rope = torch.split(q, [dc, self.dr], dim=-1)
            q_rope = apply_rope(q_rope, cos, sin)
        q = torch.cat([q_lat, q_rope], dim=-1)  # (B, H, T, dc + dr)
        y_lat = view.attend_latent(q, dc, self.window, self.scale, mask)  # (B, H, T, dc)
        if o_w is not None:
            return F.linear(y_lat.transpose(1, 2).reshape(B, T, H * dc), o_w, o_b)
        _, w_uv, _, b_v = self.split_kv_b()
        y = torch.einsum("bhtc,hvc->bhtv", y_lat, w_uv)
        if b_v is not None:
            y = y + b_v[None, :, None, :]
        out: torch.Tensor = self.o_proj(y.transpose(1, 2).reshape(B, T, H * self.dv))
        return out
