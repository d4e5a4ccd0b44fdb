"""The CED's attention for a whole vLLM step at once: no loop over requests, two reads merged by log-sum-exp.

A CED layer attends, in one softmax, over its own window (the last W tokens' ``[k ; v]`` rows) and over the
pooled entries of its kv_source layer visible to the query (``b m <= i - W``). One softmax over two key sets
is two attentions merged by their log-sum-exp, so each read runs for every query of the step as one batched
computation and vLLM's ``merge_attn_states`` (its cascade/chunked-prefill merge: a torch fallback on the CPU,
CUDA/Triton kernels on GPUs) joins them:

- **tiles**: a request's new tokens are cut into tiles of ``Q = min(TILE, longest query)`` consecutive
  queries (decode steps: one query per tile). A tile's window keys are the ``W + Q - 1`` positions ending at
  its last query, gathered from vLLM's blocks by the group's block table: a tile of 16 prefill queries reads
  79 rows, not 16 x 64; the band mask ``q <= s <= q + W - 1`` gives each query its own last W;
- **window read** (grouped heads, no repeat): scores, log-sum-exp and values per tile;
- **stream read** (absorbed: ``W_UK`` folded into the query, ``W_UV`` applied after, as kvgraft's decode): the
  entries ``0 .. n_t - 1`` a tile's last query sees, padded to the step's longest, masked per query;
- **writes**: the step's window rows and pending rows go to vLLM's slot mapping; each pooling block whose
  last token arrives in the step is pooled from the pending rows and written to its stream row.

Every index (tiles, gathers, masks, write slots) is computed on the host by the cache groups' metadata
builders (:func:`build_indices`), once per group and step, from the scheduler's query offsets and sequence
lengths: the forward (:func:`ced_attention`) is tensor ops over fixed indices, with no host sync and no
data-dependent Python. With adapters, each tile's request's ``kv_b`` delta joins the stream read (the
projections' deltas are applied per token by kvgraft's adapter layers); configs with an indexer take the
per-request path (``kvgraft.vllm.context``), which runs kvgraft's own layer code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kvgraft.model.batch import current_context
from kvgraft.vllm.geometry import PENDING, STREAM, WINDOW

ATTENTION_ENV = "KVGRAFT_VLLM_CED_ATTENTION"  # "fused" (default: torch's fused CPU attention) or "torch"
_ATTENTION = os.environ.get(ATTENTION_ENV, "fused")
if _ATTENTION not in ("fused", "torch"):
    raise ValueError(f"{ATTENTION_ENV}={_ATTENTION!r}: expected 'fused' or 'torch'")
TILE = 16  # queries per prefill tile: 16 x (W + 15) window scores instead of a request's T x (T + W)


@dataclass
class Tiles:
    """The step's queries cut into tiles (host arrays; every group's builder computes the same)."""

    Q: int  # queries per tile
    req: np.ndarray  # (tiles,) request of each tile (vLLM's order)
    p0: np.ndarray  # (tiles,) position of each tile's first query
    last: np.ndarray  # (tiles,) position of each tile's last real query
    qidx: np.ndarray  # (tiles, Q) token (packed axis) of each query; padding queries repeat the tile's first
    inv: np.ndarray  # (tokens,) each token's place in the (tiles * Q) flattened tile axis
    pos: np.ndarray  # (tokens,) each token's position
    tok_req: np.ndarray  # (tokens,) each token's request
    lens: np.ndarray  # (requests,) sequence length once the step is done


def plan_tiles(query_start: np.ndarray, seq_lens: np.ndarray, tile: int = TILE) -> Tiles:
    """Tiles of the step whose request r has tokens ``query_start[r] .. query_start[r + 1] - 1`` ending at
    position ``seq_lens[r] - 1``."""
    qs = query_start.astype(np.int64)
    lens = seq_lens.astype(np.int64)
    R = len(lens)
    T = qs[1 : R + 1] - qs[:R]
    start = lens - T
    Q = int(max(1, min(tile, int(T.max()) if R else 1)))
    nt = (T + Q - 1) // Q
    first_tile = np.cumsum(nt) - nt
    req = np.repeat(np.arange(R), nt)
    k = np.arange(int(nt.sum())) - first_tile[req]
    p0 = start[req] + k * Q
    nvalid = np.minimum(Q, T[req] - k * Q)
    j = np.arange(Q)
    tok0 = qs[req] + k * Q
    qidx = np.where(j[None] < nvalid[:, None], tok0[:, None] + j[None], tok0[:, None])
    tok_req = np.repeat(np.arange(R), T)
    o = np.arange(int(T.sum())) - (qs[tok_req] - qs[0])
    inv = (first_tile[tok_req] + o // Q) * Q + o % Q
    return Tiles(Q, req, p0, p0 + nvalid - 1, qidx, inv, start[tok_req] + o, tok_req, lens)


@dataclass
class BatchIndex:
    """One cache group's indices for one step (torch tensors on the cache's device); which fields are set
    depends on the group's kind. (blocks, rows) pairs address ``CEDCacheLayer.rows()``."""

    Q: int
    qidx: torch.Tensor  # (tiles * Q,) token of each tile query
    inv: torch.Tensor  # (tokens,) each token's tile query
    write_tok: torch.Tensor | None = None  # window / pending: tokens written (slot >= 0)
    write_at: tuple[torch.Tensor, torch.Tensor] | None = None  # their (block, row)
    key_at: tuple[torch.Tensor, torch.Tensor] | None = None  # window: (tiles, S) keys of each tile
    key_ok: torch.Tensor | None = None  # window: (tiles, S, 1) key position inside the sequence
    band: torch.Tensor | None = None  # window: (tiles, Q, S) query q sees key s (its last W positions, >= 0)
    entry_at: tuple[torch.Tensor, torch.Tensor] | None = None  # stream: (tiles, N) entries read per tile
    entry_ok: torch.Tensor | None = None  # stream: (tiles, N, 1) entry visible to the tile's last query
    visible: torch.Tensor | None = None  # stream: (tiles, Q, N) query q sees entry b (b m <= i - W)
    tile_req: torch.Tensor | None = None  # stream: (tiles,) each tile's request (its adapter's kv_b delta)
    done_tok: torch.Tensor | None = None  # stream, m == 1: the tokens whose entries are written
    done_at: tuple[torch.Tensor, torch.Tensor] | None = None  # stream: (C,) rows of the completed entries
    pool_at: tuple[torch.Tensor, torch.Tensor] | None = None  # pending: (C, m) rows pooled per entry
    masks: dict[tuple[str, torch.dtype], torch.Tensor] = field(default_factory=dict)  # additive masks, made once


