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
- Optional indexer (``index_topk``, off by default) and where the shared entries live: :class:`CEDAttention`.

"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from kvgraft.errors import ConfigError
from kvgraft.model.attention_ops import DECODE_MAX_NEW_TOKENS
from kvgraft.model.batch import StepContext
from kvgraft.model.config import ModelConfig
from kvgraft.model.latent import LatentAttention
from kvgraft.model.norm import RMSNorm
from kvgraft.model.packed import linears
from kvgraft.model.plan import MIXED
from kvgraft.model.rope import apply_rope


class Compressor(nn.Module):
    """A kv_source layer's KV writer: hidden state -> shared entries (latent ; rotated RoPE key)."""

    kv_a_norm: RMSNorm | None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, b = config.hidden_size, config.qkv_bias
        self.dc, self.dr, _, _ = config.latent_dims()
        self.m = config.compress_rate
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
        c, k_rope = torch.split(self.kv_a_proj(x), [self.dc, self.dr], dim=-1)
        if self.kv_a_norm is not None:
            c = self.kv_a_norm(c)
        parts = [c, apply_rope(k_rope[:, None], cos, sin)[:, 0]]
        if self.di:  # a detached input: the indexer's loss trains the indexer, nothing else
            parts.append(self.index_k_proj(x.detach()))
        return torch.cat(parts, dim=-1)

    def gate_scores(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, T, h), positions (B, T) -> pooling logits (B, T, d_c + d_rope)."""
        scores: torch.Tensor = self.gate_proj(x) + self.gate_bias[positions % self.m]
        return scores

    def pool(self, entries: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        """(B, n*m, E) block-aligned tokens -> (B, n, E) pooled entries (identity when m == 1): the gated
        weighting for latent and RoPE key, the plain mean for the indexer's key."""
        if self.m == 1:
            return entries
        if scores is None:
            raise ConfigError(f"pooling blocks of {self.m} tokens needs their gate scores")
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
        if self.m == 1:
            return entries
        pos = torch.arange(n, device=x.device).expand(x.shape[0], n)
        return self.pool(entries, self.gate_scores(x[:, :n], pos))


