"""The CPU kernel that attends every row of a step at once through the rows' block tables
(kvgraft.model.cpu_kernels.paged_attention): equal to softmax attention over each row's gathered keys (torch's SDPA)
for decode tokens and prompt chunks of any lengths in one call, with and without a window, for every GQA grouping
and head width it vectorizes; clear refusals of rows that do not tile the step or reach outside their tables."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgraft.model import cpu_kernels as ck

pytestmark = pytest.mark.skipif(
    ck.kernel() is None or not ck.kernel().paged_vectorized(64), reason="kvgraft's CPU kernels are not built"
)


def reference(q, pool, tables, rows, window, scale):
    """Each row's keys gathered from its blocks, its queries attended with SDPA and a causal (window) mask."""
    K = pool.shape[0] // 2
    H, bs = q.shape[1], pool.shape[2]
    out = torch.empty_like(q)
    for r, (off, T, start) in enumerate(rows.tolist()):
        end = start + T
        kv = pool[:, tables[r, : -(-end // bs)]].reshape(2 * K, -1, pool.shape[-1])[:, :end]
        k, v = kv[:K].repeat_interleave(H // K, 0), kv[K:].repeat_interleave(H // K, 0)
        qpos, kpos = torch.arange(start, end)[:, None], torch.arange(end)[None]
        mask = kpos <= qpos
        if window:
            mask &= qpos - kpos < window
        y = F.scaled_dot_product_attention(q[off : off + T].transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        out[off : off + T] = y.transpose(0, 1)
    return out


def step(D, H, K, seed=0, tokens=(1, 1, 40, 1, 17, 3, 100, 1), starts=(5, 300, 0, 31, 64, 7, 20, 0), bs=16):
    """A pool of scattered blocks, rows of decode tokens and prompt chunks, and their queries as one q/k/v matmul
    leaves them (token-major, strided)."""
    g = torch.Generator().manual_seed(seed)
    blocks = 3200 // bs
    pool = torch.randn(2 * K, blocks, bs, D, generator=g)
    nb = max(-(-(s + t) // bs) for s, t in zip(starts, tokens)) + 2
    tables = torch.stack([torch.randperm(blocks, generator=g)[:nb] for _ in tokens])
    offsets = [sum(tokens[:i]) for i in range(len(tokens))]
    rows = torch.tensor([[o, t, s] for o, t, s in zip(offsets, tokens, starts)])
    qkv = torch.randn(sum(tokens), (H + 2 * K) * D, generator=g)
    return qkv[:, : H * D].view(-1, H, D), pool, tables, rows


@pytest.mark.parametrize(
    "D,H,K,window",
    [(64, 9, 3, 0), (32, 4, 4, 0), (128, 8, 2, 0), (64, 6, 1, 37), (32, 8, 2, 16)],
    ids=["smollm2-gqa", "mha-32", "gqa-128", "mqa-window", "window-one-block"],
)
def test_every_row_of_a_step_equals_sdpa_over_its_gathered_keys(D, H, K, window):
    q, pool, tables, rows = step(D, H, K)
    got = ck.paged_attention(q, pool, tables, rows, window, D**-0.5)
    assert got is not None and got.shape == q.shape
    torch.testing.assert_close(got, reference(q, pool, tables, rows, window, D**-0.5), atol=2e-6, rtol=1e-5)


def test_rows_may_share_blocks_and_read_only_their_own_keys():
    """Two rows over the same blocks (a shared prompt) at different lengths: each sees its own prefix only."""
    q, pool, tables, rows = step(64, 9, 3, tokens=(1, 1, 20), starts=(10, 200, 50))
    tables[1] = tables[0]
    tables[2] = tables[0]
    torch.testing.assert_close(
        ck.paged_attention(q, pool, tables, rows, None, 0.125), reference(q, pool, tables, rows, 0, 0.125), atol=2e-6, rtol=1e-5
    )


def test_rows_in_runs_of_consecutive_blocks():
    """Rows whose blocks are consecutive ids (at their slot's home) or runs of them are read a run at a time:
    the same attention as block by block, a run ending anywhere in a row."""
    q, pool, tables, rows = step(64, 9, 3, tokens=(1, 1, 1, 33), starts=(300, 77, 150, 90))
    nb = tables.shape[1]
    tables[0] = torch.arange(nb) + 10  # one run
    tables[1] = torch.cat([torch.arange(3) + 100, torch.arange(nb - 3) + 40])  # two runs, the break after block 3
    tables[2] = torch.arange(nb).flip(0) + 60  # descending ids: no run longer than a block
    tables[3] = torch.cat([torch.arange(5) + 150, torch.arange(nb - 5) + 5])
    torch.testing.assert_close(
        ck.paged_attention(q, pool, tables, rows, None, 0.125), reference(q, pool, tables, rows, 0, 0.125), atol=2e-6, rtol=1e-5
    )
    torch.testing.assert_close(
        ck.paged_attention(q, pool, tables, rows, 40, 0.125), reference(q, pool, tables, rows, 40, 0.125), atol=2e-6, rtol=1e-5
    )


@pytest.mark.parametrize("bs", [4, 8, 32, 48])
def test_blocks_of_other_sizes(bs):
    """Decode rows read their keys 16 at a time within a run of consecutive blocks: blocks smaller than 16 keys,
    larger, and not a multiple of 16, scattered and in runs, with and without a window."""
    q, pool, tables, rows = step(64, 9, 3, tokens=(1, 1, 1, 1, 25), starts=(300, 77, 150, 16, 90), bs=bs)
    nb = tables.shape[1]
    tables[0] = torch.arange(nb) + 3  # one run
    tables[1] = torch.cat([torch.arange(2) + 50, torch.arange(nb - 2) + 9 + nb])  # two runs
    for window in (0, 21):
        torch.testing.assert_close(
            ck.paged_attention(q, pool, tables, rows, window, 0.125),
            reference(q, pool, tables, rows, window, 0.125),
            atol=2e-6,
            rtol=1e-5,
        )


def test_what_the_kernel_declines_or_refuses():
    q, pool, tables, rows = step(64, 9, 3)
    assert ck.paged_attention(q.double(), pool.double(), tables, rows, None, 0.125) is None  # not float32
    q16, pool16, t16, r16 = step(16, 4, 2)
    if torch.backends.cpu.get_cpu_capability() == "AVX512":  # the tuned path: widths 32, 64 and 128 only
        assert ck.paged_attention(q16, pool16, t16, r16, None, 0.25) is None
    else:  # the portable path (AVX2 or none): any width
        torch.testing.assert_close(
            ck.paged_attention(q16, pool16, t16, r16, None, 0.25), reference(q16, pool16, t16, r16, 0, 0.25), atol=2e-6, rtol=1e-5
        )
    gaps = rows.clone()
    gaps[2, 0] += 1
    with pytest.raises(RuntimeError, match="does not follow the rows before it"):
        ck.paged_attention(q, pool, tables, gaps, None, 0.125)
    short = rows.clone()
    short[1, 2] = tables.shape[1] * 16  # more keys than its table holds
    with pytest.raises(RuntimeError, match="its table holds"):
        ck.paged_attention(q, pool, tables, short, None, 0.125)
    outside = tables.clone()
    outside[0, 0] = pool.shape[1]
    with pytest.raises(RuntimeError, match="outside the pool"):
        ck.paged_attention(q, pool, outside, rows, None, 0.125)
    with pytest.raises(RuntimeError, match="cover"):
        ck.paged_attention(q, pool, tables[:-1], rows[:-1], None, 0.125)  # the last row's queries left out
    with pytest.raises(RuntimeError, match="one table per row"):
        ck.paged_attention(q, pool, tables[:-1], rows, None, 0.125)