def _at(table: torch.Tensor, req: np.ndarray, pos: np.ndarray, block: int, per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids, rows) of positions ``pos`` of requests ``req`` (same shapes) in a group's block table."""
    dev = table.device
    r = torch.from_numpy(np.array(req, dtype=np.int64)).to(dev)  # a copy: broadcast views are read-only
    p = torch.from_numpy(np.array(pos, dtype=np.int64)).to(dev)
    return table[r, p // block].long(), (p % block) // per_row


def build_indices(
    kind: str,
    tiles: Tiles,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    window: int,
    compress_rate: int,
) -> BatchIndex:
    """The indices one group of kind ``kind`` (window, stream, pending) needs for the step ``tiles``."""
    dev = block_table.device
    t = tiles
    Q, m, W = t.Q, compress_rate, window
    n_tok = len(t.pos)
    out = BatchIndex(Q, torch.from_numpy(t.qidx.reshape(-1)).to(dev), torch.from_numpy(t.inv).to(dev))
    if kind in (WINDOW, PENDING):
        slots = slot_mapping[:n_tok].long()
        tok = torch.nonzero(slots >= 0).flatten()
        if len(tok) == n_tok:
            tok = torch.arange(n_tok, device=slots.device)
        s = slots.index_select(0, tok)
        out.write_tok, out.write_at = tok, (s // block_size, s % block_size)
    if kind == WINDOW:
        S = W + Q - 1
        kpos = t.p0[:, None] - W + 1 + np.arange(S)[None]  # (tiles, S)
        last = t.lens[t.req][:, None] - 1
        ok = (kpos >= 0) & (kpos <= last)
        out.key_at = _at(block_table, np.broadcast_to(t.req[:, None], kpos.shape), np.clip(kpos, 0, last), block_size, 1)
        out.key_ok = torch.from_numpy(ok[..., None]).to(dev)
        q, s_ = np.arange(Q)[:, None], np.arange(S)[None]
        out.band = torch.from_numpy(((s_ >= q) & (s_ <= q + W - 1))[None] & ok[:, None, :]).to(dev)
    if kind == STREAM:
        n = np.maximum(0, (t.last - W) // m + 1)  # entries the tile's last query sees
        N = int(n.max()) if len(n) else 0
        b = np.arange(N)[None]
        first = np.minimum(b, np.maximum(n[:, None] - 1, 0)) * m  # (tiles, N) an entry's first token, clamped
        out.entry_at = _at(block_table, np.broadcast_to(t.req[:, None], first.shape), first, block_size, m)
        out.entry_ok = torch.from_numpy((b < n[:, None])[..., None]).to(dev)
        qpos = t.p0[:, None] + np.arange(Q)[None]
        out.visible = torch.from_numpy((b * m)[:, None, :] <= qpos[:, :, None] - W).to(dev)
        out.tile_req = torch.from_numpy(t.req.astype(np.int64)).to(dev)
    if kind in (STREAM, PENDING):
        done = np.flatnonzero((t.pos + 1) % m == 0)  # tokens that complete a pooling block
        first = t.pos[done] - m + 1
        if kind == STREAM:
            out.done_at = _at(block_table, t.tok_req[done], first, block_size, m)
            if m == 1:
                out.done_tok = torch.from_numpy(done).to(dev)
        elif m > 1:
            pool = first[:, None] + np.arange(m)[None]
            out.pool_at = _at(block_table, np.broadcast_to(t.tok_req[done][:, None], pool.shape), pool, block_size, 1)
    return out


def _required(value: Any, what: str) -> Any:
    if value is None:
        raise ValueError(f"the step's batched indices have no {what} (built for another cache kind)")
    return value


def compress(
    comp: Any,
    entries: torch.Tensor,
    scores: torch.Tensor | None,
    stream: torch.Tensor,
    stream_ix: BatchIndex,
    pending: torch.Tensor | None,
    pending_ix: BatchIndex | None,
) -> None:
    """A kv_source layer's writes for the whole step: ``entries`` (N, E) its tokens' entries
    (``Compressor.token_entries``), ``scores`` (N, D) their gate scores (m > 1); ``stream`` / ``pending``
    are the caches' (blocks, rows, width) views. Every token's entry and scores go to the pending rows; each
    entry completed in the step is pooled from them and written to the stream (m = 1: written directly)."""
    done_at = _required(stream_ix.done_at, "stream rows")
    if comp.m == 1:
        tok = _required(stream_ix.done_tok, "stream tokens")
        stream[done_at] = entries.index_select(0, tok).to(stream.dtype)
        return
    if pending is None or pending_ix is None or scores is None:
        raise ValueError("pooling m > 1 tokens per entry needs the pending cache and the gate scores")
    E = entries.shape[-1]
    rows = torch.cat([entries, scores.to(entries.dtype)], dim=-1)
    tok = _required(pending_ix.write_tok, "pending slots")
    pending[_required(pending_ix.write_at, "pending slots")] = rows.index_select(0, tok).to(pending.dtype)
    pool_at = _required(pending_ix.pool_at, "pending rows to pool")
    C, m = pool_at[0].shape
    if C == 0:
        return
    got = pending[pool_at].to(entries.dtype).view(1, C * m, -1)  # (1, C m, E + D)
    stream[done_at] = comp.pool(got[..., :E], got[..., E:])[0].to(stream.dtype)


def _kv_b(attn: Any, base: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``attn.split_kv_b()``; ``base``: the base weights while the step's adapters are applied by the caller."""
    ctx = current_context()
    if not base or ctx is None:
        return attn.split_kv_b()
    with ctx.base_weights():
        return attn.split_kv_b()


def _gather(cache: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``cache[at]`` for a cache (blocks, rows, width) and (block ids, rows) index tensors of one shape, as one
    ``index_select`` (on the CPU far cheaper than indexing with two tensors) over a view whose row i starts at
    the cache's element i: every (block, row) is then one index, whatever padding the pages have."""
    nb, R, width = cache.shape
    sb, sr = cache.stride(0), cache.stride(1)
    if cache.stride(2) != 1:
        return cache[at]
    starts = cache.as_strided(((nb - 1) * sb + (R - 1) * sr + 1, width), (1, 1))  # no byte past the last row
    out: torch.Tensor = starts.index_select(0, (at[0] * sb + at[1] * sr).reshape(-1))
    return out.view(*at[0].shape, width)


def _fused(t: torch.Tensor) -> bool:
    """Whether a read runs as torch's fused CPU attention with LSE output (the CPU and ``ATTENTION_ENV`` unset
    or ``fused``); otherwise as plain batched torch ops (other devices, or ``ATTENTION_ENV=torch``)."""
    return t.device.type == "cpu" and _ATTENTION == "fused"


def _additive(ix: BatchIndex, key: str, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` (bool) as an additive mask of ``dtype`` (0 / -inf), made once per step and group."""
    hit = ix.masks.get((key, dtype))
    if hit is None:
        hit = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        ix.masks[(key, dtype)] = hit
    return hit


def _window_read(
    qt: torch.Tensor, rows: torch.Tensor, ix: BatchIndex, K: int, dk: int, dv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every tile's queries qt (tiles Q, H, dk) (scaled) over its window rows (tiles, S, K (dk + dv)) under the
    band mask: (tiles, H, Q, dv) outputs and (tiles, H, Q) float log-sum-exps. Grouped heads (no repeat): a key
    head's query heads side by side on the query axis."""
    Q = ix.Q
    n_tiles, S = rows.shape[0], rows.shape[1]
    H = qt.shape[1]
    rep = H // K
    band = _required(ix.band, "window band")  # (tiles, Q, S)
    qg = qt.view(n_tiles, Q, K, rep, dk).permute(0, 2, 3, 1, 4).reshape(n_tiles, K, rep * Q, dk)
    if _fused(qt):
        k = rows[..., : K * dk].view(n_tiles, S, K, dk).transpose(1, 2)  # (tiles, K, S, dk)
        v = rows[..., K * dk :].view(n_tiles, S, K, dv).transpose(1, 2)  # (tiles, K, S, dv)
        D = max(dk, dv)  # the kernel wants one head size: zero columns change no score and no used output
        qg, k, v = (F.pad(t, (0, D - t.shape[-1])) if t.shape[-1] < D else t for t in (qg, k, v))
        mask = _additive(ix, f"band{rep}", band.repeat(1, rep, 1)[:, None], qt.dtype)  # (tiles, 1, rep Q, S)
        y, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k, v, 0.0, False, attn_mask=mask, scale=1.0)
        return y[..., :dv].reshape(n_tiles, H, Q, dv), lse.reshape(n_tiles, H, Q).float()
    kt = rows[..., : K * dk].view(n_tiles, S, K, dk).permute(0, 2, 3, 1)  # (tiles, K, dk, S)
    v = rows[..., K * dk :].view(n_tiles, S, K, dv).transpose(1, 2)  # (tiles, K, S, dv)
    s = torch.matmul(qg, kt).view(n_tiles, H, Q, S).float()
    s = s.masked_fill(~band[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (tiles, H, Q): every query sees itself
    p = torch.exp(s - lse[..., None]).to(qt.dtype)
    return torch.matmul(p.view(n_tiles, K, rep * Q, S), v).view(n_tiles, H, Q, dv), lse


def _stream_read(
    q_lat: torch.Tensor, ent: torch.Tensor, ix: BatchIndex, H: int, dc: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The absorbed stream read: q_lat (tiles, Q H, dc + dr) over the entries (tiles, N, dc + dr) each query
    sees -> the latent output (tiles, Q H, dc), the float log-sum-exp (tiles, Q, H; -inf where nothing is
    visible yet) and the probability mass on the entries (tiles, Q, H: 1, or 0 where nothing is visible)."""
    Q = ix.Q
    n_tiles = q_lat.shape[0]
    visible = _required(ix.visible, "stream mask")  # (tiles, Q, N)
    if _fused(q_lat):
        mask = _additive(ix, f"visible{H}", visible.repeat_interleave(H, dim=1)[:, None], q_lat.dtype)
        e = ent[:, None]  # (tiles, 1, N, dc + dr): the keys, and the values (the first dc columns are used)
        y, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_lat[:, None], e, e, 0.0, False, attn_mask=mask, scale=1.0
        )
        seen = visible.any(-1)[..., None].expand(n_tiles, Q, H)  # the kernel gives 0, not -inf, for an empty row
        lse = lse.reshape(n_tiles, Q, H).float().masked_fill(~seen, float("-inf"))
        return y[:, 0, :, :dc], lse, seen.float()
    s = torch.matmul(q_lat, ent.transpose(1, 2)).view(n_tiles, Q, H, -1).float()  # (tiles, Q, H, N)
    s = s.masked_fill(~visible[:, :, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (tiles, Q, H): -inf where nothing is visible yet
    p = torch.exp(s - lse.nan_to_num(0.0, posinf=0.0, neginf=0.0)[..., None])
    y = torch.matmul(p.to(q_lat.dtype).view(n_tiles, Q * H, -1), ent[..., :dc])
    return y, lse, p.sum(-1)


def ced_attention(
    attn: Any,
    q: torch.Tensor,
    entry: torch.Tensor,
    window: torch.Tensor,
    window_ix: BatchIndex,
    stream: torch.Tensor | None,
    stream_ix: BatchIndex | None,
    kv_b_delta: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One CED layer's attention (``CEDAttention``'s weights) for every scheduled token of the step:
    q (1, H, N, dk) rotated queries and entry (1, N, K (dk + dv)) window rows (``CEDAttention._qkv``) ->
    (tokens, H dv), before ``o_proj`` (N may exceed the scheduled tokens: vLLM's padding). ``window`` /
    ``stream`` are the layer's window cache and its source's stream cache as (blocks, rows, width); the
    source's writes are already done. ``kv_b_delta``: per request of the step, the LoRA factors of its
    adapter on this layer's ``kv_b_proj`` (A (R, r, dc), B (R, H (dn + dv), r), scale folded into B, zero for
    the base: ``MultiLoraLinear.row_factors``), added low-rank to the absorbed stream read, as kvgraft's
    ``LatentAttention.attend`` does per row; the base ``kv_b`` is then read inside ``base_weights``."""
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    H, K, dn, dr, dv, dc = attn.num_heads, attn.num_kv_heads, attn.dn, attn.dr, attn.dv, attn.dc
    dk = dn + dr
    tok = _required(window_ix.write_tok, "window slots")
    window[_required(window_ix.write_at, "window slots")] = entry[0].index_select(0, tok).to(window.dtype)

    Q = window_ix.Q
    qt = q[0].transpose(0, 1).index_select(0, window_ix.qidx) * attn.scale  # (tiles Q, H, dk)
    n_tiles = qt.shape[0] // Q
    # window: (tiles, S, K (dk + dv)) rows. vLLM allocates its caches zeroed and writes only finite rows, so on the
    # fused path a row outside the sequence is finite and its mask alone removes it
    rows = _gather(window, _required(window_ix.key_at, "window keys"))
    if not _fused(qt):  # keys outside the sequence zeroed (masked, but 0 * nan = nan); the fused path masks them only
        rows = rows.masked_fill(~_required(window_ix.key_ok, "window keys"), 0)
    rows = rows.to(qt.dtype)
    y_w, lse_w = _window_read(qt, rows, window_ix, K, dk, dv)  # (tiles, H, Q, dv), (tiles, H, Q)
    inv = window_ix.inv
    out_w = y_w.transpose(1, 2).reshape(n_tiles * Q, H, dv).index_select(0, inv)  # (N, H, dv)
    if stream is None or stream_ix is None:
        return out_w.reshape(-1, H * dv)
    at = _required(stream_ix.entry_at, "stream entries")
    if at[0].shape[1] == 0:  # no query of the step sees an entry yet
        return out_w.reshape(-1, H * dv)
    ent = _gather(stream, at)[..., : dc + dr]
    if not _fused(qt):
        ent = ent.masked_fill(~_required(stream_ix.entry_ok, "stream entries"), 0)
    ent = ent.to(qt.dtype)
    w_uk, w_uv, bk, bv = _kv_b(attn, kv_b_delta is not None)  # (H, dn, dc), (H, dv, dc), (H, dn)?, (H, dv)?
    q_nope, q_rope = qt[..., :dn], qt[..., dn:]  # (tiles Q, H, .)
    q_c = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (tiles Q, H, dc)
    if kv_b_delta is not None:  # + q_nope B_k A per tile's request: (t, Q, H, dn) (t, H, dn, r) (t, r, dc)
        tile_req = _required(stream_ix.tile_req, "tile requests")
        A = kv_b_delta[0].index_select(0, tile_req).to(qt.dtype)  # (tiles, r, dc)
        B = kv_b_delta[1].index_select(0, tile_req).to(qt.dtype).view(n_tiles, H, dn + dv, -1)
        qr = torch.einsum("tqhn,thnr->tqhr", q_nope.reshape(n_tiles, Q, H, dn), B[:, :, :dn])
        q_c = q_c + torch.einsum("tqhr,trc->tqhc", qr, A).reshape(n_tiles * Q, H, dc)
    q_lat = torch.cat([q_c, q_rope], dim=-1).view(n_tiles, Q * H, dc + dr)
    y_lat, lse_s, mass = _stream_read(q_lat, ent, stream_ix, H, dc)  # (tiles, Q H, dc), (tiles, Q, H) x 2
    if bk is not None:  # the key bias adds q_nope . b_k to every entry's logit of a head: to the LSE only
        lse_s = lse_s + (q_nope * bk).sum(-1).view(n_tiles, Q, H).float()
    y_s = torch.bmm(y_lat.view(n_tiles * Q, H, dc).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    if kv_b_delta is not None:  # + y_lat A^T B_v^T per tile's request
        yr = torch.einsum("tqhc,trc->tqhr", y_lat.view(n_tiles, Q, H, dc), A)
        y_s = y_s + torch.einsum("tqhr,thvr->tqhv", yr, B[:, :, dn:]).reshape(n_tiles * Q, H, dv)
    if bv is not None:  # the value bias, weighted by the mass on the entries (1, or 0 when none is visible)
        y_s = y_s + mass.view(n_tiles * Q, H, 1).to(y_s.dtype) * bv
    out_s = y_s.index_select(0, inv).contiguous()  # (N, H, dv)
    lse_s = lse_s.view(n_tiles * Q, H).index_select(0, inv).transpose(0, 1).contiguous()
    lse_w = lse_w.transpose(1, 2).reshape(n_tiles * Q, H).index_select(0, inv).transpose(0, 1).contiguous()
    out = torch.empty_like(out_w)
    merge_attn_states(out, out_w.contiguous(), lse_w, out_s, lse_s)
    return out.reshape(-1, H * dv)
