"""The one runtime: rows at different lengths and phases in one forward equal each sequence alone, for
every attention kind and layout; weights read through one door (an adapter delta reaches absorbed decode);
the layer -> source map in one place; clear errors for a bad batch."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from kvgraft.model.batch import BatchContext
from kvgraft.model.cache import PagedKVCache
from kvgraft.model.config import ModelConfig, cache_layout
from kvgraft.model.presets import get_preset
from kvgraft.model.transformer import Transformer

MLA = dict(attention_kinds=("mla", "mla"), kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
LAYOUTS = {
    "llama": ("llama-tiny", {}),
    "mistral-window": ("llama-tiny", dict(sliding_window=5)),
    "qwen2-mixed-window": (
        "llama-tiny",
        dict(sliding_window=6, layer_types=("sliding_attention", "full_attention"), qkv_bias=True),
    ),
    "qwen3-qk-norm": ("llama-tiny", dict(qk_norm=True, head_dim=16)),
    # head width 32 (a vector path of the CPU kernel that attends every row in one call)
    "llama-d32": ("llama-tiny", dict(head_dim=32)),
    "qwen2-mixed-window-d32": (
        "llama-tiny",
        dict(sliding_window=6, layer_types=("sliding_attention", "full_attention"), qkv_bias=True, head_dim=32),
    ),
    "qwen3-qk-norm-d32": ("llama-tiny", dict(qk_norm=True, head_dim=32)),
    "shared-slot-d32": ("llama-tiny", dict(kv_slots=(0, 0), head_dim=32)),
    "shared-slot": ("llama-tiny", dict(kv_slots=(0, 0))),
    "mla": ("llama-tiny", MLA),
    "mla-qk-norm-window": ("llama-tiny", dict(MLA, qk_norm=True, head_dim=16, sliding_window=7)),
    "ced-m2": ("ced-tiny", {}),
    "ced-m3": ("ced-tiny", dict(compress_rate=3, sliding_window=5, qkv_bias=True)),
    "ced-indexer": ("ced-tiny", dict(index_topk=3, index_heads=2, index_head_dim=8)),
}


def build(preset: str, changes: dict, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(get_preset(preset).replace(**changes))
    model.init_weights(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)  # far from the init's near-uniform outputs
            elif p.dim() == 3 or "gate_bias" in str(p.shape):
                p.normal_(0.0, 0.5)
    return model.eval()


@pytest.mark.parametrize("paged", [True, False], ids=["rows-in-one-call", "by-group"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rows_at_different_lengths_and_phases_equal_each_sequence_alone(name, paged, monkeypatch):
    from kvgraft.model import cpu_kernels

    monkeypatch.setattr(BatchContext, "paged", paged)  # GQA layers: every row in one kernel call, or group by group
    calls = []
    kernel = cpu_kernels.paged_attention
    monkeypatch.setattr(cpu_kernels, "paged_attention", lambda *a: calls.append(1) or kernel(*a))
    preset, changes = LAYOUTS[name]
    model = build(preset, changes)
    cfg = model.config
    lengths = (1, 7, 30, 50)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    block = 6 if cfg.is_ced and cfg.compress_rate == 3 else 4
    cache = PagedKVCache(cfg, num_blocks=60, block_size=block, max_seqs=4, max_seq_len=64)
    ids = [cache.add_sequence() for _ in seqs]
    done, outs = [0] * 4, [[] for _ in seqs]
    rng = random.Random(0)
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
        while any(d < len(s) for d, s in zip(done, seqs)):
            rows = [r for r in range(4) if done[r] < len(seqs[r]) and rng.random() < 0.8]
            if not rows:
                continue
            ts = [min(rng.choice([1, 1, 2, 3, 9]), len(seqs[r]) - done[r]) for r in rows]
            logits = model(
                torch.cat([seqs[r][done[r] : done[r] + t] for r, t in zip(rows, ts)]),
                ctx=BatchContext(cache, [ids[r] for r in rows], ts),
            )[0]
            o = 0
            for r, t in zip(rows, ts):
                outs[r].append(logits[o : o + t])
                o += t
                done[r] += t
    for got, want in zip(outs, full):
        torch.testing.assert_close(torch.cat(got), want, atol=5e-5, rtol=0)
    assert [cache.length(i) for i in ids] == list(lengths)
    # the one-call path: GQA layers over paged pools (not only window rings) at a width the kernel runs (AVX-512:
    # 32, 64 or 128; the portable build: any)
    mod = cpu_kernels.kernel()
    one_call = paged and bool(cache.head_major) and mod is not None and mod.paged_vectorized(cfg.head_dim)
    assert bool(calls) == one_call  # the path the test names ran


class DeltaLinear(nn.Module):
    """A stand-in adapter: base(x) + x A^T B^T, exposing effective_weight() as an adapter wrapper would."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.A = nn.Parameter(torch.randn(rank, base.in_features) * 0.3)
        self.B = nn.Parameter(torch.randn(base.out_features, rank) * 0.3)

    def forward(self, x):
        return self.base(x) + x @ self.A.T @ self.B.T

    def effective_weight(self):
        return self.base.weight + self.B @ self.A, self.base.bias