class CEDAttention(LatentAttention):
    """One layer of the causal encoder-decoder: its window plus the shared path (the module docstring).

    Optional indexer (``index_topk``, off by default): each reading layer scores the visible shared entries with a
    small multi-head scorer against a key the compressor adds to every entry, and attends to the top-k only. top-k
    passes no gradient, so the indexer is trained by its own loss: KL from the layer's dense attention over the
    visible entries to the indexer's softmax, on a detached input, added to the training loss by the loop
    (``Transformer.aux_loss``). Off, every visible entry is attended.

    The shared entries are the cross-layer state: the step context (``kvgraft.model.batch``) holds them, in the
    paged cache's segments with a cache, in the step's scratch without one (a checkpointed layer recomputes with
    exactly the entries it read the first time, and the gradient reaches the compressor that wrote them). The
    attention math over the latents is ``kvgraft.model.latent.LatentAttention``, shared with MLA. Shapes: G rows, T
    new tokens, N shared entries, H heads, K window heads.
    """

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        h, H, K, b = config.hidden_size, config.num_heads, config.num_kv_heads, config.qkv_bias
        self.num_heads, self.num_kv_heads = H, K
        self.dc, self.dr, self.dn, self.dv = config.latent_dims()
        if config.sliding_window is None:
            raise ConfigError("a causal encoder-decoder layer needs sliding_window")
        self.window: int = config.sliding_window
        self.q_proj = nn.Linear(h, H * (self.dn + self.dr), bias=b)
        self.k_proj = nn.Linear(h, K * (self.dn + self.dr), bias=b)  # window keys (own hidden state)
        self.v_proj = nn.Linear(h, K * self.dv, bias=b)
        self.o_proj = nn.Linear(H * self.dv, h, bias=config.o_bias)
        self.source = config.kv_source_of(layer)  # nearest kv_source layer at or before this one (or None)
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

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        q, k, v = linears(x, self.q_proj, self.k_proj, self.v_proj)  # one matmul on packed weights
        q = q.view(B, T, self.num_heads, -1).transpose(1, 2)
        k = k.view(B, T, self.num_kv_heads, -1)
        q = torch.cat([q[..., : self.dn], apply_rope(q[..., self.dn :], cos, sin)], dim=-1)
        k_rope = apply_rope(k[..., self.dn :].transpose(1, 2), cos, sin).transpose(1, 2)
        k = torch.cat([k[..., : self.dn], k_rope], dim=-1).reshape(B, T, -1)
        return q, torch.cat([k, v], dim=-1)  # (B, H, T, dn+dr), window entry (B, T, K (dn+dr) + K dv)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x (B, N, h) normalised hidden state -> (B, N, h). ``cos``/``sin`` are the d_rope columns every
        layer rotates (``rope_tables``). The indexer's training loss goes to ``ctx.scratch["aux"]``."""
        K, dk = self.num_kv_heads, self.dn + self.dr
        if self.is_source:
            for gi, g in ctx.each_group():
                ctx.compress(self.layer, gi, self.compressor, g.take(x), g.take(cos), g.take(sin))
        q, entry = self._qkv(x, cos, sin)
        out = None
        widths = (K, dk, self.dc + self.dr if self.source is not None else None, self.dc)
        for gi, g in ctx.each_group():
            qg = q if g.tok is None else g.take(q.transpose(1, 2)).transpose(1, 2)  # (G, H, T, dk)
            if not self.topk and ctx.ring_decode_applies(self.layer, gi, self.source, widths):
                y = self._decode_rows(ctx, gi, qg, g.take(entry), widths)  # decode rows: ring and latents in one call
            else:
                y = self._attend_group(ctx, gi, qg, g.take(entry), g.take(x))
            y = self.o_proj(y.transpose(1, 2).reshape(g.G, g.T, self.num_heads * self.dv))
            out = g.put(out if out is not None else x.new_empty(*x.shape[:2], y.shape[-1]), y)
        if out is None:
            raise ConfigError("a step context has at least one group")
        return out

    def _kv_b_adapters(self, ctx: StepContext, gi: int) -> tuple[Any, bool]:
        """(kv_b: a linear or an adapter wrapper around one, whether group ``gi`` holds rows of several adapters with
        one on kv_b: then no one kv_b serves every row)."""
        kv_b: Any = getattr(self, "kv_b_proj", None)
        loras = getattr(kv_b, "loras", {})
        g = ctx.groups[gi]
        return kv_b, g.adapter is MIXED and any(a in loras for a, _ in g.adapter_rows)

    def _decode_rows(
        self, ctx: StepContext, gi: int, q: torch.Tensor, entry: torch.Tensor, widths: tuple[int, int, int | None, int]
    ) -> torch.Tensor:
        """(G, H, 1, dv): group ``gi``'s decode rows (queries (G, H, 1, dk), new window entries (G, 1, E)) through
        the context's one call over each row's ring and shared entries (``StepContext.ring_decode``), W_UK and W_UV
        applied here (with each row's adapter delta on kv_b where the group mixes adapters)."""
        kv_b, mixed = self._kv_b_adapters(ctx, gi)
        with ctx.base_weights() if mixed else contextlib.nullcontext():
            delta = kv_b.row_factors(ctx.row_adapters(gi)) if mixed else None
            qs, q_lat, bias = self.absorbed_queries(q, self.source is not None, delta)
            yw, yl, mass = ctx.ring_decode(
                self.layer,
                gi,
                entry,
                qs[:, :, 0],
                None if q_lat is None else q_lat[:, :, 0],
                None if bias is None else bias[..., 0],
                self.source,
                widths,
            )
            if q_lat is None:
                return yw[:, :, None]
            return self.absorbed_values(yw[:, :, None], yl[:, :, None], mass[:, :, None, None], delta)

    def _attend_group(self, ctx: StepContext, gi: int, qg: torch.Tensor, entry: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(G, H, T, dv): group ``gi``'s queries (G, H, T, dk) over its window (new entries (G, T, E)) and the
        shared entries it sees, read as tensors with a mask (prompt chunks, training, the indexer, no kernel)."""
        K, dk = self.num_kv_heads, self.dn + self.dr
        g = ctx.groups[gi]
        win, kpos = ctx.kv(self.layer, gi, entry).entries()  # (G, S, K (dk + dv))
        G, S = win.shape[:2]
        k = win[..., : K * dk].view(G, S, K, dk).transpose(1, 2)
        v = win[..., K * dk :].view(G, S, K, self.dv).transpose(1, 2)
        mask = ctx.window_mask(gi, kpos, self.window, "ring")
        shared = None
        if self.source is not None:
            shared, first = ctx.segment(self.source, gi)
            smask = ctx.scratch.get(("smask", gi, self.window))
            if smask is None:
                smask = ctx.scratch[("smask", gi, self.window)] = shared_visible(first, g.qpos, self.window)
            if self.topk:
                smask = self._select(x, qg, shared, smask, ctx)
                mask = torch.cat([mask, smask], dim=-1)
            else:  # [window ; shared] visibility: the same for every layer of the step with this window
                joined = ctx.scratch.get(("joined mask", gi, self.window))
                if joined is None:
                    joined = ctx.scratch[("joined mask", gi, self.window)] = torch.cat([mask, smask], dim=-1)
                mask = joined
        absorbed = ctx.cache is not None and g.T <= DECODE_MAX_NEW_TOKENS and not torch.is_grad_enabled()
        kv_b, mixed = self._kv_b_adapters(ctx, gi)
        if not mixed:
            return self.attend(qg, k, v, shared, mask, absorbed)  # (G, H, T, dv): one kv_b for every row
        if absorbed:  # rows of several adapters on kv_b: the base kv_b plus each row's low-rank delta
            with ctx.base_weights():
                return self.attend(qg, k, v, shared, mask, absorbed, kv_b_delta=kv_b.row_factors(ctx.row_adapters(gi)))
        # expanded: kv_b through the door, one adapter at a time
        if shared is None:
            raise ConfigError(f"layer {self.layer}: adapters on kv_b, but the layer reads no shared entries")
        y = qg.new_empty(G, self.num_heads, g.T, self.dv)
        for _, rows in ctx.each_adapter(gi):
            if rows is None:
                raise ConfigError("a group of several adapters names each adapter's rows")
            sub = self.attend(qg[rows], k[rows], v[rows], shared[rows], mask[rows], absorbed)
            y.index_copy_(0, rows, sub.to(y.dtype))
        return y

    # ---- the optional indexer -------------------------------------------------------------------
    def _select(
        self, x: torch.Tensor, q: torch.Tensor, shared: torch.Tensor, visible: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        """Top-k selection of the visible shared entries per query: (G, T, N) bool; in training the
        indexer's loss is appended to ``ctx.scratch["aux"]``.

        Scores (DeepSeek's lightning-indexer form): ``I[t, n] = sum_j w_j(x_t) relu(q_j(x_t) . k_I[n])``
        over ``index_heads`` heads. top-k has no gradient, so the indexer is trained by its own loss: the
        KL divergence from the layer's attention distribution over the visible shared entries (summed
        over heads, dense, detached) to softmax(I) over the same entries. The indexer reads a detached
        hidden state, so that loss moves only the indexer's weights, and the LM loss never reaches them.
        """
        B, T, _ = x.shape
        N = visible.shape[-1]
        D = self.dc + self.dr
        xd = x.detach()
        qi = self.index_q_proj(xd).view(B, T, self.index_heads, self.di)
        wi = self.index_w_proj(xd) * self.index_heads**-0.5  # (B, T, heads)
        ki = shared[..., D:]  # (B, N, di): from a detached input too (Compressor), trained by this loss only
        scores = torch.einsum("btjd,bnd->btjn", qi, ki).relu().mul(wi[..., None]).sum(dim=2)  # (B, T, N)
        scores = scores.float().masked_fill(~visible, float("-inf"))
        chosen = torch.zeros(B, T, N, dtype=torch.bool, device=x.device)
        if N:
            # a stable sort: ties (relu zeros) go to the earlier entry, the same in every path
            k = N if self.topk is None else min(self.topk, N)
            idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
            chosen.scatter_(-1, idx, True)
        chosen &= visible
        if self.training and torch.is_grad_enabled() and N:
            with torch.no_grad():  # the target: this layer's dense attention over the visible entries
                w_uk = self.split_kv_b()[0]
                q_nope, q_rope = torch.split(q, [self.dn, self.dr], dim=-1)
                q_lat = torch.cat([torch.matmul(q_nope, w_uk), q_rope], dim=-1)
                s = torch.matmul(q_lat, shared[:, None, :, :D].transpose(-1, -2)).float() * self.scale
                target = torch.softmax(s.masked_fill(~visible[:, None], float("-inf")), dim=-1).nan_to_num(0.0).mean(1)
            rows = visible.any(-1)  # queries that see at least one shared entry
            logp = torch.log_softmax(scores, dim=-1).masked_fill(~visible, 0.0)
            kl = (target * (torch.log(target.clamp_min(1e-30)) - logp)).sum(-1)  # (B, T)
            if rows.any():
                ctx.scratch.setdefault("aux", []).append(kl[rows].mean())
        return chosen


def shared_visible(first: torch.Tensor, qpos: torch.Tensor, window: int) -> torch.Tensor:
    """(G, T, N) bool: query at position i reads the shared entry whose block starts at token ``first``
    once that token has left its window, ``first <= i - W`` (first (G, N), qpos (G, T))."""
    return first[:, None, :] <= qpos[:, :, None] - window


def rope_tables(config: ModelConfig, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's (B, T, head_dim) RoPE tables -> the (B, T, d_rope) columns of the pairs every layer of a
    causal encoder-decoder rotates (one layout for all layers: they share RoPE keys)."""
    if config.rope_freq_index is None:
        raise ConfigError("a causal encoder-decoder config has rope_freq_index")
    idx = list(config.rope_freq_index[0])
    cols = torch.tensor(idx + [i + config.head_dim // 2 for i in idx], device=cos.device)
    return cos.index_select(-1, cols), sin.index_select(-1, cols)
