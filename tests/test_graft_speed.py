"""The graft's faster paths equal the plain ones they replaced (tiny random models, CPU, fp32).

- ``distance_profile`` one KV group at a time, probabilities summed in fp32: equals the (B, H, T, T) fp64
  version it replaced to 1e-6 relative (GQA, MQA, sliding window, per-head q/k norms).
- MLA's cache-free causal attention pads the narrower side so the CPU's fused SDPA kernel runs: equals the
  unpadded attention to 1e-5.
- The layer-wise stand-in (the original block's norms and MLP around the new attention, allocated without
  random init) feeds the next layer exactly the hidden state the returned model computes, and the returned
  model (built on the meta device) keeps the original's RoPE tables and tied embeddings.
"""

from __future__ import annotations

import pytest
import torch

from kvgraft.graft import layer_stats as graft
from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.model.batch import DenseContext
from kvgraft.model.rope import apply_rope


def _calibration(n: int = 6, t: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (n, t), generator=torch.Generator().manual_seed(seed))


def _reference_distance_profile(block, x, cos, sin, batch_size):
    """The implementation ``distance_profile`` replaced: every head's (T, T) probabilities in fp64."""
    attn = block.self_attn
    H, K, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    T = x.shape[1]
    profile = torch.zeros(T, dtype=torch.float64)
    delta = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    allowed = delta >= 0
    if attn.window is not None:
        allowed &= delta < attn.window
    n = 0
    for start in range(0, x.shape[0], batch_size):
        sl = slice(start, start + batch_size)
        a = block.input_layernorm(x[sl])
        B = a.shape[0]
        q = attn.q_proj(a).view(B, T, H, d)
        k = attn.k_proj(a).view(B, T, K, d)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos[sl], sin[sl])
        k = apply_rope(k.transpose(1, 2), cos[sl], sin[sl]).repeat_interleave(H // K, dim=1)
        logits = (q @ k.transpose(-1, -2)) * d**-0.5
        p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).double()
        profile.index_add_(0, delta[allowed], p.sum(dim=(0, 1))[allowed])
        n += B * H * T
    return profile / n


@pytest.mark.parametrize("kind", ["gqa", "mqa", "window", "qk_norm"])
@torch.no_grad()
def test_distance_profile_equals_the_per_head_fp64_version(kind, graft_model):
    model = graft_model(num_kv_heads=1 if kind == "mqa" else 2, window=8 if kind == "window" else None, qk_norm=kind == "qk_norm")
    ids = _calibration()
    x = model.embed_tokens(ids).float()
    cos, sin = model.rotary(torch.arange(ids.shape[1]).expand_as(ids), torch.float32)
    block = model.layers[0]
    fast = graft.distance_profile(block, x, cos, sin, batch_size=4)  # uneven last batch
    ref = _reference_distance_profile(block, x, cos, sin, batch_size=4)
    assert fast.dtype == torch.float64
    torch.testing.assert_close(fast, ref, rtol=1e-6, atol=1e-9)
    assert abs(float(fast.sum()) - 1.0) < 1e-6


@pytest.mark.parametrize("d_rope", [8, 16])  # dn + dr = 24 > dv = 16 (v padded); 32 (v padded more)
@torch.no_grad()
def test_padded_causal_mla_attention_equals_the_unpadded(d_rope, graft_model):
    model = graft_model()
    new = graft_mla(
        model, GraftConfig(kv_lora_rank=16, qk_rope_head_dim=d_rope, objective="weights", rope_expectation=False), progress=False
    ).eval()
    attn = new.layers[0].self_attn
    ids = _calibration(n=2, t=24)
    x = new.layers[0].input_layernorm(new.embed_tokens(ids))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    cos, sin = new.rotary(positions, torch.float32)
    fast = attn(x, cos, sin, DenseContext(positions, default_positions=True))
    with torch.enable_grad():  # the unpadded call (padding is a no-grad CPU path)
        plain = attn(x, cos, sin, DenseContext(positions, default_positions=True)).detach()
    torch.testing.assert_close(fast, plain, rtol=0, atol=1e-5)


def test_layerwise_stand_in_feeds_the_next_layer_what_the_new_model_computes(monkeypatch, graft_model):
    model = graft_model(layers=3, tie=True)
    ids = _calibration()
    seen = []
    original = graft.second_moment

    def record(norm, x, batch_size):
        seen.append(x.clone())
        return original(norm, x, batch_size)

    monkeypatch.setattr(graft, "second_moment", record)
    g = GraftConfig(kv_lora_rank=16, qk_rope_head_dim=8, objective="attention", rope_selection="norm", layers=(0, 1))
    new = graft_mla(model, g, ids, progress=False, batch_size=4).eval()
    assert len(seen) == 2  # layers 0 and 1 only: layer 2 is not converted, so nothing is measured there
    with torch.no_grad():
        x = new.embed_tokens(ids).float()
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        cos, sin = new.rotary(positions, torch.float32)
        x = new.layers[0](x, cos, sin, DenseContext(positions, default_positions=True))
    torch.testing.assert_close(seen[1], x, rtol=0, atol=1e-5)
    # the returned model: built without random init, RoPE tables and tied embeddings as a constructed one's
    assert new.lm_head.weight is new.embed_tokens.weight
    torch.testing.assert_close(new.rotary.inv_freq, model.rotary.inv_freq, rtol=0, atol=0)
    for name, p in model.state_dict().items():
        if not name.startswith(("layers.0.self_attn.", "layers.1.self_attn.")):
            assert torch.equal(new.state_dict()[name], p), name
