"""The causal encoder-decoder: cross-layer shared compressed KV plus a sliding window per layer.

kvgraft's small, faithful version of DeepSeek-V4.1-Flash's attention layout (MISSION.md, Part B).

- ``kv_source_layers`` (the last is the *pivot*, the first decoder layer) each own a *compressor*:
  ``kv_a`` turns the hidden state entering the layer into an MLA-style entry per token, a latent
  ``c`` (d_c) and a RoPE key ``k_r`` (d_rope, rotated at the token's position). With compression
  rate m > 1, each shared entry pools m consecutive tokens (block b = tokens [b*m, (b+1)*m)) with a
  learned gated weighting: per channel, softmax over the block of ``gate_proj(x) + gate_bias[t % m]``.
- Every layer attends, in one softmax, over (a) its own sliding window of the last W tokens' keys and
  values (``k_proj``/``v_proj`` of its own hidden state, ``num_kv_heads`` heads, d_nope + d_rope wide
  keys, RoPE on the last d_rope) and (b) the shared entries written by the nearest kv_source layer at or
  before it, read through its own up-projection ``kv_b`` (keys ``[W_UK c ; k_r]``, values ``W_UV c``).
  Layers before the first kv_source layer read only their window.
- Causality: a query at position i reads its window (tokens ``i - W < j <= i``) and, through the shared
  path, block b once the block's first token has left the window, ``b * m <= i - W``. With ``W >= m``
  (validated) such a block is complete strictly before i, so nothing after i is ever visible, and every
  earlier token is seen: in the window or in a block. Blocks straddling the window's edge are seen both
  ways (at most m - 1 tokens); with m = 1 window and shared path partition the past exactly, which is what
  lets a graft keep each layer's own keys for the recent tokens and approximate only the distant ones.
- Optional indexer (``index_topk``, off by default): each reading layer scores the visible shared entries
  with a small multi-head scorer against a key the compressor adds to every entry, and attends to the
  top-k only. top-k passes no gradient, so the indexer is trained by its own loss: KL from the layer's
  dense attention over the visible entries to the indexer's softmax, on a detached input, added to the
  training loss by the loop (``Transformer.aux_loss``). Off, every visible entry is attended.

The shared entries are the cross-layer state. Training passes them from layer to layer explicitly, so
activation checkpointing recomputes a layer with exactly the entries it read the first time (and the
gradient reaches the compressor that wrote them). With a cache (``CEDCache``, the one owner) they live
in the cache. Shapes: B batch, T new tokens, N shared entries, H heads, K window heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvgraft.model.attention_ops import DECODE_MAX_NEW_TOKENS
from kvgraft.model.config import ModelConfig
from kvgraft.model.norm import RMSNorm
from kvgraft.model.rope import apply_rope


@dataclass
class CEDStep:
    """Geometry of one forward step, shared by every layer: which keys each new query may see."""

    start: int  # tokens already in the cache (0 without one)
    new_tokens: int
    window_mask: torch.Tensor  # (T, Sw) bool over the window keys a layer attends (see ced_step)
    mask: torch.Tensor  # (T, Sw + N) bool: the window mask, then the N shared entries after this step
    absorbed: bool  # decode: attend over the latent directly (no expansion)
    ring_only: bool  # one-token cache step: the new token is written to the ring first, keys = the ring


def ced_step(config: ModelConfig, start: int, t: int, ring_len: int, device: torch.device,
             absorbed: bool) -> CEDStep:
    """Masks for queries at positions start..start+t-1.

    Without a cache (``ring_len == 0``) the window keys are the t new tokens. With one, a one-token step
    writes the token into the ring first and attends over the ring alone (slot j then holds the latest
    position p <= start with p % W == j); a longer step attends over [ring as it was ; new tokens]
    (slot j holds the latest p < start). Slots never written hold a negative position and are masked.
    """
    W, m = config.sliding_window, config.compress_rate
    qpos = torch.arange(start, start + t, device=device)
    ring_only = ring_len > 0 and t == 1
    if ring_len:
        slot = torch.arange(ring_len, device=device)
        last = start if ring_only else start - 1  # the latest position the ring holds
        ring_pos = last - ((last - slot) % W)
        ring_pos = torch.where(ring_pos >= 0, ring_pos, torch.full_like(ring_pos, -(10**9)))
        kpos = ring_pos if ring_only else torch.cat([ring_pos, qpos])
    else:
        kpos = qpos
    window_mask = (kpos[None, :] <= qpos[:, None]) & (qpos[:, None] - kpos[None, :] < W)
    n_blocks = (start + t) // m
    # block b (tokens b*m .. b*m+m-1) is read through the shared path once its first token has left
    # the window: b*m <= i - W. With W >= m that block is complete strictly before i.
    block_start = torch.arange(n_blocks, device=device) * m
    shared_mask = block_start[None, :] <= qpos[:, None] - W
    return CEDStep(start, t, window_mask, torch.cat([window_mask, shared_mask], dim=1), absorbed, ring_only)


class Compressor(nn.Module):
    """A kv_source layer's KV writer: hidden state -> shared entries (latent ; rotated RoPE key)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, b = config.hidden_size, config.qkv_bias
        self.dc, self.dr, self.m = config.kv_lora_rank, config.qk_rope_head_dim, config.compress_rate
        self.kv_a_proj = nn.Linear(h, self.dc + self.dr, bias=b)
        self.kv_a_norm = RMSNorm(self.dc, config.rms_norm_eps) if config.mla_latent_norm else None
        if self.m > 1:
            self.gate_proj = nn.Linear(h, self.dc + self.dr, bias=False)
            self.gate_bias = nn.Parameter(torch.zeros(self.m, self.dc + self.dr))
        self.di = config.index_head_dim if config.index_topk else 0
        if self.di:  # the indexer's key per entry (appended to the entry, pooled by the block mean)
            self.index_k_proj = nn.Linear(h, self.di, bias=False)

    def token_entries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> per-token entries (B, T, d_c + d_rope [+ index_head_dim]); cos/sin: the d_rope columns."""
        c, k_rope = self.kv_a_proj(x).split([self.dc, self.dr], dim=-1)
        if self.kv_a_norm is not None:
            c = self.kv_a_norm(c)
        parts = [c, apply_rope(k_rope[:, None], cos, sin)[:, 0]]
        if self.di:  # a detached input: the indexer's loss trains the indexer, nothing else
            parts.append(self.index_k_proj(x.detach()))
        return torch.cat(parts, dim=-1)

    def gate_scores(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """(B, T, h) -> pooling logits (B, T, d_c + d_rope) for tokens at start..start+T-1."""
        phase = torch.arange(start, start + x.shape[1], device=x.device) % self.m
        return self.gate_proj(x) + self.gate_bias[phase]

    def pool(self, entries: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        """(B, n*m, E) block-aligned tokens -> (B, n, E) pooled entries (identity when m == 1): the gated
        weighting for latent and RoPE key, the plain mean for the indexer's key."""
        if self.m == 1:
            return entries
        B, n, E = entries.shape[0], entries.shape[1] // self.m, entries.shape[2]
        D = self.dc + self.dr
        blocks = entries.view(B, n, self.m, E)
        w = torch.softmax(scores.float().view(B, n, self.m, D), dim=2).to(entries.dtype)
        pooled = (w * blocks[..., :D]).sum(dim=2)
        if self.di:
            pooled = torch.cat([pooled, blocks[..., D:].mean(dim=2)], dim=-1)
        return pooled

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Whole sequences from position 0 (training): (B, S, h) -> (B, S // m, D); the incomplete last
        block is dropped (no query of this sequence can see it)."""
        n = x.shape[1] // self.m * self.m
        entries = self.token_entries(x[:, :n], cos[:, :n], sin[:, :n])
        return self.pool(entries, self.gate_scores(x[:, :n], 0) if self.m > 1 else None)


class CEDAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        h, H, K, b = config.hidden_size, config.num_heads, config.num_kv_heads, config.qkv_bias
        self.num_heads, self.num_kv_heads = H, K
        self.dc, self.dr = config.kv_lora_rank, config.qk_rope_head_dim
        self.dn, self.dv = config.qk_nope_head_dim, config.v_head_dim
        self.q_proj = nn.Linear(h, H * (self.dn + self.dr), bias=b)
        self.k_proj = nn.Linear(h, K * (self.dn + self.dr), bias=b)  # window keys (own hidden state)
        self.v_proj = nn.Linear(h, K * self.dv, bias=b)
        self.o_proj = nn.Linear(H * self.dv, h, bias=config.o_bias)
        self.source = config.kv_source_of(layer)  # nearest kv_source layer at or before this one
        self.is_source = self.source == layer
        if self.is_source:
            self.compressor = Compressor(config)
        if self.source is not None:
            self.kv_b_proj = nn.Linear(self.dc, H * (self.dn + self.dv), bias=b)
        self.topk = config.index_topk if self.source is not None else None
        if self.topk:
            self.index_heads, self.di = config.index_heads, config.index_head_dim
            self.index_q_proj = nn.Linear(h, self.index_heads * self.di, bias=False)
            self.index_w_proj = nn.Linear(h, self.index_heads, bias=False)
        self.scale = (self.dn + self.dr) ** -0.5

    # ---- projections ----------------------------------------------------------------------------
    def _qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.dv).transpose(1, 2)
        q = torch.cat([q[..., : self.dn], apply_rope(q[..., self.dn:], cos, sin)], dim=-1)
        k = torch.cat([k[..., : self.dn], apply_rope(k[..., self.dn:], cos, sin)], dim=-1)
        return q, k, v  # (B, H, T, dn+dr), (B, K, T, dn+dr), (B, K, T, dv)

    def _split_kv_b(self):
        w = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.dc)
        bias = self.kv_b_proj.bias
        bk = bv = None
        if bias is not None:
            bias = bias.view(self.num_heads, self.dn + self.dv)
            bk, bv = bias[:, : self.dn], bias[:, self.dn:]
        return w[:, : self.dn], w[:, self.dn:], bk, bv  # W_UK (H,dn,dc), W_UV (H,dv,dc), (H,dn), (H,dv)

    # ---- attention ------------------------------------------------------------------------------
    def _attend_expanded(self, q, k, v, shared, mask: torch.Tensor) -> torch.Tensor:
        """Up-project the shared latent per head and run one SDPA over [window ; shared]."""
        B, H = q.shape[0], self.num_heads
        k = k.repeat_interleave(H // self.num_kv_heads, dim=1)
        v = v.repeat_interleave(H // self.num_kv_heads, dim=1)
        if shared is not None:
            N = shared.shape[1]
            c, k_rope = shared[..., : self.dc], shared[..., self.dc:self.dc + self.dr]
            kv = self.kv_b_proj(c).view(B, N, H, self.dn + self.dv).transpose(1, 2)
            k_sh = torch.cat([kv[..., : self.dn], k_rope[:, None].expand(B, H, N, self.dr)], dim=-1)
            k, v = torch.cat([k, k_sh], dim=2), torch.cat([v, kv[..., self.dn:]], dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)

    def _attend_absorbed(self, q, k, v, shared, mask: torch.Tensor) -> torch.Tensor:
        """Decode: scores against the latent directly (W_UK folded into the query, W_UV applied after),
        concatenated with the window scores under one softmax. Window heads are read per group (the G
        query heads of a group side by side on the query axis), not repeated."""
        B, H, T, _ = q.shape
        K = self.num_kv_heads
        G = H // K
        Sw = k.shape[2]
        scores = torch.matmul(q.reshape(B, K, G * T, -1), k.transpose(-1, -2)).view(B, H, T, Sw)
        if shared is not None:
            w_uk, w_uv, bk, bv = self._split_kv_b()
            q_nope, q_rope = q.split([self.dn, self.dr], dim=-1)
            c = shared[..., : self.dc]  # (B, N, dc)
            q_lat = torch.cat([torch.matmul(q_nope, w_uk), q_rope], dim=-1)  # (B, H, T, dc + dr)
            entry = shared[:, None, :, : self.dc + self.dr]
            s_sh = torch.matmul(q_lat.view(B, 1, H * T, -1), entry.transpose(-1, -2)).view(B, H, T, -1)
            if bk is not None:  # the key bias adds q_nope . b_k to every shared logit of a head
                s_sh = s_sh + torch.einsum("bhtn,hn->bht", q_nope, bk)[..., None]
            scores = torch.cat([scores, s_sh], dim=-1)
        p = torch.softmax(scores.float().mul_(self.scale).masked_fill_(~mask, float("-inf")), dim=-1).to(q.dtype)
        y = torch.matmul(p[..., :Sw].reshape(B, K, G * T, Sw), v).view(B, H, T, self.dv)
        if shared is not None:
            p_sh = p[..., Sw:]
            y_lat = torch.matmul(p_sh.reshape(B, 1, H * T, -1), c[:, None]).view(B, H, T, self.dc)
            y = y + torch.matmul(y_lat, w_uv.transpose(-1, -2))
            if bv is not None:  # the value bias, weighted by the mass on shared entries
                y = y + p_sh.sum(-1, keepdim=True) * bv[None, :, None, :]
        return y

    def forward(
        self,
        x: torch.Tensor,  # (B, T, h), normalised hidden state
        cos: torch.Tensor,  # (B, T, head_dim) tables; this layer takes its d_rope columns
        sin: torch.Tensor,
        shared: torch.Tensor | None,  # (B, N, D) entries of the nearest source so far (training)
        step: CEDStep,
        cache=None,  # CEDCache or None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Returns the attention output (B, T, h), the shared entries later layers read and the indexer's
        training loss (None without an indexer or outside training). ``cos``/``sin`` are the d_rope
        columns this model's RoPE pairs use (``rope_tables``)."""
        B, T, _ = x.shape
        if self.is_source:
            if cache is None:
                shared = self.compressor(x, cos, sin)
            else:
                shared = cache.compress(self.layer, self.compressor, x, cos, sin)
        elif cache is not None and self.source is not None:
            shared = cache.shared(self.source)
        q, k, v = self._qkv(x, cos, sin)
        if cache is not None:
            k_all, v_all = cache.window(self.layer, k, v, step.ring_only)
        else:
            k_all, v_all = k, v
        read = shared if self.source is not None else None
        mask, aux = (step.mask if read is not None else step.window_mask), None
        if self.topk and read is not None:
            mask, aux = self._select(x, q, read, step)
        attend = self._attend_absorbed if step.absorbed else self._attend_expanded
        y = attend(q, k_all, v_all, read, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.num_heads * self.dv)), shared, aux

    # ---- the optional indexer -------------------------------------------------------------------
    def _select(self, x, q, shared, step: CEDStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Top-k selection of shared entries per query: mask (B, 1, T, Sw + N), and in training the
        indexer's loss.

        Scores (DeepSeek's lightning-indexer form): ``I[t, n] = sum_j w_j(x_t) relu(q_j(x_t) . k_I[n])``
        over ``index_heads`` heads. top-k has no gradient, so the indexer is trained by its own loss: the
        KL divergence from the layer's attention distribution over the visible shared entries (summed
        over heads, dense, detached) to softmax(I) over the same entries. The indexer reads a detached
        hidden state, so that loss moves only the indexer's weights, and the LM loss never reaches them.
        """
        B, T, _ = x.shape
        Sw = step.window_mask.shape[1]
        visible = step.mask[:, Sw:]  # (T, N)
        N = visible.shape[1]
        D = self.dc + self.dr
        xd = x.detach()
        qi = self.index_q_proj(xd).view(B, T, self.index_heads, self.di)
        wi = self.index_w_proj(xd) * self.index_heads ** -0.5  # (B, T, heads)
        ki = shared[..., D:]  # (B, N, di): from a detached input too (Compressor), trained by this loss only
        scores = torch.einsum("btjd,bnd->btjn", qi, ki).relu().mul(wi[..., None]).sum(dim=2)  # (B, T, N)
        scores = scores.float().masked_fill(~visible, float("-inf"))
        chosen = torch.zeros(B, T, N, dtype=torch.bool, device=x.device)
        if N:
            # a stable sort: ties (relu zeros) go to the earlier entry, the same in every path
            idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : min(self.topk, N)]
            chosen.scatter_(-1, idx, True)
        chosen &= visible
        mask = torch.cat([step.window_mask.expand(B, T, Sw), chosen], dim=-1)[:, None]  # (B, 1, T, Sw + N)
        aux = None
        if self.training and torch.is_grad_enabled() and N:
            with torch.no_grad():  # the target: this layer's dense attention over the visible entries
                w_uk = self._split_kv_b()[0]
                q_nope, q_rope = q.split([self.dn, self.dr], dim=-1)
                q_lat = torch.cat([torch.matmul(q_nope, w_uk), q_rope], dim=-1)
                s = torch.matmul(q_lat, shared[:, None, :, :D].transpose(-1, -2)).float() * self.scale
                target = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0).mean(1)
            rows = visible.any(-1)  # queries that see at least one shared entry
            logp = torch.log_softmax(scores, dim=-1).masked_fill(~visible, 0.0)
            kl = (target * (torch.log(target.clamp_min(1e-30)) - logp)).sum(-1)  # (B, T)
            aux = kl[:, rows].mean() if rows.any() else None
        return mask, aux


def rope_tables(config: ModelConfig, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's (B, T, head_dim) RoPE tables -> the (B, T, d_rope) columns of the pairs every layer of a
    causal encoder-decoder rotates (one layout for all layers: they share RoPE keys)."""
    idx = list(config.rope_freq_index[0])
    cols = torch.tensor(idx + [i + config.head_dim // 2 for i in idx], device=cos.device)
    return cos.index_select(-1, cols), sin.index_select(-1, cols)


def use_absorbed(cache, new_tokens: int) -> bool:
    return cache is not None and new_tokens <= DECODE_MAX_NEW_TOKENS and not torch.is_grad_enabled()
