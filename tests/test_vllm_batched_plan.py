"""The vLLM plugin's batched-attention indices (``kvgraft.vllm.batched``), checked without vLLM: every query of a
step lands in exactly one tile, each tile's window band and stream mask are the CED's visibility rules
(window ``i - W < j <= i``, stream ``b m <= i - W``) position by position, and the write/pool slots address the
tokens vLLM's block tables give them. (The attention itself is tested against kvgraft's engine in tests/vllm.)"""

from __future__ import annotations

import numpy as np
import torch

from kvgraft.vllm.batched import build_indices, plan_tiles
from kvgraft.vllm.geometry import PENDING, STREAM, WINDOW

W, M = 8, 2


def _step(lengths_before: list[int], new: list[int]):
    qs = np.concatenate([[0], np.cumsum(new)]).astype(np.int64)
    lens = np.asarray(lengths_before, dtype=np.int64) + np.asarray(new, dtype=np.int64)
    return qs, lens


def _table(R: int, blocks: int) -> torch.Tensor:
    # distinct block ids per request (request r, logical block k -> 1000 r + k), so an address names its position
    return torch.arange(blocks)[None] + 1000 * torch.arange(R)[:, None]


def test_tiles_cover_every_query_once_and_invert():
    qs, lens = _step([0, 5, 30, 0], [17, 1, 3, 40])  # a prefill, a decode, a short chunk, a long prefill
    t = plan_tiles(qs, lens)
    assert t.Q == 16
    flat = t.qidx.reshape(-1)
    n = int(qs[-1])
    # each token's place in the tile axis holds that token
    assert (flat[t.inv] == np.arange(n)).all()
    assert sorted(set(t.inv.tolist())) == sorted(t.inv.tolist()), "two tokens share a tile query"
    assert (t.pos == np.concatenate([np.arange(b - k, b) for b, k in zip(lens, np.diff(qs))])).all()
    decode = plan_tiles(*_step([9, 3], [1, 1]))
    assert decode.Q == 1 and decode.qidx.shape == (2, 1)


def test_window_band_and_stream_mask_are_the_ced_rules():
    qs, lens = _step([0, 11, 3], [13, 1, 20])
    t = plan_tiles(qs, lens)
    block = 4
    table = _table(3, 16)
    slots = torch.stack([table[r, p // block] * block + p % block for r, p in zip(t.tok_req, t.pos)])
    win = build_indices(WINDOW, t, table, slots, block, W, M)
    stream = build_indices(STREAM, t, table, slots, 8, W, M)
    S = W + t.Q - 1
    for ti in range(len(t.req)):
        r = int(t.req[ti])
        for q in range(t.Q):
            i = int(t.p0[ti]) + q
            if i > t.last[ti]:
                continue  # a padding query of the tile
            for s in range(S):
                j = int(t.p0[ti]) - W + 1 + s
                want = i - W < j <= i and j >= 0
                assert bool(win.band[ti, q, s]) == want, (ti, q, s)
                if want:  # the address is position j's block and row in request r's table
                    blk, row = win.key_at[0][ti, s], win.key_at[1][ti, s]
                    assert int(blk) == 1000 * r + j // block and int(row) == j % block
            N = stream.visible.shape[-1]
            for b in range(N):
                assert bool(stream.visible[ti, q, b]) == (b * M <= i - W), (ti, q, b)
                if b * M <= i - W:
                    assert bool(stream.entry_ok[ti, b, 0])
                    blk, row = stream.entry_at[0][ti, b], stream.entry_at[1][ti, b]
                    assert int(blk) == 1000 * r + (b * M) // 8 and int(row) == (b * M % 8) // M
    # the window rows written are every scheduled token's slot
    assert torch.equal(win.write_at[0] * block + win.write_at[1], slots)


def test_pooling_reads_the_block_of_each_completing_token():
    qs, lens = _step([3, 0], [4, 5])  # request 0: positions 3..6, request 1: 0..4
    t = plan_tiles(qs, lens)
    table = _table(2, 8)
    slots = torch.stack([table[r, p // 4] * 4 + p % 4 for r, p in zip(t.tok_req, t.pos)])
    pend = build_indices(PENDING, t, table, slots, 4, W, M)
    stream = build_indices(STREAM, t, table, slots, 8, W, M)
    done = [(int(r), int(p)) for r, p in zip(t.tok_req, t.pos) if (p + 1) % M == 0]
    assert done == [(0, 3), (0, 5), (1, 1), (1, 3)]
    for c, (r, p) in enumerate(done):
        got = [(int(b), int(w)) for b, w in zip(pend.pool_at[0][c], pend.pool_at[1][c])]
        assert got == [(1000 * r + x // 4, x % 4) for x in range(p - M + 1, p + 1)]
        first = p - M + 1
        assert (int(stream.done_at[0][c]), int(stream.done_at[1][c])) == (1000 * r + first // 8, first % 8 // M)
