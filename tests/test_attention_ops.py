"""grouped_attention (the decode-step kernel) equals scaled_dot_product_attention."""

import pytest
import torch
import torch.nn.functional as F

from kvgraft.model.attention_ops import grouped_attention


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("t", [1, 3])
def test_grouped_attention_equals_sdpa(heads, kv_heads, t):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, t, 16, generator=g)
    k = torch.randn(2, kv_heads, 20, 16, generator=g)
    v = torch.randn(2, kv_heads, 20, 12, generator=g)  # value width may differ
    mask = torch.ones(t, 20, dtype=torch.bool).tril(20 - t)
    mask[:, :3] = False  # e.g. a sliding window
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1), attn_mask=mask, scale=0.3
    )
    torch.testing.assert_close(grouped_attention(q, k, v, mask, 0.3), want, atol=1e-6, rtol=1e-5)
    if t == 1:
        full = F.scaled_dot_product_attention(
            q, k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1), scale=0.3
        )
        torch.testing.assert_close(grouped_attention(q, k, v, None, 0.3), full, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dq,dv", [(48, 32), (32, 48), (32, 32)])
@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_with_unequal_widths_equals_plain_sdpa(dq, dv, masked):
    """attention_ops.sdpa pads the narrower side with zero columns (keeping the CPU's fused kernel): the
    same result as plain SDPA, with the same default scale, causal or masked."""
    from kvgraft.model.attention_ops import sdpa

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 9, dq, generator=g), torch.randn(2, 4, 13, dq, generator=g)
    v = torch.randn(2, 4, 13, dv, generator=g)
    kw = dict(attn_mask=torch.rand(2, 1, 9, 13, generator=g) > 0.3) if masked else dict(is_causal=True)
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q, k, v, **kw)
        got = sdpa(q, k, v, **kw)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_strided_head_matmuls_equal_the_contiguous_ones():
    """The decode helpers that read strided views in place (rows of a pool at a fixed stride, a window's heads
    side by side in each row, kv_b's head slices) give what the plain matmuls give on contiguous copies."""
    from kvgraft.model.attention_ops import grouped_attention_head_major, grouped_attention_strided, head_matmul
    from kvgraft.model.latent import per_head

    g = torch.Generator().manual_seed(0)
    G, H, K, T, S, d = 3, 8, 4, 2, 11, 16
    pool = torch.randn(2 * K, 5, 16, d, generator=g)  # head-major, 5 slots of 16 positions
    view = pool[:, 1:4, :S]  # slots 1..3: rows at a stride of 16 positions, heads at a stride of 5 slots
    q = torch.randn(G, H, T, d, generator=g)
    mask = torch.rand(G, T, S, generator=g) > 0.3
    mask[..., 0] = True
    want = grouped_attention_head_major(q, view[:K].contiguous(), view[K:].contiguous(), mask, d**-0.5)
    torch.testing.assert_close(grouped_attention_strided(q, view[:K], view[K:], mask, d**-0.5), want, atol=1e-6, rtol=0)

    rows = torch.randn(G, S, K * d, generator=g)  # a window: (G, S, K d), heads side by side
    k = rows.view(G, S, K, d).transpose(1, 2)  # (G, K, S, d), no common stride for rows and heads
    a = torch.randn(G, K, T * H // K, d, generator=g)
    torch.testing.assert_close(head_matmul(a, k.transpose(-1, -2)), torch.matmul(a, k.contiguous().transpose(-1, -2)))
    w = torch.randn(H, d + 5, 7, generator=g)[:, :d]  # a slice of kv_b's rows per head
    x = torch.randn(G, H, T, d, generator=g)
    torch.testing.assert_close(per_head(x, w), torch.matmul(x, w), atol=1e-5, rtol=0)