@pytest.mark.parametrize("name", ["mla", "ced-m2"])
def test_absorbed_decode_reads_adapter_deltas_on_q_kv_b_and_o(name):
    preset, changes = LAYOUTS[name]
    changes = dict(changes, kv_lora_rank=4) if name == "mla" else changes  # small d_c: the folded path
    model = build(preset, changes)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids)
        for layer in model.layers:
            attn = layer.self_attn
            for proj in ("q_proj", "kv_b_proj", "o_proj"):
                if hasattr(attn, proj):
                    setattr(attn, proj, DeltaLinear(getattr(attn, proj)))
        full = model(ids)  # cache-free: expanded path through the modules' forward
        assert (full - before).abs().max() > 1e-2  # the deltas matter
        cache = model.new_cache(2, 32)
        steps = [model(ids[:, :9], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(9, 24)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=5e-5, rtol=0)
    if name == "mla":
        assert model.layers[0].self_attn.fold_q and model.layers[0].self_attn.fold_o


def test_layer_to_source_map_is_one_function():
    ced = get_preset("ced-tiny")  # kv_source layers 1, 2
    assert [ced.kv_source_of(i) for i in range(4)] == [None, 1, 2, 2]
    shared = get_preset("llama-tiny").replace(kv_slots=(0, 0))
    assert [shared.kv_source_of(i) for i in range(2)] == [0, 0] and not shared.is_kv_writer(1)
    model = Transformer(ced)
    assert [layer.self_attn.source for layer in model.layers] == [None, 1, 2, 2]
    layout = cache_layout(ced)
    assert sorted(layout.segments) == [1, 2] and sorted(layout.rings) == [0, 1, 2, 3] and not layout.paged
    assert sorted(cache_layout(shared).paged) == [0]


def test_bad_batches_are_named():
    cfg: ModelConfig = get_preset("llama-tiny")
    cache = PagedKVCache(cfg, num_blocks=4, block_size=4, max_seqs=2, max_seq_len=16)
    a = cache.add_sequence()
    with pytest.raises(ValueError, match="appears twice"):
        BatchContext(cache, [a, a], [1, 1])
    with pytest.raises(ValueError, match="positive integers"):
        BatchContext(cache, [a], [0])
    with pytest.raises(ValueError, match="cache overflow: 17 tokens > max_seq_len 16"):
        BatchContext(cache, [a], [17])
    with pytest.raises(KeyError, match="unknown sequence 9"):
        BatchContext(cache, [9], [1])
    with pytest.raises(ValueError, match="block_size \\(4\\) must be a multiple of compress_rate \\(3\\)"):
        PagedKVCache(get_preset("ced-tiny").replace(compress_rate=3, sliding_window=8), num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="num_blocks \\(0\\)"):
        PagedKVCache(cfg, num_blocks=0)
    model = Transformer(cfg)
    with pytest.raises(ValueError, match="3 tokens given for a step of 2"):
        model(torch.zeros(3, dtype=torch.long), ctx=BatchContext(cache, [a], [2]))
